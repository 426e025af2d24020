"""The one numeric validator (`config.numbers`): every config section and every numeric CLI option use it."""

from __future__ import annotations

import dataclasses
import math
import time
import typing
from typing import Any

import click
import pytest

from gaudi3_scale.bench.matrix import MatrixConfig
from gaudi3_scale.cli.main import cli
from gaudi3_scale.cli.options import Number
from gaudi3_scale.config.errors import ConfigError, UserInputError, brief
from gaudi3_scale.config.numbers import (
    INT64_MAX,
    check_number,
    check_positive,
    check_range,
    check_seconds,
    check_seed,
    parse_number,
)
from gaudi3_scale.train.config import RunConfig
from gaudi3_scale.tune.config import TuneConfig


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: check_positive("x", math.nan), "x: must be a finite number, got nan"),  # nan > 0 is False…
        (lambda: check_positive("x", math.inf), "x: must be a finite number, got inf"),
        (
            lambda: check_range("x", math.nan, 0.0, 1.0),
            "x: must be a finite number, got nan",
        ),  # …and so is nan < 0
        (lambda: check_number("x", 2**63), "x: must fit in 64 bits"),
        (lambda: check_number("x", -(2**63) - 1), "x: must fit in 64 bits"),
        (lambda: check_number("x", 10**5000), "got <an integer of about 5,001 digits>"),
        (lambda: check_seed("seed", -1), "seed: must be an integer from 0 to 4,294,967,295"),
        (lambda: check_seed("seed", 2**32), "seed: must be an integer from 0 to 4,294,967,295"),
        (lambda: check_seconds("timeout_s", 1e300), "timeout_s: must be <= 1e+09"),
        (lambda: check_number("x", True), "x: expected a number, got True"),
    ],
)
def test_numbers_are_refused_with_one_line(call: Any, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        call()
    assert message in str(info.value) and "\n" not in str(info.value)


def test_numbers_inside_every_bound_pass() -> None:
    check_number("x", INT64_MAX)
    check_seed("seed", 2**32 - 1)
    check_seed("seed", 0)
    check_positive("x", 0, allow_zero=True)
    check_seconds("x", 1e9)
    check_positive("x", None)  # optional fields: null = the default


@pytest.mark.parametrize(
    ("text", "integer", "needle"),
    [
        ("9" * 5000, True, "an integer of 5,000 characters"),  # int() raises a bare ValueError at 4,300
        ("١٢", True, "expected a whole number"),  # int() takes Arabic-Indic digits
        ("1_000", True, "expected a whole number"),
        ("nan", False, "expected a finite number"),
        ("infinity", False, "expected a finite number"),
        ("1e400", False, "must be a finite number, got inf"),
        ("", False, "expected a finite number"),
    ],
)
def test_parse_number_takes_plain_ascii_numbers_only(text: str, integer: bool, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        parse_number("--x", text, integer=integer)


def test_parse_number_reads_what_it_should() -> None:
    assert parse_number("--x", " 42 ", integer=True) == 42
    assert parse_number("--x", "-7", integer=True) == -7
    assert parse_number("--x", "2.5e-3", integer=False) == 2.5e-3
    assert parse_number("--x", ".5", integer=False) == 0.5


def test_brief_is_short_and_quick_for_any_value() -> None:
    layer: list[Any] = ["lol"] * 10
    for _ in range(8):  # the alias bomb as Python objects: 10**9 strings, shared
        layer = [layer] * 10
    start = time.perf_counter()
    shown = [brief(v) for v in (layer, "x" * 10**6, 10**5000, {"k" * 1000: [1] * 1000}, b"\xff" * 1000)]
    assert time.perf_counter() - start < 0.1
    assert all(len(s) < 200 for s in shown), shown


# ---- every config section refuses non-finite floats and out-of-range integers in its own __post_init__ --------


def _sections() -> list[type]:
    """RunConfig and every section in it."""
    hints = typing.get_type_hints(RunConfig)
    return [RunConfig, *(tp for tp in hints.values() if dataclasses.is_dataclass(tp))]


def _number_fields(cls: type) -> list[tuple[str, Any]]:
    """(name, int | float | list[int] …) of every number field, optional or not."""
    out = []
    for name, tp in typing.get_type_hints(cls).items():
        options = set(typing.get_args(tp)) - {type(None)} if typing.get_origin(tp) is not list else {tp}
        kind = options.pop() if len(options) == 1 else tp
        if kind in (int, float) or typing.get_args(kind) in ((int,), (float,)):
            out.append((name, kind))
    return out


def _hostile(kind: Any) -> tuple[Any, ...]:
    if typing.get_origin(kind) is list:
        return tuple([v] for v in _hostile(typing.get_args(kind)[0]))
    return (math.nan, math.inf, -math.inf) if kind is float else (2**70, -(2**70))


_REQUIRED: dict[type, dict[str, Any]] = {MatrixConfig: {"name": "m"}}
_CASES = [
    (cls, name, value)
    for cls in [*_sections(), TuneConfig, MatrixConfig]
    for name, kind in _number_fields(cls)
    for value in _hostile(kind)
]


@pytest.mark.parametrize(
    ("cls", "name", "value"), _CASES, ids=[f"{c.__name__}.{n}={v}" for c, n, v in _CASES]
)
def test_every_number_field_of_every_section_is_checked(cls: type, name: str, value: float) -> None:
    """Built directly (not through YAML), so the section's own validation must refuse it, naming the field."""
    with pytest.raises(UserInputError) as info:
        cls(**{**_REQUIRED.get(cls, {}), name: value})
    assert name in str(info.value), str(info.value)


def test_the_sweep_covers_the_fields_of_the_issue() -> None:
    names = {f"{c.__name__}.{n}" for c, n, _ in _CASES}
    assert {"RunConfig.seed", "TrainConfig.max_steps", "TuneConfig.trial_timeout_s", "MatrixConfig.timeout_s",
            "DataConfig.split_seed", "OptimConfig.lr"} <= names  # fmt: skip


# ---- every numeric CLI option is a Number ---------------------------------------------------------------------


def _options(group: click.Command, path: str = "") -> list[tuple[str, click.Parameter]]:
    found = [(f"{path} {p.opts[0] if p.opts else p.name}".strip(), p) for p in group.params]
    if isinstance(group, click.Group):
        for name, sub in group.commands.items():
            found += _options(sub, f"{path} {name}".strip())
    return found


_ALL_OPTIONS = _options(cli)
_NUMBER_OPTIONS = [(where, p) for where, p in _ALL_OPTIONS if isinstance(p.type, Number)]


def test_no_option_uses_clicks_own_number_types() -> None:
    """click.INT takes '١٢' and raises on 5,000 digits; click.FLOAT takes nan. Every number is a `Number`."""
    plain = [where for where, p in _ALL_OPTIONS if isinstance(p.type, click.types._NumberParamTypeBase)]
    assert plain == []
    assert len(_NUMBER_OPTIONS) >= 30  # seeds, steps, ports, timeouts, counts, fractions across the verbs


@pytest.mark.parametrize("text", ["nan", "inf", "-1e400", "9" * 5000, "١٢", "1e300", "", "\x00"])
def test_every_numeric_option_refuses_hostile_text_with_one_line(text: str) -> None:
    for where, param in _NUMBER_OPTIONS:
        assert isinstance(param.type, Number)
        if text == "1e300" and not param.type.integer:
            continue  # a finite float; its range is the option's own (e.g. --mfu: (0, 1] in the estimator)
        with pytest.raises(UserInputError) as info:
            param.type.convert(text, param, None)
        message = str(info.value)
        assert message.startswith(f"{param.opts[0]}: ") and len(message) < 200 and "\n" not in message, where
