"""The end of a benchmark cell's run, on its rank 0: the result from the run's metrics, written and printed.

Any training run with `benchmark.result: true` is a cell: the matrix runner launches exactly that (`gaudi3 train
--config cell.yaml --nproc-per-node N`), and so can a Kubernetes job; `gaudi3 benchmark collect` then reads the
result from the job's logs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from gaudi3_scale.bench.result import (
    RESULT_FILE,
    cell_section,
    measure_h2d_gbps,
    print_result,
    result_from_metrics,
    write_result,
)

if TYPE_CHECKING:
    from gaudi3_scale.train.config import RunConfig

__all__ = ["cell_of_config", "cell_warmup_steps", "emit_run_result"]


def cell_warmup_steps(cfg: RunConfig) -> int:
    """Steps a cell's result leaves out: its own setting, else those the run's summary leaves out."""
    warmup = cfg.benchmark.warmup_steps
    return warmup if warmup is not None else cfg.train.resolved_throughput_warmup_steps()


def cell_of_config(cfg: RunConfig, *, precision: str) -> dict[str, Any]:
    plan = cfg.parallel_plan()
    return cell_section(
        cell_id=cfg.benchmark.cell_id or cfg.name,
        matrix=cfg.benchmark.matrix,
        model=cfg.model.name,
        strategy=plan.strategy,
        world_size=plan.world_size,
        nnodes=cfg.parallel.nnodes,
        batch=cfg.batch_plan(),
        precision=precision,
        data=cfg.data.source,
    )


def emit_run_result(cfg: RunConfig, out_dir: Path, *, precision: str, accelerator: str) -> dict[str, Any]:
    """Build the result of the finished run in `out_dir`, write `out_dir/benchmark_result.json`, print it."""
    import torch

    from gaudi3_scale.monitor.environment import environment_info
    from gaudi3_scale.train.report import read_metrics

    result = result_from_metrics(
        cell_of_config(cfg, precision=precision),
        read_metrics(out_dir / "metrics.jsonl"),
        warmup_steps=cell_warmup_steps(cfg),
        h2d_gbps=measure_h2d_gbps(torch.device(accelerator)),
        environment=environment_info(),
    )
    write_result(result, out_dir / RESULT_FILE)
    print_result(result)
    return result
