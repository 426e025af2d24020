"""A benchmark matrix: strategy × world size × model preset × micro-batch × precision, each cell a training job.

A matrix is a YAML file (or the name of one shipped in `bench/matrices/`):

    name: cpu-small
    description: …
    models: [shakespeare-char]          # registry presets
    strategies: [ddp, fsdp]             # parallel.strategy values
    world_sizes: [1, 2]                 # ranks on one node (nproc_per_node)
    micro_batch_sizes: [4]              # sequences per rank per forward pass
    precisions: [32-true]               # train.precision values
    accumulation: 1                     # global batch = micro-batch × ranks × accumulation (weak scaling)
    data: synthetic                     # data.source: synthetic[:VOCAB], a bundled corpus, files…
    warmup_steps: 3                     # steps left out of the result
    measure_steps: 10
    timeout_s: 900                      # per cell
    base: {train: {threads: 1}}         # any run-config fields for every cell, but none the matrix sets itself

Every cell's run config is built (and so validated) when the matrix is loaded: a bad value fails before anything
runs, as one line naming the cell and the field. A `base` field that the matrix sets in every cell (its axes, data,
batch and steps, and what a benchmark cell always fixes: `_cell_overrides`) is refused, naming the matrix key to use:
merged under the cell's own settings, it would be dropped without a word.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gaudi3_scale.checkpoint.config import CHECKPOINTS_OFF
from gaudi3_scale.config.core import check_positive, from_dict, load_yaml, merge_mappings
from gaudi3_scale.config.errors import ConfigError, UserInputError, brief
from gaudi3_scale.config.numbers import check_seconds
from gaudi3_scale.distributed.plan import BatchPlan

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
        metadata={"help": "run-config fields for every cell (nested mapping); not those the matrix sets itself "
                          "(data.source, train.precision, …: the keys above)"},
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
        _check_base(self)
        cells = math.prod(len(getattr(self, axis)) for axis in _AXES)
        if cells > MAX_CELLS:
            raise ConfigError(
                "", f"its axes make {cells:,} cells; at most {MAX_CELLS:,} (split the matrix in several)"
            )


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


def load_matrix(spec: str | Path) -> tuple[MatrixConfig, list[Cell]]:
    """A matrix file, or the name of a shipped one; cells ordered by world size so 1-rank baselines come first."""
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
    return matrix, _cells(matrix, path)


def _cell_overrides(m: MatrixConfig, cell_id: str, model: str, strategy: str, world: int, micro: int,
                    precision: str) -> dict[str, Any]:  # fmt: skip
    train = {
        "precision": precision,
        "micro_batch_size": micro,
        "global_batch_size": BatchPlan.from_micro_batch(
            micro, accumulation=m.accumulation, data_parallel_size=world
        ).global_batch_size,  # a matrix has no tensor parallel: every rank reads its own micro-batches
        "max_steps": m.warmup_steps + m.measure_steps,
        "log_every_steps": 1,
        "val_every_steps": 0,
        "val_batches": 1,
        "throughput_warmup_steps": m.warmup_steps,  # the run's summary leaves out what the result leaves out
    }
    bench = {"result": True, "warmup_steps": m.warmup_steps, "cell_id": cell_id, "matrix": m.name}
    return {
        "name": cell_id,
        "model": {"name": model},
        "data": {"source": m.data},
        "parallel": {"strategy": strategy, "nproc_per_node": world},
        "train": train,
        "checkpoint": dict(CHECKPOINTS_OFF),
        "benchmark": bench,
    }


# Why a run-config field `_cell_overrides` owns cannot come from `base`, and what to write instead ({} is the base's
# value); a field not listed is one every benchmark cell fixes.
_SET_BY = {
    "name": "set in every cell (a cell is named by its id); leave it out of base",
    "model.name": "set by the matrix's `models` (use models: [{}])",
    "data.source": "set by the matrix's `data` (use data: {})",
    "parallel.strategy": "set by the matrix's `strategies` (use strategies: [{}])",
    "parallel.nproc_per_node": "set by the matrix's `world_sizes` (use world_sizes: [{}])",
    "train.precision": "set by the matrix's `precisions` (use precisions: [{}])",
    "train.micro_batch_size": "set by the matrix's `micro_batch_sizes` (use micro_batch_sizes: [{}])",
    "train.global_batch_size": "set by the matrix: micro-batch × ranks × `accumulation` (set accumulation)",
    "train.max_steps": "set by the matrix: `warmup_steps` + `measure_steps` (set those)",
    "train.throughput_warmup_steps": "set by the matrix's `warmup_steps` (use warmup_steps: {})",
    "benchmark.warmup_steps": "set by the matrix's `warmup_steps` (use warmup_steps: {})",
    "benchmark.matrix": "set by the matrix's `name` (use name: {})",
}
_FIXED = "set in every benchmark cell (each step logged, no validation, no checkpoints); leave it out of base"


def _check_base(m: MatrixConfig) -> None:
    """ConfigError naming the first `base` field the cells' own settings would replace (see the module docstring)."""
    owned = _cell_overrides(m, "cell", m.models[0], m.strategies[0], m.world_sizes[0], m.micro_batch_sizes[0],
                            m.precisions[0])  # fmt: skip
    for dotted in _dotted(owned):
        parts = dotted.split(".")
        node: Any = m.base
        for depth, part in enumerate(parts):
            if not isinstance(node, Mapping) or part not in node:
                break  # base leaves the field alone
            node = node[part]
            # The field itself, or a section the cell's settings replace (`base: {data: tinyshakespeare}`).
            if depth == len(parts) - 1 or not isinstance(node, Mapping):
                shown = brief(node).strip("'\"") if isinstance(node, str) else brief(node)
                message = _SET_BY.get(dotted, _FIXED).format(shown)
                raise ConfigError(f"base.{'.'.join(parts[: depth + 1])}", message)


def _dotted(tree: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The dotted names of a nested mapping's leaves."""
    out = []
    for key, value in tree.items():
        name = f"{prefix}{key}"
        out += _dotted(value, f"{name}.") if isinstance(value, Mapping) and value else [name]
    return out


def _cells(m: MatrixConfig, path: Path) -> list[Cell]:
    from gaudi3_scale.train.config import build_run_config

    cells = []
    axes = (sorted(m.world_sizes), m.models, m.strategies, m.micro_batch_sizes, m.precisions)
    for world, model, strategy, micro, precision in itertools.product(*axes):
        cell_id = f"{model}.{strategy}.w{world}.mb{micro}.{precision}"
        raw = merge_mappings(m.base, _cell_overrides(m, cell_id, model, strategy, world, micro, precision))
        try:
            config = build_run_config(None, (), base=raw)
        except ConfigError as exc:
            raise UserInputError(f"{path}: cell {cell_id}: {exc}") from None
        cells.append(Cell(id=cell_id, model=model, strategy=strategy, world_size=world, micro_batch_size=micro,
                          precision=precision, config=config))  # fmt: skip
    return cells
