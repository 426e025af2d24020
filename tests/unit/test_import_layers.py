"""The package's layers hold: imports go down (or sideways within a layer), never up, and never in a circle.

Every module under src/gaudi3_scale is parsed (not imported); its imports — absolute and relative, at module level
or inside functions — are the edges of the graph. Those under `if TYPE_CHECKING:` never run, so the layer checks
leave them out; the module-circle check counts them too: a type-only import still makes two modules depend on each
other (neither can be read, moved or split without the other).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import gaudi3_scale

ROOT = Path(gaudi3_scale.__file__).parent

# The one layer table: a package (or a root-level module) may import its own layer and the ones below it.
# A root-level module is named by its file stem; "gaudi3_scale" is the package's own __init__.
LAYERS: dict[str, int] = {
    **dict.fromkeys(["config", "lazy", "document", "process_exit", "source"], 0),
    **dict.fromkeys(["device", "storage"], 1),  # storage: fsspec URLs, for data and checkpoint
    **dict.fromkeys(["models", "data", "distributed", "checkpoint", "monitor", "metering", "health"], 2),
    **dict.fromkeys(["lightning_hook"], 2),  # registers distributed.lightning_ns when Lightning is imported
    **dict.fromkeys(["train"], 3),
    **dict.fromkeys(
        ["tune", "bench", "cost", "serve", "deploy", "dashboard", "artifacts", "verify", "forecast"], 4
    ),
    **dict.fromkeys(["cli"], 5),
    # Public re-export shims, placed by what they re-export. They are for users: nothing in the package imports
    # them (code imports the real home, e.g. `device.precision`, not `gaudi3_scale.precision`).
    **dict.fromkeys(["precision"], 1),
    **dict.fromkeys(["gaudi3_scale", "memory", "profiler"], 2),
    **dict.fromkeys(["batch"], 4),
}
FACADES = {"gaudi3_scale", "batch", "precision", "memory", "profiler"}
LAYER_NAMES = ["config", "device", "models/data/distributed/…", "train", "tools", "cli"]

Edge = tuple[str, str, str]  # importer module, imported module, "file:line"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST, *, type_checking: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under `node`; the bodies of `if TYPE_CHECKING:` only with `type_checking`."""
    for child in ast.iter_child_nodes(node):
        if not type_checking and isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield from _imports_in(other, type_checking=type_checking)
            continue
        yield from _imports_in(child, type_checking=type_checking)


def _imports_in(node: ast.AST, *, type_checking: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
    yield from _imports(node, type_checking=type_checking)


def import_edges(modules: Mapping[str, Path], *, type_checking: bool = False) -> list[Edge]:
    """(importer, imported, where) for every import of one module of `modules` by another; with `type_checking`,
    the imports under `if TYPE_CHECKING:` too."""
    edges = []
    for name, path in sorted(modules.items()):
        is_package = path.name == "__init__.py"
        here = path.relative_to(ROOT.parent) if path.is_relative_to(ROOT.parent) else path
        tree = ast.parse(path.read_text(), str(path))
        for node in _imports(tree, type_checking=type_checking):
            where = f"{here}:{node.lineno}"
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parent = name.split(".") if is_package else name.split(".")[:-1]
                    parent = parent[: len(parent) - node.level + 1]
                    base = ".".join([*parent, *([node.module] if node.module else [])])
                # `from pkg import sub` imports the submodule; `from pkg import name` reads pkg's attribute.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            edges += [(name, target, where) for target in dict.fromkeys(targets) if target in modules]
    return edges


def unit(module: str) -> str:
    """The layer-table key of a module: its top-level package, or its stem at the root."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def upward_imports(edges: Iterable[Edge], layers: Mapping[str, int], facades: set[str]) -> list[str]:
    problems = []
    for importer, imported, where in edges:
        low, high = unit(importer), unit(imported)
        if low == high:
            continue
        if high in facades:
            problems.append(f"{where}: {importer} imports the facade {imported}; import its real home")
        elif layers[high] > layers[low]:
            problems.append(
                f"{where}: {importer} ({low}, layer {layers[low]}) imports {imported} ({high}, layer {layers[high]})"
            )
    return problems


def circles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:  # recursion depth is bounded by the package's module count (a few hundred)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def module_graph(edges: Iterable[Edge]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for importer, imported, _ in edges:
        if importer != imported:
            graph.setdefault(importer, set()).add(imported)
    return graph


def package_graph(edges: Iterable[Edge]) -> dict[str, set[str]]:
    return module_graph((unit(a), unit(b), where) for a, b, where in edges)


def _package_edges(*, type_checking: bool = False) -> list[Edge]:
    modules = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
    return import_edges(modules, type_checking=type_checking)


def test_every_package_is_in_the_layer_table() -> None:
    units = {unit(module_name(p)) for p in ROOT.rglob("*.py")}
    assert sorted(units - set(LAYERS)) == [], "add the new package to LAYERS"


def test_no_import_goes_up_a_layer() -> None:
    problems = upward_imports(_package_edges(), LAYERS, FACADES)
    assert problems == [], "\n".join(problems)


def test_no_circle_among_packages() -> None:
    found = circles(package_graph(_package_edges()))
    assert found == [], "\n".join(" <-> ".join(c) for c in found)


def test_no_circle_among_modules() -> None:
    found = circles(module_graph(_package_edges()))
    assert found == [], "\n".join(" <-> ".join(c) for c in found)


def test_no_circle_among_modules_counting_type_imports() -> None:
    found = circles(module_graph(_package_edges(type_checking=True)))
    assert found == [], "\n".join(" <-> ".join(c) for c in found)


def test_the_checker_reports_what_it_should(tmp_path: Path) -> None:
    """The checks can fail: a synthetic graph with an upward import, a facade import and two circles."""
    edges = [
        ("gaudi3_scale.train.trainer", "gaudi3_scale.cli.main", "train/trainer.py:7"),
        ("gaudi3_scale.train.trainer", "gaudi3_scale.precision", "train/trainer.py:9"),
        ("gaudi3_scale.cli.main", "gaudi3_scale.train.trainer", "cli/main.py:3"),
        ("gaudi3_scale.cost.a", "gaudi3_scale.cost.b", "cost/a.py:1"),
        ("gaudi3_scale.cost.b", "gaudi3_scale.cost.a", "cost/b.py:1"),
        ("gaudi3_scale.device.x", "gaudi3_scale.config.y", "device/x.py:1"),
    ]
    problems = upward_imports(edges, LAYERS, FACADES)
    assert problems == [
        "train/trainer.py:7: gaudi3_scale.train.trainer (train, layer 3) imports gaudi3_scale.cli.main (cli, layer 5)",
        "train/trainer.py:9: gaudi3_scale.train.trainer imports the facade gaudi3_scale.precision; "
        "import its real home",
    ]
    assert circles(package_graph(edges)) == [["cli", "train"]]
    assert circles(module_graph(edges)) == [
        ["gaudi3_scale.cli.main", "gaudi3_scale.train.trainer"],
        ["gaudi3_scale.cost.a", "gaudi3_scale.cost.b"],
    ]
    # And the parser: a function-local relative import counts, one under TYPE_CHECKING only when asked for (c and
    # d import each other, d only for its annotations: a circle for the module check, none for the layer checks).
    pkg = tmp_path / "gaudi3_scale" / "cost"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\ndef f():\n    from .b import g\n"
    )
    (pkg / "b.py").write_text("import gaudi3_scale.cost.a\n")
    (pkg / "c.py").write_text("from gaudi3_scale.cost.d import D\n")
    (pkg / "d.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    from .c import C\nclass D: ...\n")
    modules = {"gaudi3_scale.cost": pkg / "__init__.py"}
    modules.update({f"gaudi3_scale.cost.{m}": pkg / f"{m}.py" for m in "abcd"})
    assert [(a, b) for a, b, _ in import_edges(modules)] == [
        ("gaudi3_scale.cost.a", "gaudi3_scale.cost.b"),
        ("gaudi3_scale.cost.b", "gaudi3_scale.cost.a"),
        ("gaudi3_scale.cost.c", "gaudi3_scale.cost.d"),
    ]
    with_types = import_edges(modules, type_checking=True)
    assert ("gaudi3_scale.cost.d", "gaudi3_scale.cost.c") in [(a, b) for a, b, _ in with_types]
    assert circles(module_graph(with_types)) == [
        ["gaudi3_scale.cost.a", "gaudi3_scale.cost.b"],
        ["gaudi3_scale.cost.c", "gaudi3_scale.cost.d"],
    ]
