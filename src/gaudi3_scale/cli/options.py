"""Click options shared by several commands: numbers checked the config's way, the launch flags, and the check of a
new run directory given as `--out`.

Every numeric option is a `Number` (or `Seed`, `Seconds`, `Port`): the text is read by `config.numbers.parse_number`
(ASCII digits, at most 100 of them, no nan or inf) and range-checked by `config.numbers.check_number`, the validator
the config sections use, so `--seed -1`, `--cell-timeout-s nan`, `--per-node 0` or a 5,000-digit integer are one
line and exit 2 at parse time, before anything runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import click

from gaudi3_scale.config.errors import ConfigError, UserInputError, brief
from gaudi3_scale.config.hosts import parse_endpoint
from gaudi3_scale.config.numbers import (
    INT32_MAX,
    MAX_SECONDS,
    SEED_LIMIT,
    check_number,
    parse_number,
)

__all__ = [
    "Count",
    "Number",
    "Port",
    "Seconds",
    "Seed",
    "check_new_out_dir",
    "launch_options",
    "launch_overrides",
]

F = TypeVar("F", bound=Callable[..., Any])


class Number(click.ParamType):
    """An integer (`integer=True`) or a finite float in [low, high] (or (above, high]).

    A bad value is `UserInputError("--flag: <expected>, got <value>")`, the shape of every other one-line error
    (click's own "Invalid value for …" is kept for choices and paths).
    """

    def __init__(
        self,
        *,
        integer: bool,
        low: float | None = None,
        high: float | None = None,
        above: float | None = None,
        expected: str = "",
    ) -> None:
        self.integer = integer
        self.low, self.high, self.above = low, high, above
        self.name = "integer" if integer else "number"
        self.expected = expected or _expected(integer, low, high, above)
        self._names_bound = bool(expected)  # a custom text states the upper bound already (a Port's 0..65535)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        flag = param.opts[0] if param is not None and param.opts else self.name
        number: Any = None
        try:
            number = parse_number(flag, value, integer=self.integer) if isinstance(value, str) else value
            if self.integer and not isinstance(number, int):
                raise ConfigError(flag, "not a whole number")
            check_number(flag, number, low=self.low, high=self.high, above=self.above)
        except ConfigError:
            expected = self.expected
            over = self.high is not None and isinstance(number, int | float) and number > self.high
            if over and not self._names_bound:
                expected += f" up to {self.high:,}" if self.integer else f" up to {self.high:g}"
            raise UserInputError(f"{flag}: {expected}, got {_shown(value)}") from None
        return number if self.integer else float(number)


def _shown(value: Any) -> str:
    """What the user typed, as typed when short; `brief` otherwise (5,000 digits, control characters)."""
    if (
        isinstance(value, str)
        and len(value) <= 40
        and value.isprintable()
        and value.strip() == value
        and value
    ):
        return value
    return brief(value)


def _expected(integer: bool, low: float | None, high: float | None, above: float | None) -> str:
    kind = "an integer" if integer else "a finite number"
    if integer and low == 1:
        kind = "a positive integer"
    elif integer and low == 0:
        kind = "a non-negative integer"
    elif above == 0:
        kind = "a positive number"
    elif low is not None:
        kind += f" >= {low:g}"
    return f"must be {kind}"  # `convert` adds the upper bound when that is what was crossed


class Count(Number):
    """A whole count (steps, nodes, workers): `low` to `high` (a C int by default)."""

    def __init__(self, *, low: int = 1, high: int = INT32_MAX) -> None:
        super().__init__(integer=True, low=low, high=high)


class Seed(Number):
    """A random seed numpy and torch both take: 0 to 2**32 - 1."""

    def __init__(self) -> None:
        super().__init__(integer=True, low=0, high=SEED_LIMIT - 1,
                         expected=f"must be a seed from 0 to {SEED_LIMIT - 1:,} (2**32 - 1)")  # fmt: skip


class Seconds(Number):
    """A duration: finite, > 0 (or >= 0), at most ~31 years (the OS timers' range)."""

    def __init__(self, *, allow_zero: bool = False) -> None:
        super().__init__(integer=False, low=0 if allow_zero else None, above=None if allow_zero else 0,
                         high=MAX_SECONDS, expected=f"must be a {'non-negative' if allow_zero else 'positive'} "
                         f"number of seconds up to {MAX_SECONDS:g}")  # fmt: skip


class Port(Number):
    """A TCP port; 0 asks the OS for a free one."""

    def __init__(self) -> None:
        super().__init__(
            integer=True, low=0, high=65535, expected="expected a TCP port 0..65535 (0: any free port)"
        )


_LAUNCH_OPTIONS = (
    click.option("--nproc-per-node", type=Count(), help="ranks per node (= --parallel.nproc_per_node)"),
    click.option("--nnodes", type=Count(), help="nodes (= --parallel.nnodes)"),
    click.option("--node-rank", type=Count(low=0), help="this node's rank (= --parallel.node_rank)"),
    click.option("--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous (= --parallel.rdzv_endpoint)"),
    click.option(
        "--max-restarts", type=Count(low=0), help="worker group restarts (= --parallel.max_restarts)"
    ),
)


def launch_options(command: F) -> F:
    """Add the launch-geometry flags; the command receives them as keyword arguments (None when not given)."""
    for option in reversed(_LAUNCH_OPTIONS):
        command = option(command)
    return command


def launch_overrides(launch: Mapping[str, Any]) -> list[str]:
    """The given launch flags as `--parallel.FIELD=VALUE` config overrides.

    An override's value is read as YAML; the endpoint is text, so it is checked as typed (`host:` would be the
    mapping {host: null}, ` #x` a comment) and passed single-quoted, which YAML reads back unchanged."""
    out = []
    for key, value in launch.items():
        if value is None:
            continue
        if key == "rdzv_endpoint":
            parse_endpoint("parallel.rdzv_endpoint", value)  # HOST:PORT, or one line saying so
            value = "'" + value.replace("'", "''") + "'"
        out.append(f"--parallel.{key}={value}")
    return out


def check_new_out_dir(out_dir: Path) -> None:
    """`--out` of a verb that fills a new directory with its runs (smoke, repro): refused in one line, before any
    work, when it is a file or inside one, already holds something, or cannot be created and written. Checked
    here, not by mkdir later: there a PermissionError would be a traceback and exit 1, which these verbs use for
    "a stage failed" and "the runs differ"."""
    from gaudi3_scale.config.files import check_output_dir
    from gaudi3_scale.verify.node_checks import write_problem

    check_output_dir("--out", out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise UserInputError(f"--out: {str(out_dir)!r} is not empty; pick a new or empty directory")
    if problem := write_problem(out_dir):
        raise UserInputError(f"--out: {str(out_dir)!r}: {problem}; pick a directory you can write")
