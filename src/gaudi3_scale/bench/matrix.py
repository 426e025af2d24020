"""A benchmark matrix: strategy × world size × model preset × micro-batch × precision, each cell a training job.

A matrix is a YAML file (or the name of one shipped in `bench/matrices/`):

    name: cpu-small
    description: …
    models: [shakespeare-char]          # registry presets
    strategies: [ddp, fsdp]             # parallel.strategy values
    world_sizes: [1, 2]                 # ranks on one node (nproc_per_node)
    micro_batch_sizes: [4]              # sequences per rank per forward pass
    precisions: [32-true]               # train.precision values
    accumulation: 1                     # global batch = micro-batch × data-parallel ranks × accumulation (weak scaling)
    data: synthetic                     # data.source: synthetic[:VOCAB], a bundled corpus, files…
    warmup_steps: 3                     # steps left out of the result
    measure_steps: 10
    timeout_s: 900                      # per cell
    base: {train: {threads: 1}}         # any run-config fields for every cell, but none the matrix sets itself

Every cell's run config is built (and so validated) when the matrix is loaded: a bad value fails before anything
runs, as one line naming the cell and the field. `load_matrix(..., here=True)` (what `gaudi3 benchmark run` loads)
also refuses a precision or device this machine cannot train in, as each cell's `gaudi3 train` would at launch.

A cell is a short run made to measure: besides its axes, data, batch and steps, it turns off what every such run
turns off (a length in epochs, the profiler, checkpoints, tracker runs, the metrics port, the cost budget:
`train.config.throwaway_run_overrides`). A `base` field that
would change what a cell runs under its label is refused, naming the matrix key to use: a field the cells set
(`_cell_overrides`: merged under them, it would be dropped without a word), a field of the model's shape
(`models.pretrained.SHAPE_FIELDS` and `model.init_from`: a cell runs its preset's shape, under that preset's name)
and `data.mixture` (it would replace the matrix's `data`). One line names every such field; a value that every cell
has anyway (a tuned config's nulls) is accepted. Two base fields are honoured instead: `health.spike_policy: rollback` (a cell has no
checkpoint to roll back to, so it warns, as tuning trials and plan probes do) and `parallel.tp_size` / `pp_size`
(fewer ranks then read their own micro-batches, and the global batch keeps the matrix's accumulation).
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gaudi3_scale.config.core import (
    apply_overrides,
    check_positive,
    from_dict,
    load_yaml,
    merge_mappings,
    parse_overrides,
)
from gaudi3_scale.config.errors import ConfigError, UserInputError, brief
from gaudi3_scale.config.numbers import check_seconds
from gaudi3_scale.distributed.plan import BatchPlan, data_parallel_size

if TYPE_CHECKING:
    from gaudi3_scale.train.config import RunConfig

__all__ = ["MAX_CELLS", "Cell", "MatrixConfig", "list_matrices", "load_matrix"]

MAX_CELLS = 1000  # every cell's run config is built when the matrix loads; a typo should not take minutes
_AXES = ("models", "strategies", "world_sizes", "micro_batch_sizes", "precisions")


@dataclass(kw_only=True)
class MatrixConfig:
    name: str = field(metadata={"help": "the matrix's name (recorded in every result)"})
    description: str = field(default="", metadata={"help": "what the matrix compares"})
    models: list[str] = field(
        default_factory=lambda: ["shakespeare-char"], metadata={"help": "model presets"}
    )
    strategies: list[str] = field(
        default_factory=lambda: ["ddp"], metadata={"help": "parallel.strategy values"}
    )
    world_sizes: list[int] = field(
        default_factory=lambda: [1], metadata={"help": "ranks per cell (one node)"}
    )
    micro_batch_sizes: list[int] = field(default_factory=lambda: [4], metadata={"help": "sequences per rank"})
    precisions: list[str] = field(
        default_factory=lambda: ["auto"], metadata={"help": "train.precision values"}
    )
    accumulation: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    data: str = field(default="synthetic", metadata={"help": "data.source of every cell"})
    warmup_steps: int = field(default=3, metadata={"help": "steps left out of each result"})
    measure_steps: int = field(default=10, metadata={"help": "measured steps per cell"})
    timeout_s: float = field(default=900.0, metadata={"help": "kill a cell after this many seconds"})
    base: Any = field(
        default_factory=dict,
        metadata={"help": "run-config fields for every cell (nested mapping); not those a cell sets itself "
                          "(data.source, train.precision, …: the keys above), the model's shape, nor what a "
                          "measuring run turns off (checkpoints, profiler, trackers, budget)"},
    )  # fmt: skip

    def __post_init__(self) -> None:
        for axis in _AXES:
            values = getattr(self, axis)
            if not values:
                raise ConfigError(axis, "must list at least one value")
            if len(set(values)) != len(values):
                raise ConfigError(axis, f"lists a value twice: {brief(values)}")
        for name in ("world_sizes", "micro_batch_sizes"):
            for v in getattr(self, name):
                check_positive(name, v)
        check_positive("accumulation", self.accumulation)
        check_positive("warmup_steps", self.warmup_steps, allow_zero=True)
        check_positive("measure_steps", self.measure_steps)
        check_seconds("timeout_s", self.timeout_s)
        if not isinstance(self.base, Mapping):
            raise ConfigError("base", f"expected a mapping of run-config sections, got {brief(self.base)}")
        cells = math.prod(len(getattr(self, axis)) for axis in _AXES)
        if cells > MAX_CELLS:
            raise ConfigError(
                "", f"its axes make {cells:,} cells; at most {MAX_CELLS:,} (split the matrix in several)"
            )
        _check_base(self)


@dataclass(frozen=True, kw_only=True)
class Cell:
    id: str
    model: str
    strategy: str
    world_size: int
    micro_batch_size: int
    precision: str
    config: RunConfig  # the cell's whole run config, validated

    @property
    def label(self) -> str:
        return f"{self.model} {self.strategy} ×{self.world_size} mb {self.micro_batch_size} {self.precision}"


def _matrix_dir() -> Path:
    return Path(str(resources.files("gaudi3_scale.bench") / "matrices"))


def list_matrices() -> list[str]:
    """Names of the matrices shipped with the package."""
    return sorted(p.stem for p in _matrix_dir().glob("*.yaml"))


def load_matrix(spec: str | Path, *, here: bool = False) -> tuple[MatrixConfig, list[Cell]]:
    """A matrix file, or the name of a shipped one; cells ordered by world size so 1-rank baselines come first.

    `here`: also refuse a precision or device this machine cannot train in (`device.select.check_device_precision`,
    the check `gaudi3 train` makes at launch), naming the matrix key: `precisions`, or the `base` field."""
    path = Path(spec)
    if not path.is_file():
        shipped = _matrix_dir() / f"{spec}.yaml"
        if not shipped.is_file():
            raise UserInputError(
                f"--matrix: {spec} is neither a file nor a shipped matrix; shipped: {', '.join(list_matrices())}"
            )
        path = shipped
    try:
        matrix = from_dict(MatrixConfig, load_yaml(path, what="matrix file"))
    except ConfigError as exc:
        raise UserInputError(f"{path}: {exc}") from None
    cells = _cells(matrix, path)
    if here:
        _check_runs_here(cells, path)
    return matrix, cells


_Axes = tuple[int, str, str, int, str]  # a cell's world size, model, strategy, micro-batch, precision


def _cell_axes(m: MatrixConfig) -> list[_Axes]:
    """Every cell's axes, 1-rank baselines first."""
    return list(
        itertools.product(sorted(m.world_sizes), m.models, m.strategies, m.micro_batch_sizes, m.precisions)
    )


def _cell_id(axes: _Axes) -> str:
    world, model, strategy, micro, precision = axes
    return f"{model}.{strategy}.w{world}.mb{micro}.{precision}"


def _base_spike_policy(base: Mapping[str, Any]) -> str:
    health = base.get("health")
    policy = health.get("spike_policy") if isinstance(health, Mapping) else None
    return policy if isinstance(policy, str) else "warn"  # not a policy: the cell's config names the field


def _throwaway_overrides(spike_policy: str) -> dict[str, Any]:
    """What every short run made to measure a config turns off (`train.config.throwaway_run_overrides`), nested."""
    from gaudi3_scale.train.config import RunConfig, throwaway_run_overrides

    return apply_overrides(RunConfig, {}, parse_overrides(throwaway_run_overrides(spike_policy=spike_policy)))


def _data_parallel_ranks(base: Mapping[str, Any], world: int) -> int:
    """Of a cell's `world` ranks, those that read their own micro-batches: a base's tensor-parallel groups and
    pipelines read one batch each (`distributed.plan.data_parallel_size`). A layout that does not divide `world`
    (or is not a number) is left to the cell's config to refuse, naming the field."""
    parallel = base.get("parallel")
    sizes = [parallel.get(name, 1) if isinstance(parallel, Mapping) else 1 for name in ("tp_size", "pp_size")]
    if not all(type(size) is int and size >= 1 for size in sizes) or world % math.prod(sizes):
        return world
    return data_parallel_size(world, *sizes)


def _cell_overrides(m: MatrixConfig, axes: _Axes, throwaway: Mapping[str, Any]) -> dict[str, Any]:
    """What a cell sets over `base`: its axes, the matrix's data, batch and steps, and `throwaway`
    (`_throwaway_overrides`)."""
    world, model, strategy, micro, precision = axes
    cell_id = _cell_id(axes)
    batch = BatchPlan.from_micro_batch(
        micro, accumulation=m.accumulation, data_parallel_size=_data_parallel_ranks(m.base, world)
    )
    train = {
        "precision": precision,
        "micro_batch_size": micro,
        "global_batch_size": batch.global_batch_size,
        "global_batch_tokens": None,  # the batch is the matrix's, in sequences
        "max_steps": m.warmup_steps + m.measure_steps,
        "log_every_steps": 1,
        "val_every_steps": 0,
        "val_batches": 1,
        "throughput_warmup_steps": m.warmup_steps,  # the run's summary leaves out what the result leaves out
    }
    bench = {"result": True, "warmup_steps": m.warmup_steps, "cell_id": cell_id, "matrix": m.name}
    own = {
        "name": cell_id,
        "model": {"name": model},
        "data": {"source": m.data, "mixture": None},
        "parallel": {"strategy": strategy, "nproc_per_node": world},
        "train": train,
        "benchmark": bench,
    }
    return merge_mappings(own, copy.deepcopy(dict(throwaway)))  # own first: a refusal names the axes first


# Why a run-config field a cell owns cannot come from `base` with another value, and what to write instead ({} is the
# base's value); a field not listed is one every benchmark cell fixes (`_FIXED`).
_SET_BY = {
    "name": "set in every cell (a cell is named by its id); leave it out of base",
    "model.name": "set by the matrix's `models` (use models: [{}])",
    "data.source": "set by the matrix's `data` (use data: {})",
    "data.mixture": "set by the matrix's `data`: a cell reads that one source, which its result names; leave it "
    "out of base",
    "parallel.strategy": "set by the matrix's `strategies` (use strategies: [{}])",
    "parallel.nproc_per_node": "set by the matrix's `world_sizes` (use world_sizes: [{}])",
    "train.precision": "set by the matrix's `precisions` (use precisions: [{}])",
    "train.micro_batch_size": "set by the matrix's `micro_batch_sizes` (use micro_batch_sizes: [{}])",
    "train.global_batch_size": "set by the matrix: micro-batch × ranks × `accumulation` (set accumulation)",
    "train.global_batch_tokens": "set by the matrix: micro-batch × ranks × `accumulation` (set accumulation)",
    "train.max_steps": "set by the matrix: `warmup_steps` + `measure_steps` (set those)",
    "train.max_epochs": "set by the matrix: `warmup_steps` + `measure_steps` (set those)",
    "train.throughput_warmup_steps": "set by the matrix's `warmup_steps` (use warmup_steps: {})",
    "train.profile_start_step": "a benchmark cell is not profiled: the profiler's steps would be measured; leave "
    "it out of base (profile a cell with gaudi3 train --config cells/<id>/cell.yaml --profile START:END)",
    "benchmark.warmup_steps": "set by the matrix's `warmup_steps` (use warmup_steps: {})",
    "benchmark.matrix": "set by the matrix's `name` (use name: {})",
}
_FIXED = (
    "set in every benchmark cell, a short run made to measure (each step logged; no validation, checkpoints, "
    "tracker runs, metrics port or cost budget); leave it out of base"
)
_SHAPE = "set by the matrix's `models`: a cell runs its preset's shape, under the preset's name; leave it out of base"


def _owned_values(m: MatrixConfig) -> dict[str, list[Any]]:
    """Each dotted run-config field a cell owns → the values the cells give it (a base holding one of those in every
    cell changes nothing). A base `spike_policy: rollback` is not owned: cells warn instead (module docstring)."""
    from gaudi3_scale.models.pretrained import SHAPE_FIELDS
    from gaudi3_scale.models.registry import get_model_config

    owned: dict[str, list[Any]] = {}
    throwaway = _throwaway_overrides("warn")
    for axes in _cell_axes(m):
        for dotted, value in _leaves(_cell_overrides(m, axes, throwaway)).items():
            values = owned.setdefault(dotted, [])
            if value not in values:
                values.append(value)
    presets = []
    for name in m.models:
        try:
            presets.append(get_model_config(name))
        except ValueError:
            continue  # an unknown preset: its cell's config names it
    for name in (*SHAPE_FIELDS, "init_from") if presets else ():
        owned[f"model.{name}"] = [getattr(preset, name) for preset in presets]
    return owned


def _check_base(m: MatrixConfig) -> None:
    """ConfigError naming every `base` field that would change what a cell runs (see the module docstring): the
    first with why and what to write instead, the others after it."""
    refused: dict[str, str] = {}  # the base field as written → why
    for dotted, values in _owned_values(m).items():
        parts = dotted.split(".")
        node: Any = m.base
        for depth, part in enumerate(parts):
            if not isinstance(node, Mapping) or part not in node:
                break  # base leaves the field alone
            node = node[part]
            leaf = depth == len(parts) - 1
            if leaf and all(node == value for value in values):
                break  # what every cell sets anyway
            # The field itself, or a section the cell's settings replace (`base: {data: tinyshakespeare}`).
            if leaf or not isinstance(node, Mapping):
                shown = brief(node).strip("'\"") if isinstance(node, str) else brief(node)
                why = (
                    _SHAPE
                    if dotted.startswith("model.") and dotted != "model.name"
                    else _SET_BY.get(dotted, _FIXED)
                )
                refused.setdefault(f"base.{'.'.join(parts[: depth + 1])}", why.format(shown))
                break
    if refused:
        (first, why), *others = refused.items()
        also = (
            f"; also refused in base: {_grouped([name.removeprefix('base.') for name, _ in others])}"
            if others
            else ""
        )
        raise ConfigError(first, why + also)


def _grouped(dotted: list[str]) -> str:
    """`model.name, model.dim, data.source` as `model.{name, dim}, data.source` (a whole config's list stays one
    line)."""
    sections: dict[str, list[str]] = {}
    for name in dotted:
        section, _, rest = name.partition(".")
        sections.setdefault(section, []).append(rest)
    shown = [s if rest == [""] else f"{s}.{rest[0]}" if len(rest) == 1 else f"{s}.{{{', '.join(rest)}}}"
             for s, rest in sections.items()]  # fmt: skip
    return ", ".join(shown)


def _leaves(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """The leaves of a nested mapping by dotted name."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(_leaves(value, f"{name}."))
        else:
            out[name] = value
    return out


def _cells(m: MatrixConfig, path: Path) -> list[Cell]:
    from gaudi3_scale.train.config import build_run_config

    cells = []
    throwaway = _throwaway_overrides(_base_spike_policy(m.base))
    for axes in _cell_axes(m):
        world, model, strategy, micro, precision = axes
        cell_id = _cell_id(axes)
        raw = merge_mappings(m.base, _cell_overrides(m, axes, throwaway))
        try:
            config = build_run_config(None, (), base=raw)
        except ConfigError as exc:
            raise UserInputError(f"{path}: cell {cell_id}: {exc}") from None
        cells.append(Cell(id=cell_id, model=model, strategy=strategy, world_size=world, micro_batch_size=micro,
                          precision=precision, config=config))  # fmt: skip
    return cells


def _check_runs_here(cells: list[Cell], path: Path) -> None:
    """One line naming the matrix key (`precisions`, or the `base` field) of the first precision or device this
    machine cannot train in."""
    from gaudi3_scale.device.select import check_device_precision

    for device, precision in dict.fromkeys((c.config.train.device, c.config.train.precision) for c in cells):
        try:
            check_device_precision(device, precision)
        except ConfigError as exc:
            if exc.field != "train.precision":  # the device, or what it lacks: set in base
                raise UserInputError(f"{path}: base.{exc}") from None
            shown = exc.problem if exc.problem.startswith(precision) else f"{precision}: {exc.problem}"
            raise UserInputError(f"{path}: precisions: {shown}") from None
