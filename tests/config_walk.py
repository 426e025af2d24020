"""Where one value travels through the package: a static walk of the call graph from a function's parameter.

The walk starts at `module:function`'s parameter and follows every call that passes the value itself (the name, a
local alias of it, or an attribute of `self` it was stored in) to a function, method or class the call resolves to
(by the module's imports, absolute or relative, at module level or inside functions). Passing a part of it
(`cfg.data`) is the narrow interface the walk is about, so it is not followed; neither is a call whose target
cannot be resolved statically. A class that stores the value (`self.x = value`) is walked in all its methods.
The modules visited are those of every function the value reached.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeGuard


@dataclass
class _Module:
    name: str
    tree: ast.Module
    is_package: bool
    imports: dict[str, str] = field(default_factory=dict)  # local name -> dotted target
    defs: dict[str, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef] = field(default_factory=dict)


class Package:
    """The parsed modules of a package directory (`root` is the package itself, e.g. src/gaudi3_scale)."""

    def __init__(self, root: Path) -> None:
        self.modules: dict[str, _Module] = {}
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root.parent).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if is_package else parts)
            tree = ast.parse(path.read_text(), str(path))
            self.modules[name] = _Module(name, tree, is_package)
        for module in self.modules.values():
            self._index(module)

    def _index(self, module: _Module) -> None:
        for node in module.tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                module.defs[node.name] = node
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        module.imports[alias.asname] = alias.name
                    else:
                        module.imports[alias.name.split(".")[0]] = alias.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = module.name.split(".") if module.is_package else module.name.split(".")[:-1]
                    parent = parent[: len(parent) - node.level + 1]
                    base = ".".join([*parent, *([node.module] if node.module else [])])
                for alias in node.names:
                    module.imports[alias.asname or alias.name] = f"{base}.{alias.name}"

    # ---- name resolution -----------------------------------------------------------------------------------
    def definition(self, dotted: str, depth: int = 0) -> tuple[str, str] | None:
        """(module, top-level name) that `dotted` (module.name) refers to, following re-exports and lazy tables."""
        if depth > 4 or "." not in dotted:
            return None
        module_name, name = dotted.rsplit(".", 1)
        module = self.modules.get(module_name)
        if module is None or dotted in self.modules:
            return None
        if name in module.defs:
            return module_name, name
        if name in module.imports:
            return self.definition(module.imports[name], depth + 1)
        lazy = _lazy_table(module.tree).get(name)  # a package's `__getattr__` table: name -> module
        return self.definition(f"{lazy}.{name}", depth + 1) if lazy else None

    def resolve_call(self, module: _Module, cls: str | None, func: ast.expr) -> tuple[str, str] | None:
        """The (module, qualified name) a call's target is: a function, `Class.method` or `Class.__init__`."""
        target: tuple[str, str] | None = None
        if isinstance(func, ast.Name):
            if func.id in module.defs:
                target = (module.name, func.id)
            elif func.id in module.imports:
                target = self.definition(module.imports[func.id])
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            owner = func.value.id
            if owner in ("self", "cls") and cls is not None:
                return self._method(module.name, cls, func.attr)
            if owner in module.defs and isinstance(module.defs[owner], ast.ClassDef):
                return self._method(module.name, owner, func.attr)
            dotted = module.imports.get(owner)
            if dotted in self.modules:  # module.function
                target = self.definition(f"{dotted}.{func.attr}")
            elif dotted is not None:  # ImportedClass.method
                found = self.definition(dotted)
                if found is not None:
                    return self._method(found[0], found[1], func.attr)
        if target is None:
            return None
        node = self.modules[target[0]].defs[target[1]]
        if isinstance(node, ast.ClassDef):
            return self._method(target[0], target[1], "__init__") or (target[0], target[1])
        return target

    def _method(self, module_name: str, cls: str, name: str) -> tuple[str, str] | None:
        node = self.modules[module_name].defs.get(cls)
        if not isinstance(node, ast.ClassDef):
            return None
        for item in node.body:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name == name:
                return module_name, f"{cls}.{name}"
        for base in node.bases:  # an inherited method, from a base class in the package
            if isinstance(base, ast.Name):
                found = self.resolve_call(self.modules[module_name], None, base)
                if found is not None:
                    base_module, base_name = found
                    found = self._method(base_module, base_name.split(".")[0], name)
                    if found is not None:
                        return found
        return None

    def function(
        self, module_name: str, qualname: str
    ) -> ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef:
        module = self.modules[module_name]
        parts = qualname.split(".")
        node: ast.AST = module.defs[parts[0]]
        for part in parts[1:]:
            assert isinstance(node, ast.ClassDef)
            node = next(
                item
                for item in node.body
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name == part
            )
        assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        return node


def _lazy_table(tree: ast.Module) -> dict[str, str]:
    """A module-level dict literal of name -> dotted module strings (the package's lazy export table)."""
    table: dict[str, str] = {}
    for node in tree.body:
        value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
        if isinstance(value, ast.Dict):
            for key, item in zip(value.keys, value.values, strict=True):
                name = key.value if isinstance(key, ast.Constant) else None
                home = item.value if isinstance(item, ast.Constant) else None
                if isinstance(name, str) and isinstance(home, str):
                    table[name] = home  # `definition` keeps those that name a module
    return table


def _params(node: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[list[str], set[str]]:
    positional = [a.arg for a in (*node.args.posonlyargs, *node.args.args)]
    return positional, {*positional, *(a.arg for a in node.args.kwonlyargs)}


@dataclass
class Walk:
    """The functions a value reached, as (module, qualified name) in the order first reached."""

    reached: list[tuple[str, str]] = field(default_factory=list)

    @property
    def modules(self) -> list[str]:
        return list(dict.fromkeys(module for module, _ in self.reached))


def walk(package: Package, module_name: str, qualname: str, param: str) -> Walk:
    result = Walk()
    seen: set[tuple[str, str, str]] = set()
    stored: dict[tuple[str, str], set[str]] = {}  # (module, class) -> attributes of self holding the value
    queue: list[tuple[str, str, str]] = [(module_name, qualname, param)]
    while queue:
        module_name, qualname, name = queue.pop(0)
        if (module_name, qualname, name) in seen:
            continue
        seen.add((module_name, qualname, name))
        if (module_name, qualname) not in result.reached:
            result.reached.append((module_name, qualname))
        node = package.function(module_name, qualname)
        if isinstance(node, ast.ClassDef):  # a dataclass given the value: it holds it in a field
            stored.setdefault((module_name, node.name), set()).add(name)
            queue += _methods(module_name, node, name)
            continue
        cls = qualname.split(".")[0] if "." in qualname else None
        attrs = stored.get((module_name, cls), set()) if cls else set()
        held = {name} if name != "self" else set()
        queue += _follow(package, package.modules[module_name], cls, node, held, attrs, stored)
    return result


def _methods(module_name: str, cls: ast.ClassDef, attr: str) -> list[tuple[str, str, str]]:
    """Every method of a class holding the value in `self.attr` is walked (with `self` standing for the holder)."""
    return [
        (module_name, f"{cls.name}.{item.name}", f"self.{attr}")
        for item in cls.body
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
    ]


def _follow(
    package: Package,
    module: _Module,
    cls: str | None,
    node: ast.FunctionDef | ast.AsyncFunctionDef,
    held: set[str],
    attrs: set[str],
    stored: dict[tuple[str, str], set[str]],
) -> Iterator[tuple[str, str, str]]:
    holds_value = set(held)
    self_attrs = set(attrs)
    for name in list(holds_value):
        if name.startswith("self."):
            self_attrs.add(name.removeprefix("self."))
            holds_value.discard(name)

    def is_value(expr: ast.expr) -> bool:
        if isinstance(expr, ast.Name):
            return expr.id in holds_value
        return (
            isinstance(expr, ast.Attribute)
            and isinstance(expr.value, ast.Name)
            and expr.value.id == "self"
            and expr.attr in self_attrs
        )

    def carries(expr: ast.expr) -> bool:
        """The expression's result is the value: itself, `a or value`, `value if … else b`, `replace(value, …)`."""
        if is_value(expr):
            return True
        if isinstance(expr, ast.BoolOp):
            return any(carries(v) for v in expr.values)
        if isinstance(expr, ast.IfExp):
            return carries(expr.body) or carries(expr.orelse)
        if isinstance(expr, ast.Call) and expr.args:
            func = expr.func
            name = (
                func.attr
                if isinstance(func, ast.Attribute)
                else func.id
                if isinstance(func, ast.Name)
                else ""
            )
            return name == "replace" and carries(expr.args[0])
        return False

    for _ in range(2):  # an alias of an alias
        yield from _aliases(module, cls, node, carries, holds_value, self_attrs, stored)
    for call in ast.walk(node):
        if not isinstance(call, ast.Call):
            continue
        passed = [(i, arg) for i, arg in enumerate(call.args) if carries(arg)]
        passed_kw = [(kw.arg, kw.value) for kw in call.keywords if kw.arg and carries(kw.value)]
        if not passed and not passed_kw:
            continue
        target = package.resolve_call(module, cls, call.func)
        if target is None:
            continue
        yield from _into(package.function(*target), target, passed, passed_kw)


def _aliases(
    module: _Module,
    cls: str | None,
    node: ast.FunctionDef | ast.AsyncFunctionDef,
    carries: Callable[[ast.expr], bool],
    holds_value: set[str],
    self_attrs: set[str],
    stored: dict[tuple[str, str], set[str]],
) -> Iterator[tuple[str, str, str]]:
    """Names and attributes of self that receive the value; a new attribute walks all the class's methods."""
    for stmt in ast.walk(node):
        if isinstance(stmt, ast.Assign | ast.AnnAssign) and stmt.value is not None and carries(stmt.value):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    holds_value.add(target.id)
                elif _is_self_attribute(target) and cls and target.attr not in self_attrs:
                    stored.setdefault((module.name, cls), set()).add(target.attr)
                    self_attrs.add(target.attr)
                    class_node = module.defs[cls]
                    assert isinstance(class_node, ast.ClassDef)
                    yield from _methods(module.name, class_node, target.attr)


def _is_self_attribute(expr: ast.expr) -> TypeGuard[ast.Attribute]:
    return isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id == "self"


def _into(
    callee: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef,
    target: tuple[str, str],
    passed: list[tuple[int, ast.expr]],
    passed_kw: list[tuple[str, ast.expr]],
) -> Iterator[tuple[str, str, str]]:
    """The parameters (or dataclass fields) of `callee` that receive the value."""
    if isinstance(callee, ast.ClassDef):  # a dataclass: the value lands in the field of that name or place
        fields = [
            s.target.id
            for s in callee.body
            if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
        ]
        yield from ((*target, fields[index]) for index, _ in passed if index < len(fields))
        yield from ((*target, keyword) for keyword, _ in passed_kw)
        return
    positional, names = _params(callee)
    if positional and positional[0] in ("self", "cls"):
        positional = positional[1:]
    for index, _ in passed:
        if index < len(positional):
            yield (*target, positional[index])
        elif callee.args.vararg is not None:
            yield (*target, callee.args.vararg.arg)
    for keyword, _ in passed_kw:
        if keyword in names:
            yield (*target, keyword)
        elif callee.args.kwarg is not None:
            yield (*target, callee.args.kwarg.arg)
