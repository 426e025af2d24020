"""Pipeline parallel on CPU (issue #40, item 5): each schedule's measured bubble against its formula, tokens/s of
PP 2 against FSDP 2 on the same 2 ranks, and the first stage's peak memory under 1F1B against GPipe.

Every cell is a real 2-rank launch (torchrun, gloo, 1 thread per rank) of this file's worker, which builds the
model as the trainer does (`distributed.parallelize.build_parallelized`: stages from `distributed.pipeline`, FSDP2
over each stage's data-parallel ranks) and runs training steps of `--micro-batches` micro-batches:

* bubble: the worker times each of its stages' compute actions (torch's `forward_one_chunk`,
  `backward_one_chunk`, `backward_weight_one_chunk`, wrapped with a clock: what the schedule calls between its
  sends and receives; and `perform_reduce_grad` / `scale_grads`, the gradient work after the last backward) and
  the step's wall time. A rank's busy share is their sum ÷ the step; its measured bubble is the rest. Two
  references: the formula (`distributed.schedule_math.bubble_fraction`: balanced stages, equal passes, free
  transfers; the model is 8 equal Llama blocks with a 65-character vocabulary, a head of 1 % of the FLOPs), and
  the schedule laid out on the pass times this step measured (`simulated_bubble` over the order each rank ran:
  what the stages' imbalance and the passes' ratios leave, transfers free). Measured minus the second is what
  the transfers (b × s × h per micro-batch over gloo, counted as idle, as they are on a rank) and the runtime add.
* tokens/s: the same global batch per step (m micro-batches of b sequences) under PP 2 (one pipeline) and FSDP 2
  (two data-parallel ranks of m / 2 micro-batches each, gradients reduce-scattered once per step);
* memory: peak RSS of each rank (ru_maxrss) above its RSS before the first step, with MALLOC_MMAP_THRESHOLD_=131072
  (freed tensors go back to the OS at once, as in bench_memory_estimate.py), next to `tune.memory`'s estimate.

Goals: measured bubble within 10 % of the formula (relative; reported also against the schedule on measured
compute); 1F1B's first-stage peak ≤ GPipe's at the same m.
The machine's other load inflates wall time and so the measured bubble: run the full variant on a quiet machine.

    PYTHONPATH=src python benchmarks/bench_pipeline.py            # → benchmarks/results/pipeline_cpu.json, .png
    PYTHONPATH=src python benchmarks/bench_pipeline.py --quick    # 2 measured steps, m = 4 → pipeline_cpu_quick.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench_args import positive_int

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv")
MODEL = dict(
    dim=256, num_layers=8, num_heads=8, num_kv_heads=4, ffn_dim=768, context_length=256, vocab_size=65
)
_TIMED = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
RESULT = Path(__file__).parent / "results" / "pipeline_cpu.json"
_AFTER = ("perform_reduce_grad", "scale_grads")  # a stage's gradient work after its last backward


def _micro_batches(text: str) -> int:
    """`--micro-batches`: even, as FSDP 2 splits the same global batch over its 2 data-parallel ranks."""
    value = positive_int(text)
    if value % 2:
        raise argparse.ArgumentTypeError(f"must be even (FSDP 2 splits them over 2 ranks), got {value}")
    return value


def _model() -> Any:
    from gaudi3_scale.models import get_model_config

    return replace(get_model_config("llama-tiny"), **MODEL)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _instrument(actions: dict[str, float]) -> None:
    """Record the wall time of every stage compute action in `actions`, under torch's name for it ("{stage}{F|B|I|W}
    {micro-batch}": forward, full backward, input-gradient and weight-gradient backward), and of each stage's
    gradient work after its last backward ("{stage}R": FSDP's reduce-scatter, the division by m), by wrapping
    torch's stage methods in place."""
    from torch.distributed.pipelining import stage

    def kind(name: str, kwargs: dict[str, Any], args: tuple[Any, ...]) -> str:
        if name == "forward_one_chunk":
            return "F"
        if name == "backward_weight_one_chunk":
            return "W"
        full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
        return "B" if full else "I"

    for name in _TIMED:
        original = getattr(stage._PipelineStageBase, name)

        def timed(self: Any, chunk: int, *args: Any, __name: str = name, __original: Any = original,
                  **kwargs: Any) -> Any:  # fmt: skip
            started = time.perf_counter()
            try:
                return __original(self, chunk, *args, **kwargs)
            finally:
                label = f"{self.stage_index}{kind(__name, kwargs, args)}{chunk}"
                actions[label] = actions.get(label, 0.0) + time.perf_counter() - started

        setattr(stage._PipelineStageBase, name, timed)

    inside = [False]  # perform_reduce_grad calls scale_grads: count the outer call only
    for name in _AFTER:
        original = getattr(stage._PipelineStageBase, name)

        def after(self: Any, *args: Any, __original: Any = original, **kwargs: Any) -> Any:
            if inside[0]:
                return __original(self, *args, **kwargs)
            inside[0], started = True, time.perf_counter()
            try:
                return __original(self, *args, **kwargs)
            finally:
                inside[0] = False
                label = f"{self.stage_index}R"
                actions[label] = actions.get(label, 0.0) + time.perf_counter() - started

        setattr(stage._PipelineStageBase, name, after)


def worker(mode: str, micro: int, micro_batches: int, warmup: int, steps: int, out: Path) -> None:
    """One rank of a cell: `mode` is a schedule (PP 2) or "fsdp" (FSDP 2)."""
    import torch
    import torch.distributed as dist

    from gaudi3_scale.distributed.mesh import build_device_mesh
    from gaudi3_scale.distributed.parallelize import build_parallelized
    from gaudi3_scale.distributed.plan import BatchPlan, ParallelPlan
    from gaudi3_scale.train.module import next_token_loss
    from gaudi3_scale.tune.memory import estimate_memory

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pp = 1 if mode == "fsdp" else world
    plan = ParallelPlan.build(strategy="fsdp", world_size=world, pp_size=pp,
                              **({"pp_schedule": mode} if pp > 1 else {}))  # fmt: skip
    per_rank = micro_batches // plan.data_parallel_size  # the same global batch under both layouts
    mesh = build_device_mesh("cpu", world_size=world, tp_size=1, dp_replicate=1, pp_size=pp)
    model_cfg = _model()
    built = build_parallelized(model_cfg, plan, seed=0, loss=next_token_loss, mesh=mesh, device="cpu",
                               micro_batches=per_rank)  # fmt: skip
    optimizer = torch.optim.AdamW(built.model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(rank if pp == 1 else 0)  # the pipeline's ranks read one batch
    shape = (micro * per_rank, model_cfg.context_length + 1)
    actions: dict[str, float] = {}
    _instrument(actions)
    rss_before = _rss_bytes()
    records = []
    for step in range(warmup + steps):
        data = torch.randint(0, model_cfg.vocab_size, shape, generator=generator)
        tokens, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()
        dist.barrier()
        actions.clear()
        busy = 0.0
        started = time.perf_counter()
        if built.pipeline is not None:
            built.pipeline.train_step(tokens, targets)
        else:
            for chunk in range(per_rank):
                rows = slice(chunk * micro, (chunk + 1) * micro)
                t0 = time.perf_counter()
                (built.loss_fn(tokens[rows], targets[rows]) / per_rank).backward()
                busy += time.perf_counter() - t0
        wall = time.perf_counter() - started
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= warmup:
            busy = busy or sum(actions.values())
            records.append({"wall_s": wall, "busy_s": busy, "actions": dict(actions)})
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    batch = BatchPlan.from_micro_batch(micro, accumulation=per_rank, data_parallel_size=plan.data_parallel_size,
                                       context_length=model_cfg.context_length)  # fmt: skip
    estimate = estimate_memory(model_cfg, plan, batch, precision="32-true", device_kind="cpu",
                               **({"pp_rank": rank} if pp > 1 else {}))  # fmt: skip
    result = {"rank": rank, "steps": records, "rss_before_bytes": rss_before, "peak_rss_bytes": peak,
              "estimate_activations_bytes": estimate.activations_bytes,
              "estimate_total_bytes": estimate.total_bytes,
              # what ran: per_rank micro-batches on each data-parallel rank (one pipeline under PP)
              "tokens_per_step": micro * per_rank * plan.data_parallel_size * model_cfg.context_length}  # fmt: skip
    if built.pipeline is not None:  # the order torch's schedule ran each rank's actions in
        order = built.pipeline._schedule(True).pipeline_order
        result["pipeline_order"] = {
            r: [str(a) for a in listed if a is not None] for r, listed in order.items()
        }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _launch(out: Path, mode: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
               __file__, "--worker", mode, "--micro", str(args.micro), "--micro-batches", str(args.micro_batches),
               "--warmup", str(args.warmup), "--steps", str(args.steps), "--worker-out", str(out)]  # fmt: skip
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        errors = [line for line in proc.stderr.splitlines() if "Error" in line]
        raise SystemExit(f"{mode}: the 2-rank launch failed: {errors[0] if errors else proc.returncode}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _summarise(mode: str, ranks: list[dict[str, Any]], micro_batches: int) -> dict[str, Any]:
    from gaudi3_scale.distributed.schedule_math import bubble_fraction, simulate_step, single_stage_order

    walls = [max(r["steps"][i]["wall_s"] for r in ranks) for i in range(len(ranks[0]["steps"]))]
    cell: dict[str, Any] = {
        "mode": mode,
        "step_s_median": statistics.median(walls),
        "tokens_per_s": ranks[0]["tokens_per_step"] / statistics.median(walls),
        "per_rank": [],
    }
    for r in ranks:
        bubbles = [1 - s["busy_s"] / s["wall_s"] for s in r["steps"]]
        cell["per_rank"].append({
            "rank": r["rank"], "bubble_measured": statistics.median(bubbles), "bubble_per_step": bubbles,
            "peak_rss_above_start_bytes": r["peak_rss_bytes"] - r["rss_before_bytes"],
            "peak_rss_bytes": r["peak_rss_bytes"], "estimate_total_bytes": r["estimate_total_bytes"],
            "estimate_activations_bytes": r["estimate_activations_bytes"],
        })  # fmt: skip
    if mode != "fsdp":
        formula = bubble_fraction(mode, 2, micro_batches)
        measured = statistics.mean(r["bubble_measured"] for r in cell["per_rank"])
        # the schedule's bubble on each step's measured compute alone (transfers and overheads free)
        if mode in ("gpipe", "1f1b"):
            order = {rank: single_stage_order(mode, 2, rank, micro_batches) for rank in range(2)}
        else:  # the multi-stage runtime runs torch's pipeline_order
            order = {int(rank): listed for rank, listed in ranks[0]["pipeline_order"].items()}
        held = {rank: {int(re.match(r"\d+", a)[0]) for a in listed} for rank, listed in order.items()}
        ideal_per_step = []
        for i in range(len(ranks[0]["steps"])):
            seconds = {**ranks[0]["steps"][i]["actions"], **ranks[1]["steps"][i]["actions"]}
            timeline = simulate_step(order, seconds)
            after = {rank: sum(seconds.get(f"{stage}R", 0.0) for stage in held[rank]) for rank in order}
            step_s = max(finish + after[rank] for rank, (finish, _) in timeline.items())
            ideal_per_step.append(statistics.mean(1 - (busy + after[rank]) / step_s
                                                  for rank, (_, busy) in timeline.items()))  # fmt: skip
        ideal = statistics.median(ideal_per_step)
        passes: dict[str, list[float]] = {}
        for r in ranks:
            for step in r["steps"]:
                for label, value in step["actions"].items():
                    passes.setdefault(re.sub(r"\d+$", "", label) if not label.endswith("R") else label,
                                      []).append(value)  # fmt: skip
        cell["pass_s_mean"] = {label: statistics.mean(v) for label, v in sorted(passes.items())}
        cell.update(bubble_formula=formula, bubble_measured=measured, bubble_ideal=ideal,
                    bubble_ideal_per_step=ideal_per_step,
                    bubble_error_pct=100 * (measured - formula) / formula,
                    bubble_vs_ideal_pct=100 * (measured - ideal) / ideal if ideal else None,
                    bubble_abs_error=measured - formula)  # fmt: skip
    return cell


def _plot(cells: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pipes = [m for m in SCHEDULES if m in cells]
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(14, 4), dpi=110)
    x = range(len(pipes))
    left.bar([i - 0.27 for i in x], [cells[m]["bubble_formula"] for m in pipes], width=0.27, label="formula")
    left.bar([i for i in x], [cells[m]["bubble_ideal"] for m in pipes], width=0.27,
             label="schedule on measured compute")  # fmt: skip
    left.bar(
        [i + 0.27 for i in x], [cells[m]["bubble_measured"] for m in pipes], width=0.27, label="measured"
    )
    left.set_xticks(list(x), pipes)
    left.set_ylabel("bubble: idle share of a step")
    left.set_title("PP 2: bubble per schedule")
    left.legend(fontsize=7)
    names = [*pipes, "fsdp"]
    middle.bar(names, [cells[m]["tokens_per_s"] for m in names if m in cells], color="tab:gray")
    middle.set_ylabel("tokens/s (2 ranks)")
    middle.set_title("PP 2 schedules vs FSDP 2, same global batch")
    middle.tick_params(axis="x", labelsize=8)
    first = [cells[m]["per_rank"][0]["peak_rss_above_start_bytes"] / 2**20 for m in pipes]
    right.bar(pipes, first, color="tab:purple")
    right.set_ylabel("first stage's peak RSS above its start, MiB")
    right.set_title("memory of rank 0 (stage 0)")
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="2 measured steps, m = 4 (checks that it works)")
    parser.add_argument("--micro", type=positive_int, default=4, help="sequences per micro-batch")
    # even: FSDP 2 splits the same global batch over its 2 data-parallel ranks
    parser.add_argument("--micro-batches", type=_micro_batches, default=8, help="micro-batches per step (m)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=positive_int, default=8)
    parser.add_argument("--out", type=Path, default=RESULT)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.warmup < 0:
        parser.error(f"argument --warmup: must be at least 0, got {args.warmup}")
    if args.worker:
        worker(args.worker, args.micro, args.micro_batches, args.warmup, args.steps, args.worker_out)
        return
    if args.quick:
        args.micro_batches, args.warmup, args.steps = 4, 1, 2
        if args.out == RESULT:
            args.out = RESULT.with_name("pipeline_cpu_quick.json")
    from rich.progress import track

    from gaudi3_scale.config.atomic import write_text_atomic
    from gaudi3_scale.monitor.environment import environment_info

    cells: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in track([*SCHEDULES, "fsdp"], description="PP 2 schedules, FSDP 2"):
            cells[mode] = _summarise(mode, _launch(Path(tmp) / mode, mode, args), args.micro_batches)
    gpipe, f1b = (cells[m]["per_rank"][0]["peak_rss_above_start_bytes"] for m in ("gpipe", "1f1b"))
    report = {
        "benchmark": "pipeline_cpu",
        "machine": environment_info(),
        "command": " ".join(["PYTHONPATH=src python benchmarks/bench_pipeline.py", *sys.argv[1:]]),
        "settings": {
            "model": MODEL,
            "micro_batch_size": args.micro,
            "micro_batches": args.micro_batches,
            "pp_size": 2,
            "warmup_steps": args.warmup,
            "measured_steps": args.steps,
            "threads_per_rank": 1,
            "malloc_mmap_threshold": 131072,
        },
        "cells": cells,
        "goals": {
            "bubble_within_10_pct": {m: abs(cells[m]["bubble_error_pct"]) <= 10 for m in SCHEDULES},
            "bubble_within_10_pct_of_schedule_on_measured_compute": {
                m: abs(cells[m]["bubble_vs_ideal_pct"]) <= 10 for m in SCHEDULES
            },
            "first_stage_peak_1f1b_le_gpipe": f1b <= gpipe,
        },
        "pp2_over_fsdp2_tokens_per_s": {
            m: cells[m]["tokens_per_s"] / cells["fsdp"]["tokens_per_s"] for m in SCHEDULES
        },
    }
    print(
        f"{'cell':17s} {'step':>8s} {'tok/s':>8s} {'bubble':>7s} {'formula':>7s} {'ideal':>7s} {'rank0 peak':>11s}"
    )
    for mode, cell in cells.items():
        bubble = (
            f"{cell['bubble_measured']:7.3f} {cell['bubble_formula']:7.3f} {cell['bubble_ideal']:7.3f}"
            if mode != "fsdp"
            else " " * 23
        )
        print(f"{mode:17s} {cell['step_s_median']:7.3f}s {cell['tokens_per_s']:8.0f} {bubble} "
              f"{cell['per_rank'][0]['peak_rss_above_start_bytes'] / 2**20:9.1f}Mi")  # fmt: skip
    print("goals:", json.dumps(report["goals"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out, json.dumps(report, indent=2) + "\n")
    _plot(cells, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
