"""The `benchmark` section of a run config: what makes a training run a benchmark cell.

It lives here, beside the run config, and not in `bench/`: every run config has the section and the training run
reads it (rank 0 writes the cell's result when `benchmark.result` is set), so the trainer must not reach up into
the benchmark tool for it. `bench/` (matrices, runner, reports) imports it from here."""

from __future__ import annotations

from dataclasses import dataclass, field

from gaudi3_scale.config.core import check_name, check_positive

__all__ = ["BenchmarkConfig"]


@dataclass(kw_only=True)
class BenchmarkConfig:
    result: bool = field(
        default=False,
        metadata={
            "help": "at the end, rank 0 writes benchmark_result.json into the output directory and prints it "
            "between GAUDI3-BENCHMARK-RESULT markers on stdout (for `gaudi3 benchmark collect` on pod logs)"
        },
    )
    warmup_steps: int | None = field(
        default=None,
        metadata={
            "help": "first optimizer steps left out of the benchmark result (warm-up, compile); null = the "
            "run's train.throughput_warmup_steps rule, the steps its summary leaves out"
        },
    )
    cell_id: str | None = field(
        default=None,
        metadata={"help": "the cell's id in its matrix (letters, digits, . _ -); null = the run name"},
    )
    matrix: str | None = field(default=None, metadata={"help": "the matrix this cell belongs to"})

    def __post_init__(self) -> None:
        check_positive("warmup_steps", self.warmup_steps, allow_zero=True)
        check_name("cell_id", self.cell_id)  # it names the cell's directory
