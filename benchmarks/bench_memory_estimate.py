"""The analytic memory estimate (`gaudi3_scale.tune.memory`) against measured peak RSS per rank on this CPU.

Each case is a real `gaudi3 train` run (2 ranks through the elastic launcher, gloo; 1 thread per rank) of a few
steps; its peak is the largest `peak_memory_bytes_per_rank` in metrics.jsonl (peak RSS, every rank, every step),
compared with `estimate_memory` for the resolved config the run wrote. Runs use MALLOC_MMAP_THRESHOLD_=131072 so
that glibc hands freed tensors back to the OS at once and peak RSS tracks peak live tensors (as in
bench_strategies.py). Three shapes, each stressing other terms:

* `char`: shakespeare-char at context 256 with large micro-batches: saved activations dominate (GELU MLP); with
  dropout 0.1 CPU attention falls back to the math path, which keeps the a·s² probabilities, mask and dropout;
* `gpt2`: GPT-2-124M with its 50257-token vocabulary at context 256: model states, logits and tied-embedding
  gradients dominate;
* `llama`: a 6 × 384 Llama shape (RMSNorm, RoPE, SwiGLU, 6 query / 2 kv heads), context 256: Llama activations.

The first two cases calibrate the empirical runtime baselines (a negligible model, without and with DeepSpeed); the
others are the validation, target |error| ≤ 20 %.

Pipeline cases (`--pipeline`, or `--only pp2`): PP 2 on 2 ranks (FSDP over 1 rank per stage), each schedule, an
8 × 384 Llama, micro-batch 8 × 4 micro-batches; every rank's measured peak against the estimate for its pipeline
rank (`estimate_memory(..., pp_rank=r)`; rank r is pipeline rank r: the pipeline is the outermost mesh dimension),
target ±20 % per stage.

    python benchmarks/bench_memory_estimate.py     # writes benchmarks/results/memory_estimate_cpu.json and .png
    python benchmarks/bench_memory_estimate.py --pipeline   # only the PP 2 cases: memory_estimate_pipeline_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.progress import track

from gaudi3_scale.bench.result import write_json_atomic
from gaudi3_scale.monitor.environment import environment_info
from gaudi3_scale.train.config import build_run_config
from gaudi3_scale.tune import memory
from gaudi3_scale.tune.memory import estimate_memory

MODELS: dict[str, list[str]] = {
    "tiny": ["--model.name", "shakespeare-char", "--model.context_length", "64"],
    "char": ["--model.name", "shakespeare-char", "--model.context_length", "256"],
    "char-dropout": ["--model.name", "shakespeare-char", "--model.context_length", "256", "--model.dropout", "0.1"],
    "gpt2": ["--model.name", "gpt2-124m", "--model.context_length", "256"],
    "llama": ["--model.name", "llama-tiny", "--model.dim", "384", "--model.num_layers", "6",
              "--model.num_heads", "6", "--model.num_kv_heads", "2", "--model.ffn_dim", "1024",
              "--model.context_length", "256"],
    "llama8": ["--model.name", "llama-tiny", "--model.dim", "384", "--model.num_layers", "8",
               "--model.num_heads", "6", "--model.num_kv_heads", "2", "--model.ffn_dim", "1024",
               "--model.context_length", "256"],
}  # fmt: skip

# (name, model, strategy, ranks, micro-batch, activation checkpointing, precision, steps)
CALIBRATION = [
    ("runtime", "tiny", "auto", 1, 1, False, "32-true", 4),
    ("runtime+deepspeed", "tiny", "deepspeed_zero2", 1, 1, False, "32-true", 4),
]
CASES = [
    ("char-single-b64", "char", "auto", 1, 64, False, "32-true", 3),
    ("char-single-b64-ckpt", "char", "auto", 1, 64, True, "32-true", 3),
    ("char-single-b16-dropout", "char-dropout", "auto", 1, 16, False, "32-true", 3),
    ("char-single-b32-bf16mixed", "char", "auto", 1, 32, False, "bf16-mixed", 3),
    ("char-ddp2-b32", "char", "ddp", 2, 32, False, "32-true", 3),
    ("char-fsdp2-b32-ckpt", "char", "fsdp", 2, 32, True, "32-true", 3),
    ("gpt2-single-b2", "gpt2", "auto", 1, 2, False, "32-true", 3),
    ("gpt2-ddp2-b1", "gpt2", "ddp", 2, 1, False, "32-true", 3),
    ("gpt2-fsdp2-b1", "gpt2", "fsdp", 2, 1, False, "32-true", 3),
    ("gpt2-fsdp_grad_op2-b2-ckpt", "gpt2", "fsdp_grad_op", 2, 2, True, "32-true", 3),
    ("gpt2-zero3-2-b1", "gpt2", "deepspeed_zero3", 2, 1, False, "32-true", 3),
    ("llama-single-b16", "llama", "auto", 1, 16, False, "32-true", 3),
    ("llama-single-b16-ckpt", "llama", "auto", 1, 16, True, "32-true", 3),
    ("llama-single-b8-bf16true", "llama", "auto", 1, 8, False, "bf16-true", 3),
    ("llama-ddp2-b8", "llama", "ddp", 2, 8, False, "32-true", 3),
    ("llama-fsdp2-b8-ckpt", "llama", "fsdp", 2, 8, True, "32-true", 3),
    ("llama-zero2-2-b8", "llama", "deepspeed_zero2", 2, 8, False, "32-true", 3),
]


# (name, model, schedule, micro-batch, micro-batches per step, activation checkpointing, steps): PP 2 on 2 ranks
PIPELINE_CASES = [
    ("llama8-pp2-gpipe-b8x4", "llama8", "gpipe", 8, 4, False, 3),
    ("llama8-pp2-1f1b-b8x4", "llama8", "1f1b", 8, 4, False, 3),
    ("llama8-pp2-interleaved_1f1b-b8x4", "llama8", "interleaved_1f1b", 8, 4, False, 3),
    ("llama8-pp2-zbv-b8x4", "llama8", "zbv", 8, 4, False, 3),
    ("llama8-pp2-1f1b-b16x2-ckpt", "llama8", "1f1b", 16, 2, True, 3),
]


def _train_pipeline(out: Path, case: tuple) -> list[dict[str, Any]]:
    """One PP 2 run; a row per pipeline rank."""
    name, model, schedule, micro, accumulation, ckpt, steps = case
    extra = ["--parallel.pp_size", "2", "--parallel.pp_schedule", schedule]
    plain = (name, model, "fsdp", 2, micro, ckpt, "32-true", steps)
    cell = _train(out, plain, extra=extra, global_batch_size=micro * accumulation)
    if "error" in cell:
        return [{"case": name, "schedule": schedule, **cell}]
    cfg = build_run_config(out / "config.yaml")
    rows = []
    for rank in range(2):
        estimate = estimate_memory(
            cfg.model,
            cfg.parallel_plan(),
            cfg.batch_plan(),
            precision="32-true",
            device_kind="cpu",
            pp_rank=rank,
        )
        measured = max(step[rank] for step in cell["measured_bytes_per_rank_per_step"])
        rows.append({
            "case": f"{name}-stage{rank}", "schedule": schedule, "pp_rank": rank, "micro_batch_size": micro,
            "micro_batches": accumulation, "activation_checkpointing": ckpt, "measured_bytes": measured,
            "estimate_bytes": estimate.total_bytes,
            "estimate": {**dict(estimate.rows()), "peak_phase": estimate.peak_phase,
                         "in_flight_micro_batches": estimate.in_flight_micro_batches},
            "error_pct": 100.0 * (estimate.total_bytes - measured) / measured, "wall_s": cell["wall_s"],
        })  # fmt: skip
    return rows


def _train(
    out: Path, case: tuple, *, extra: list[str] | None = None, global_batch_size: int | None = None
) -> dict[str, Any]:
    _, model, strategy, ranks, micro, ckpt, precision, steps = case
    args = [
        sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(out), *MODELS[model],
        "--parallel.strategy", strategy, "--parallel.activation_checkpointing", str(ckpt).lower(),
        "--train.precision", precision,
        "--train.global_batch_size", str(global_batch_size or micro * ranks),
        "--train.micro_batch_size", str(micro), "--train.max_steps", str(steps), "--train.val_every_steps", "0",
        "--checkpoint.every_steps", "0", "--train.log_every_steps", "1", "--train.threads", "1",
        "--sample-tokens", "0", "--no-progress", "--train.resume", "never", *(extra or []),
    ]  # fmt: skip
    if ranks > 1:
        args += ["--nproc-per-node", str(ranks)]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    started = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        return {"error": lines[-1] if lines else f"exit {proc.returncode}"}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    per_rank_per_step = [
        r["peak_memory_bytes_per_rank"] for r in records if "peak_memory_bytes_per_rank" in r
    ]
    per_step = [max(ranks) for ranks in per_rank_per_step]
    if extra:  # a pipeline run: the caller estimates each pipeline rank
        return {
            "measured_bytes_per_rank_per_step": per_rank_per_step,
            "wall_s": time.perf_counter() - started,
        }
    cfg = build_run_config(out / "config.yaml")  # the resolved config: vocabulary from the dataset
    # as the run resolved it: its strategy on `ranks` ranks, its micro-batch and activation checkpointing
    estimate = estimate_memory(
        cfg.model, cfg.parallel_plan(), cfg.batch_plan(), precision=precision, device_kind="cpu"
    )
    return {
        "measured_bytes": max(per_step),
        "measured_bytes_per_step": per_step,
        "estimate_bytes": estimate.total_bytes,
        "estimate": {**dict(estimate.rows()), "peak_phase": estimate.peak_phase},
        "wall_s": time.perf_counter() - started,
    }


def _row(case: tuple, cell: dict[str, Any]) -> dict[str, Any]:
    name, model, strategy, ranks, micro, ckpt, precision, steps = case
    row = {"case": name, "model": model, "strategy": strategy, "ranks": ranks, "micro_batch_size": micro,
           "activation_checkpointing": ckpt, "precision": precision, "steps": steps, **cell}  # fmt: skip
    if "error" not in cell:
        row["error_pct"] = 100.0 * (cell["estimate_bytes"] - cell["measured_bytes"]) / cell["measured_bytes"]
    return row


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "error_pct" in r]
    names = [r["case"] for r in rows]
    x = range(len(rows))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(13, 8), dpi=110, sharex=True)
    top.bar([i - 0.2 for i in x], [r["measured_bytes"] / 2**30 for r in rows], width=0.4, label="measured")
    top.bar([i + 0.2 for i in x], [r["estimate_bytes"] / 2**30 for r in rows], width=0.4, label="estimate")
    top.set_ylabel("GiB per rank (peak RSS)")
    top.set_title("Peak memory per rank: analytic estimate vs measured (CPU)")
    top.legend()
    top.grid(axis="y", alpha=0.3)
    bottom.bar(list(x), [r["error_pct"] for r in rows], color="tab:gray")
    bottom.axhspan(-20, 20, color="tab:green", alpha=0.12, label="±20 % target")
    bottom.axhline(0, color="black", linewidth=0.8)
    bottom.set_ylabel("estimate error, %")
    bottom.set_xticks(list(x), names, rotation=35, ha="right")
    bottom.legend()
    bottom.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", nargs="*", help="run only the cases whose name contains one of these")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "memory_estimate_cpu.json"
    )
    parser.add_argument(
        "--pipeline", action="store_true", help="only the PP 2 cases (their own results file)"
    )
    args = parser.parse_args()
    if args.pipeline:
        _main_pipeline(args.out.with_name("memory_estimate_pipeline_cpu.json"), args.only)
        return
    cases = [c for c in CASES if not args.only or any(s in c[0] for s in args.only)]
    plan = CALIBRATION + cases
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, case in enumerate(track(plan, description="memory cases")):
            rows.append(_row(case, _train(Path(tmp) / str(i), case)))
    calibration, validation = rows[: len(CALIBRATION)], rows[len(CALIBRATION) :]
    fitted = {}
    for row, constant in zip(calibration, ("CPU_RUNTIME_BYTES", "CPU_DEEPSPEED_IMPORT_BYTES"), strict=True):
        if "error" in row:
            continue
        model_bytes = row["estimate_bytes"] - row["estimate"]["runtime"]
        fitted[constant] = row["measured_bytes"] - model_bytes - sum(fitted.values())
    _print_rows(rows, width=28)
    errors = [abs(r["error_pct"]) for r in validation if "error_pct" in r]
    within = sum(e <= 20 for e in errors)
    print(
        f"validation: {within}/{len(validation)} cases within ±20 %, max |error| {max(errors, default=0):.1f} %"
    )
    for constant, value in fitted.items():
        print(
            f"calibrated {constant} = {value / 2**20:.0f} MiB (estimator uses {getattr(memory, constant) / 2**20:.0f})"
        )
    report = {
        "benchmark": "memory_estimate_cpu",
        "machine": environment_info(),
        "threads_per_rank": 1,
        "malloc_mmap_threshold": 131072,
        "calibrated_runtime_bytes": fitted,
        "estimator_runtime_bytes": {c: getattr(memory, c) for c in fitted},
        "cases_within_20_pct": within,
        "cases": len(validation),
        "max_abs_error_pct": max(errors, default=None),
        "calibration": calibration,
        "validation": validation,
    }
    write_json_atomic(args.out, report)
    _plot(validation, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def _print_rows(rows: list[dict[str, Any]], *, width: int) -> None:
    print(f"{'case':{width}s} {'estimate':>9s} {'measured':>9s} {'error':>7s}  peak at")
    for row in rows:
        if "error" in row:
            print(f"{row['case']:{width}s} failed: {row['error']}")
            continue
        print(f"{row['case']:{width}s} {row['estimate_bytes'] / 2**30:8.3f}G {row['measured_bytes'] / 2**30:8.3f}G "
              f"{row['error_pct']:+6.1f}%  {row['estimate']['peak_phase']}")  # fmt: skip


def _main_pipeline(out: Path, only: list[str] | None) -> None:
    cases = [c for c in PIPELINE_CASES if not only or any(s in c[0] for s in only)]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, case in enumerate(track(cases, description="PP 2 memory cases")):
            rows += _train_pipeline(Path(tmp) / str(i), case)
    _print_rows(rows, width=40)
    errors = [abs(r["error_pct"]) for r in rows if "error_pct" in r]
    within = sum(e <= 20 for e in errors)
    print(f"pipeline stages: {within}/{len(rows)} within ±20 %, max |error| {max(errors, default=0):.1f} %")
    report = {
        "benchmark": "memory_estimate_pipeline_cpu",
        "machine": environment_info(),
        "threads_per_rank": 1,
        "malloc_mmap_threshold": 131072,
        "stages_within_20_pct": within,
        "stages": len(rows),
        "max_abs_error_pct": max(errors, default=None),
        "validation": rows,
    }
    write_json_atomic(out, report)
    _plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
