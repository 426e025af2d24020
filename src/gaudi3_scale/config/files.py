"""The one reader of YAML and JSON input: run configs, matrices, catalogs, manifests, results, tokenizers, values.

Everything a user can point a tool at is read here, with the same limits, so that no file (and no command-line
value parsed as YAML) can produce a traceback, a hang or a memory blow-up:

* **size**: at most `MAX_FILE_BYTES` are read (a caller may allow more, e.g. tokenizer files);
* **text**: strict UTF-8; a binary or Latin-1 file is one line naming the file, the byte, its offset and line;
* **nesting**: at most `MAX_DEPTH` levels (``[[[[…]]]]`` otherwise ends in a RecursionError, in PyYAML's composer
  or anywhere that walks the data later), aliases counted as what they expand to;
* **aliases**: the document may expand to at most `MAX_NODES` values. A 401-byte "billion laughs" file (8 levels
  of 10 aliases) is 10**8 values once expanded; PyYAML shares the objects, so parsing is cheap, but anything that
  walks them (repr in an error, a deep copy, a YAML dump) is not. The size is counted on the node graph before any
  object is built, memoised per node, so a bomb is refused in microseconds;
* **integers**: at most `numbers.MAX_INT_DIGITS` characters (Python refuses to convert 4,300 digits);
* **top level**: the caller says what the document must be (a mapping, usually).

Problems are `UserInputError` lines naming the file (``what 'path'``) and, where known, the line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from gaudi3_scale.config.errors import ConfigError, UserInputError, brief
from gaudi3_scale.config.numbers import MAX_INT_DIGITS

__all__ = [
    "MAX_DEPTH",
    "MAX_FILE_BYTES",
    "MAX_NODES",
    "check_output_dir",
    "load_json_file",
    "load_yaml_file",
    "parse_json",
    "parse_yaml",
    "parse_yaml_documents",
    "parse_yaml_value",
    "read_text_file",
]

MAX_FILE_BYTES = 1 << 20  # 1 MiB: the largest config we ship is 5 KB; PyYAML reads ~1 MB/s
MAX_DEPTH = 64  # nesting levels; our deepest documents (Kubernetes manifests) have about 12
MAX_NODES = 100_000  # values in one document once aliases are expanded

_KINDS: dict[type, str] = {dict: "a mapping (key: value)", list: "a list"}


class _Refused(Exception):
    """A problem with the position when known; turned into a UserInputError by the caller.

    `limit` tells a value over a limit (refused everywhere) from text that is merely not YAML (which a
    command-line value may be: it is then taken as text).
    """

    def __init__(self, problem: str, mark: Any = None, *, limit: bool = True, detail: str = "") -> None:
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        super().__init__(f"{problem}{where}" + (f": {detail}" if detail else ""))
        self.problem = problem  # without the position: a command-line value is one line anyway
        self.limit = limit


def _kind(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", type(None): "nothing"}.get(
        type(value), type(value).__name__
    )


# ---- reading bytes -------------------------------------------------------------------------------------------------


def read_text_file(path: str | Path, *, what: str, max_bytes: int = MAX_FILE_BYTES) -> str:
    """The UTF-8 text of a regular file of at most `max_bytes`, or one line naming `what` and the path."""
    p = Path(path)
    label = f"{what} {str(p)!r}"
    if not p.exists():
        raise UserInputError(f"{label} does not exist")
    if not p.is_file():  # a directory, /dev/zero, a FIFO (which would block)
        raise UserInputError(f"{label} is not a regular file")
    try:
        with p.open("rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as exc:
        raise UserInputError(f"{label}: cannot read ({exc.strerror or exc})") from None
    if len(data) > max_bytes:
        raise UserInputError(f"{label} is larger than {max_bytes:,} bytes; a {what} is never that big")
    return decode_utf8(data, label)


def check_output_dir(field: str, path: str | Path) -> None:
    """A directory a command will create or write into: refused, naming `field`, when it or a directory above it
    already exists as a file (mkdir would fail there with a traceback, after other work was done)."""
    target = Path(path)
    for candidate in (target, *target.parents):
        if candidate.exists():
            if not candidate.is_dir():
                where = (
                    "is a file" if candidate == target else f"is inside {str(candidate)!r}, which is a file"
                )
                raise ConfigError(field, f"{str(target)!r} {where}; pass a directory (new or existing)")
            return


def decode_utf8(data: bytes, label: str) -> str:
    """Strict UTF-8 (a leading BOM is dropped); a bad byte is one line with its offset and line number."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise UserInputError(
            f"{label} is not UTF-8 text: byte 0x{data[exc.start]:02x} at offset {exc.start} (line {line}); "
            "save it as UTF-8"
        ) from None


# ---- YAML ----------------------------------------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader with a nesting limit while composing and an integer-length limit while constructing."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0
        self._unique: set[int] = set()  # the mappings whose keys were checked (`flatten_mapping`)

    def fetch_flow_collection_start(self, TokenClass: Any) -> None:
        # The scanner keeps a pending "simple key" per open bracket and rescans them all for every token: refuse
        # deep [[[[ here, or a 1 MB file of brackets is quadratic before the composer sees any of it.
        if self.flow_level >= MAX_DEPTH:
            raise _Refused(f"nested deeper than {MAX_DEPTH} levels", self.get_mark())
        super().fetch_flow_collection_start(TokenClass)

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        # Composition recurses once per level: refuse before Python's recursion limit does.
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _Refused(f"nested deeper than {MAX_DEPTH} levels", self.peek_event().start_mark)
            self._nodes += 1  # stop a large flat file early, before all of it is scanned (PyYAML: ~1 MB/s)
            if self._nodes > MAX_NODES:
                raise _Refused(f"holds more than {MAX_NODES:,} values", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_object(self, node: Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        # PyYAML's constructors raise these, not a YAMLError, on some malformed scalars: `2020-13-45` read as a
        # date (ValueError), an empty `!!int` or `!!float` (IndexError).
        except (ValueError, OverflowError, IndexError, KeyError, TypeError, AttributeError) as exc:
            if isinstance(exc, UserInputError):
                raise
            raise _Refused(
                f"cannot read {brief(node.value)}", node.start_mark, limit=False, detail=str(exc)
            ) from None

    def flatten_mapping(self, node: MappingNode) -> None:
        # PyYAML keeps the last of a repeated key without a word: a second `model:` section would silently drop the
        # first one's fields. YAML requires unique keys. Checked here, once per mapping and before a merge
        # (`<<: *base`, whose keys its own may override) rewrites its pairs: a merge source can be flattened by the
        # mapping that merges it before it is constructed itself.
        if id(node) not in self._unique:
            self._unique.add(id(node))
            self._check_unique_keys(node)
        super().flatten_mapping(node)

    def _check_unique_keys(self, node: MappingNode) -> None:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node.start_mark)
            except TypeError:
                continue  # an unhashable key: PyYAML's own error says so
            again = key_node.start_mark
            if first is not again:
                where = (
                    f"line {again.line + 1}, columns {first.column + 1} and {again.column + 1}"
                    if first.line == again.line
                    else f"lines {first.line + 1} and {again.line + 1}"
                )
                raise _Refused(f"key {brief(key)} appears twice ({where}); keep one")

    def construct_yaml_int(self, node: ScalarNode) -> int:
        if len(node.value) > MAX_INT_DIGITS:
            raise _Refused(
                f"an integer of {len(node.value):,} characters (at most {MAX_INT_DIGITS})", node.start_mark
            )
        return super().construct_yaml_int(node)


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)


def _check_graph(root: Node) -> int:
    """Values in the document once aliases are expanded; refuses a recursive alias, a bomb, or deep nesting.

    Memoised per node, so the cost is the number of distinct nodes, whatever they expand to.
    """
    sizes: dict[int, tuple[int, int]] = {}  # id(node) → (expanded values, height)
    open_nodes: set[int] = set()
    shared = False  # a node reached twice: an alias

    def visit(node: Node, depth: int) -> tuple[int, int]:
        nonlocal shared
        key = id(node)
        if key in sizes:
            shared = True
            size, height = sizes[key]
        else:
            if key in open_nodes:
                raise _Refused("an alias refers to a node that contains it (recursive data)", node.start_mark)
            if depth > MAX_DEPTH:
                raise _Refused(f"nested deeper than {MAX_DEPTH} levels (aliases expanded)", node.start_mark)
            open_nodes.add(key)
            size, height = 1, 1
            children: list[Node] = []
            if isinstance(node, SequenceNode):
                children = node.value
            elif isinstance(node, MappingNode):
                children = [part for pair in node.value for part in pair]
            for child in children:
                child_size, child_height = visit(child, depth + 1)
                size += child_size
                height = max(height, child_height + 1)
                if size > MAX_NODES:
                    break
            open_nodes.discard(key)
            sizes[key] = (size, height)
        if depth + height - 1 > MAX_DEPTH:
            raise _Refused(f"nested deeper than {MAX_DEPTH} levels (aliases expanded)", node.start_mark)
        if size > MAX_NODES:
            bomb = " once its aliases are expanded (an alias bomb?)" if shared else ""
            raise _Refused(f"holds more than {MAX_NODES:,} values{bomb}", node.start_mark)
        return size, height

    return visit(root, 1)[0]


def _not_yaml(exc: yaml.YAMLError) -> _Refused:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]  # ReaderError: a control character
    return _Refused("not valid YAML", mark, limit=False, detail=brief(problem).strip("'"))


def _yaml_documents(text: str) -> Iterator[Any]:
    """Each document of `text`, checked (graph) before it is built; raises `_Refused`."""
    try:
        loader = _Loader(text)  # the reader checks for control characters here already
    except yaml.YAMLError as exc:
        raise _not_yaml(exc) from None
    try:
        while loader.check_node():
            node = loader.get_node()
            if node is None:
                continue
            _check_graph(node)
            yield loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise _not_yaml(exc) from None
    finally:
        loader.dispose()


def parse_yaml(text: str, *, where: str, expect: type | None = dict) -> Any:
    """One YAML document; `expect` dict (empty text → {}), list, or None for any value. Errors name `where`."""
    try:
        docs = list(_yaml_documents(text))
    except _Refused as exc:
        raise UserInputError(f"{where}: {exc}") from None
    if len(docs) > 1:
        raise UserInputError(f"{where}: holds {len(docs)} YAML documents (--- separated); expected one")
    data = docs[0] if docs else None
    return _expect(data, expect, where)


def parse_yaml_documents(text: str, *, where: str) -> list[Any]:
    """Every document of a multi-document YAML stream (Kubernetes manifests), limits applied to each."""
    try:
        return list(_yaml_documents(text))
    except _Refused as exc:
        raise UserInputError(f"{where}: {exc}") from None


def parse_yaml_value(text: str, *, field: str) -> Any:
    """A value typed on the command line (`--train.max_steps 6`, `--set cpu=8`), read as YAML.

    Text that is not valid YAML stays text (`--data.source 'a: b: c'`); a value over a limit (deep nesting, an
    alias bomb, a 5,000-digit integer) is refused as `ConfigError(field, …)`.
    """
    if text == "":
        return text  # an empty string stays one ("" sets a text field to empty); blanks read as null
    try:
        docs = list(_yaml_documents(text))
    except _Refused as exc:
        if not exc.limit:
            return text
        raise ConfigError(field, exc.problem) from None
    if not docs:
        return None
    return docs[0] if len(docs) == 1 else text


def load_yaml_file(
    path: str | Path,
    *,
    what: str = "config file",
    expect: type | None = dict,
    max_bytes: int = MAX_FILE_BYTES,
) -> Any:
    """`read_text_file` + `parse_yaml`: the way every YAML file is read."""
    text = read_text_file(path, what=what, max_bytes=max_bytes)
    return parse_yaml(text, where=f"{what} {str(path)!r}", expect=expect)


# ---- JSON ----------------------------------------------------------------------------------------------------------


def _json_int(text: str) -> int:
    if len(text) > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {len(text):,} characters (at most {MAX_INT_DIGITS})")
    return int(text)


def _json_depth_ok(data: Any) -> bool:
    """Iterative (a recursive walk is what the limit protects against)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            return False
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
    return True


def parse_json(text: str, *, where: str, expect: type | None = dict) -> Any:
    """One JSON document with the same limits as YAML; errors name `where` (and the line)."""
    try:
        data = json.loads(text, parse_int=_json_int)
    except _Refused as exc:
        raise UserInputError(f"{where}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise UserInputError(
            f"{where}: not valid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
        ) from None
    except RecursionError:  # the C decoder counts its own recursion; nothing is left half-built
        raise UserInputError(f"{where}: nested deeper than {MAX_DEPTH} levels") from None
    if not _json_depth_ok(data):
        raise UserInputError(f"{where}: nested deeper than {MAX_DEPTH} levels")
    return _expect(data, expect, where)


def load_json_file(
    path: str | Path, *, what: str, expect: type | None = dict, max_bytes: int = MAX_FILE_BYTES
) -> Any:
    """`read_text_file` + `parse_json`: the way every JSON file is read."""
    text = read_text_file(path, what=what, max_bytes=max_bytes)
    return parse_json(text, where=f"{what} {str(path)!r}", expect=expect)


def _expect(data: Any, expect: type | None, where: str) -> Any:
    if expect is None:
        return data
    if data is None and expect in (dict, list):
        return expect()
    if not isinstance(data, expect):
        raise UserInputError(f"{where} must hold {_KINDS.get(expect, expect.__name__)}, got {_kind(data)}")
    return data
