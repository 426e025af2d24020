"""Typed config trees: dataclasses in, dataclasses out, one clear line for every mistake.

Section configs are `kw_only` dataclasses that live beside the code that owns them (`models/config.py`,
`data/config.py`, `train/optim_config.py`), composed into the run config by `train/config.py`. This module only
knows how to build them from plain dicts (YAML), apply dotted command-line overrides (`--model.num_layers 6`), and
turn them back into dicts. Help text for a field is ``field(metadata={"help": "..."})`` and doubles as CLI help.

Validation of values lives in each section's ``__post_init__``; it raises `ConfigError(field, msg)` with the
field name relative to the section, and `from_dict` prefixes the dotted path of the section. Numbers are checked
by `config.numbers` (finite, 64-bit, in range), files and values read by `config.files` (size, UTF-8, nesting,
aliases), and every string, as it is read, by `config.urls` (no credentials in a URL).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

import yaml

from gaudi3_scale.config.errors import ConfigError, UserInputError, brief
from gaudi3_scale.config.files import load_yaml_file, parse_yaml_value
from gaudi3_scale.config.numbers import check_number, check_positive, check_range, is_number_text
from gaudi3_scale.config.urls import check_no_credentials

__all__ = [
    "apply_overrides",
    "check_choice",
    "check_field_types",
    "check_name",
    "check_positive",
    "check_range",
    "config_sha256",
    "field_help",
    "from_dict",
    "iter_fields",
    "load_yaml",
    "merge_mappings",
    "parse_overrides",
    "save_yaml",
    "to_dict",
    "type_name",
]

T = TypeVar("T")


_YAML_BOOL_WORDS = {False: ("off", "no", "false"), True: ("on", "yes", "true")}


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_describe(a) for a in get_args(tp))
    if origin in (list, tuple, Sequence):
        (inner, *_) = get_args(tp) or (Any,)
        return _describe_list(inner)
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


# A list field's items, named in the plural, and a list written as a YAML value or an --override takes it
_LIST_ITEMS = {int: ("integers", "[7, 15, 24]"), float: ("numbers", "[0.5, 1.0]"), str: ("strings", "[a, b]"),
               bool: ("true or false values", "[true, false]")}  # fmt: skip


def _describe_list(inner: Any) -> str:
    """The accepted form, not only the type: "a list of integers such as [7, 15, 24]"."""
    if inner in _LIST_ITEMS:
        items, example = _LIST_ITEMS[inner]
        return f"a list of {items} such as {example}"
    if dataclasses.is_dataclass(inner):
        return "a list of mappings"
    return f"a list of items, each {_describe(inner)}"


def type_name(tp: Any) -> str:
    """A field type as a reader writes it: `int`, `str | None`, `list[int]`, `auto | cpu | cuda`."""
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(str(a) for a in get_args(tp))
    if origin in (types.UnionType, typing.Union):
        return " | ".join(type_name(a) for a in get_args(tp))
    if origin is not None:
        args = ", ".join(type_name(a) for a in get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]" if args else str(origin.__name__)
    if tp is type(None):
        return "None"
    if tp is Any:
        return "any"
    return str(getattr(tp, "__name__", tp))


def _coerce(tp: Any, value: Any, path: str) -> Any:
    """Convert `value` (from YAML or a parsed CLI string) to `tp`, or raise ConfigError naming `path`."""
    if isinstance(value, str):  # first: no later message may quote a password (a str | int field's, say)
        check_no_credentials(path, value)
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if (
            value is None
        ):  # a section left empty in YAML (`data:` with its fields commented out): its defaults
            value = {}
        if not isinstance(value, Mapping):
            raise ConfigError(path, f"expected a mapping of fields, got {brief(value)}")
        return from_dict(tp, value, prefix=path)
    if origin in (types.UnionType, typing.Union):
        options = get_args(tp)
        if value is None and type(None) in options:
            return None
        present = [opt for opt in options if opt is not type(None)]
        if len(present) == 1:  # `X | None`: X's own error names the nested field that is wrong
            return _coerce(present[0], value, path)
        for opt in options:
            if opt is type(None):
                continue
            try:
                return _coerce(opt, value, path)
            except ConfigError:
                continue  # the next option may fit; the error below names them all
        raise ConfigError(path, f"expected {_describe(tp)}, got {brief(value)}")
    if origin is Literal:
        allowed = get_args(tp)
        if isinstance(value, bool):  # YAML 1.1 reads the words off/no/false and on/yes/true as booleans
            words = [a for a in _YAML_BOOL_WORDS[value] if a in allowed]
            value = words[0] if len(words) == 1 else value
        if not any(value == a and type(value) is type(a) for a in allowed):
            raise ConfigError(path, f"got {brief(value)}; allowed: {', '.join(str(a) for a in allowed)}")
        return value
    if origin in (list, tuple):
        if isinstance(value, str | bytes) or not isinstance(value, Sequence):
            raise ConfigError(path, f"expected {_describe(tp)}, got {brief(value)}")
        (inner, *_) = get_args(tp) or (Any,)
        items = [_coerce(inner, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(path, f"expected true or false, got {brief(value)}")
    if tp in (int, float):
        value = _exponent_number(value)
    if tp is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # 1e3 is 1000; 1e300 is then refused as wider than 64 bits
        if isinstance(value, int) and not isinstance(value, bool):
            check_number(path, value)
            return value
        raise ConfigError(path, f"expected an integer, got {brief(value)}")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            check_number(path, value)
            return float(value)
        raise ConfigError(path, f"expected a number, got {brief(value)}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(path, f"expected a string, got {brief(value)}")
    raise TypeError(f"unsupported config field type {tp!r} at {path}")  # programming error, not user input


def _exponent_number(value: Any) -> Any:
    """`value`, or the float it spells when it is a number with an exponent: YAML 1.1 (PyYAML) reads 3e-4 and 1e308
    as strings (its floats need a '.' and a signed exponent: 3.0e-4)."""
    if isinstance(value, str) and "e" in value.lower() and is_number_text(value):
        return float(value)
    return value


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)  # cached: `check_field_types` runs on every construction


_SCALARS = (int, float, str, bool)


def _is_scalar(tp: Any) -> bool:
    if tp in _SCALARS or tp is type(None) or get_origin(tp) is Literal:
        return True
    return get_origin(tp) in (types.UnionType, typing.Union) and all(_is_scalar(opt) for opt in get_args(tp))


def check_field_types(obj: Any) -> None:
    """The type check of `from_dict` for a config built directly in Python (`TrainConfig(max_steps=2.5)`), run from
    its `__post_init__`: each scalar field (int, float, str, bool, a Literal, or `X | None` of them) is coerced as
    a YAML value would be (`3.0` → 3, `2.5` refused for an int) or refused with `ConfigError(field, …)`. A path
    (`os.PathLike`) in a text field is taken as its text. Sections and lists are left to their own classes."""
    cls: type = type(obj)
    hints = _hints(cls)
    for f in dataclasses.fields(obj):
        tp = hints[f.name]
        if not f.init or not _is_scalar(tp):
            continue
        value = getattr(obj, f.name)
        if isinstance(value, os.PathLike) and (tp is str or str in get_args(tp)):
            value = os.fspath(value)
        object.__setattr__(obj, f.name, _coerce(tp, value, f.name))


def from_dict(cls: type[T], data: Mapping[str, Any], prefix: str = "") -> T:
    """Build dataclass `cls` from a mapping; unknown keys and wrong types raise ConfigError naming the field."""
    if not isinstance(data, Mapping):
        raise ConfigError(prefix, f"expected a mapping of fields, got {brief(data)}")
    assert dataclasses.is_dataclass(cls)
    hints = _hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            allowed = ", ".join(sorted(known))
            raise ConfigError(_join(prefix, brief(key).strip("'")), f"unknown field; allowed: {allowed}")
        kwargs[key] = _coerce(hints[key], value, _join(prefix, key))
    for name, f in known.items():
        if (
            name not in kwargs
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ):
            raise ConfigError(_join(prefix, name), f"is required: {field_help(f) or _describe(hints[name])}")
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(_join(prefix, exc.field), str(exc).split(": ", 1)[-1]) from None


def to_dict(obj: Any) -> Any:
    """Dataclass tree → plain dicts/lists/scalars, ready for YAML or JSON."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    return obj


def config_sha256(obj: Any) -> str:
    """SHA-256 of a config's canonical JSON (sorted keys): equal configs, equal digests."""
    text = json.dumps(to_dict(obj), sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def iter_fields(cls: type, prefix: str = "") -> typing.Iterator[tuple[str, Any, dataclasses.Field[Any]]]:
    """Yield (dotted name, type, field) for every leaf field of a dataclass tree."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            yield from iter_fields(tp, _join(prefix, f.name))
        else:
            yield _join(prefix, f.name), tp, f


def field_help(f: dataclasses.Field[Any]) -> str:
    return str(f.metadata.get("help", ""))


def parse_overrides(args: Sequence[str]) -> list[tuple[str, str]]:
    """`["--model.num_layers", "6", "--train.lr=3e-4"]` → `[("model.num_layers", "6"), ("train.lr", "3e-4")]`."""
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise UserInputError(
                f"unexpected argument {brief(arg)}; config overrides look like --section.field VALUE"
            )
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
        else:
            if i + 1 >= len(args):
                raise UserInputError(f"--{key} needs a value")
            i += 1
            value = args[i]
        pairs.append((key.replace("-", "_"), value))
        i += 1
    return pairs


def _lookup_type(cls: type, dotted: str) -> Any:
    tp: Any = cls
    walked = ""
    for part in dotted.split("."):
        if not (dataclasses.is_dataclass(tp) and isinstance(tp, type)):
            raise ConfigError(dotted, f"{walked} is not a section")
        hints = _hints(tp)
        names = [f.name for f in dataclasses.fields(tp) if f.init]
        if part not in names:
            where = walked or "the run config"
            raise ConfigError(_join(walked, part), f"unknown field in {where}; allowed: {', '.join(names)}")
        tp = hints[part]
        walked = _join(walked, part)
    return tp


Override = tuple[str, Any] | str


def apply_overrides(cls: type, data: dict[str, Any], overrides: Sequence[Override]) -> dict[str, Any]:
    """Set dotted keys in a raw config dict. Each override is a `(key, value)` pair or a `"key=value"` string; a
    text value is parsed as a YAML scalar (so `6`, `3e-4`, `true`, `null`), a path is its text, a number, bool or
    None is taken as it is (and type-checked with the field like any other value)."""
    for item in overrides:
        key, raw = _override_pair(item)
        _lookup_type(cls, key)  # fail early on unknown fields
        value = _override_value(key, raw)
        node = data
        *parents, leaf = key.split(".")
        for p in parents:
            child = node.get(p)
            if not isinstance(child, dict):
                child = {}
                node[p] = child
            node = child
        node[leaf] = value
    return data


def _override_pair(item: Any) -> tuple[str, Any]:
    if isinstance(item, str):
        key, sep, raw = item.partition("=")  # the value keeps any further '=' ("a=b=c" sets a to "b=c")
        pair: Any = (key.strip(), raw) if sep else None
    else:
        pair = tuple(item) if isinstance(item, Sequence) and len(item) == 2 else None
    if pair is None or not isinstance(pair[0], str) or not pair[0]:
        raise ConfigError("overrides", f"expected key=value (or a (key, value) pair), got {brief(item)}")
    return pair[0], pair[1]


def _override_value(key: str, raw: Any) -> Any:
    if isinstance(raw, os.PathLike):
        raw = os.fspath(raw)
    if raw is None or isinstance(raw, bool | int | float):
        return raw  # typed already: checked against the field by `from_dict`
    if not isinstance(raw, str):
        raise ConfigError(key, f"an override value is text, a path or a number, got {brief(raw)}")
    value = parse_yaml_value(raw, field=key)
    if isinstance(value, str) and is_number_text(value):
        value = float(value)  # YAML 1.1 reads "1e-3" as a string (`_exponent_number`), whatever the field
    return value


def load_yaml(path: str | Path, *, what: str = "config file") -> dict[str, Any]:
    """A YAML file holding a mapping (empty: {}), read by `config.files` with its limits."""
    data: dict[str, Any] = load_yaml_file(path, what=what, expect=dict)
    return data


def merge_mappings(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `top` laid over it, nested mappings merged key by key (neither input is changed)."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge_mappings(out[key], value)
        else:
            out[key] = value
    return out


def save_yaml(obj: Any, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(obj), sort_keys=False))


# ---- validation helpers used by section __post_init__ (numbers: config.numbers) ----------------------------------


NAME_MAX_CHARS = 128
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_name(name: str, value: str | None) -> None:
    """A name that becomes one path component (`runs/<name>/`): letters, digits, '.', '_', '-', not starting with
    '.', at most `NAME_MAX_CHARS`. So `..`, `a/b`, a newline or an empty name never reach the file system."""
    if value is None:
        return
    if not (isinstance(value, str) and len(value) <= NAME_MAX_CHARS and _NAME.fullmatch(value)):
        raise ConfigError(
            name,
            f"must be 1 to {NAME_MAX_CHARS} letters, digits, '.', '_' or '-', starting with a letter or digit "
            f"(it names a directory), got {brief(value)}",
        )


def check_choice(name: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ConfigError(name, f"got {brief(value)}; allowed: {', '.join(allowed)}")
