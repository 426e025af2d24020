"""Tokens/s and peak memory per rank for every strategy at 1 and 2 ranks on this CPU; weak scaling 1 → 2 ranks.

Each cell is a real `gaudi3 train` launch (2 ranks through the elastic launcher, gloo). Weak scaling keeps the
micro-batch per rank fixed, so 2 ranks process twice the global batch; threads per rank are fixed too (default
1, so 2 ranks use the machine's 2 cores and 1 rank uses one). Efficiency = tokens/s(2 ranks) / (2 × tokens/s(1)).

Three settings:
* `throughput`: shakespeare-char (the default run's shape), 12 sequences per rank, one micro-batch per step;
* `large_batch`: the same with 4 micro-batches accumulated per optimizer step (gradients are reduced once per
  step: DDP skips the all-reduce on the first three, DeepSpeed reduces at the boundary);
* `memory`: GPT-2-124M's 12 × 768 shape on a 65-character vocabulary and context 128, one sequence per rank, so
  parameters, gradients and AdamW state dominate the peak and the ZeRO stages show. Peak memory is peak RSS; these
  cells run with MALLOC_MMAP_THRESHOLD_=131072 so that glibc returns freed tensors to the OS at once instead of
  keeping them in its heap, which makes peak RSS track peak live tensors.

    python benchmarks/bench_strategies.py     # writes benchmarks/results/strategies_cpu.json and .png
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.progress import track

from gaudi3_scale.bench.result import write_json_atomic
from gaudi3_scale.monitor.environment import environment_info

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_args import positive_int

STRATEGIES = ["ddp", "fsdp_grad_op", "fsdp", "deepspeed_zero2", "deepspeed_zero3"]
MODELS: dict[str, list[str]] = {
    "throughput": ["--model.name", "shakespeare-char"],
    "large_batch": ["--model.name", "shakespeare-char"],
    "memory": ["--model.name", "gpt2-124m", "--model.vocab_size", "65", "--model.context_length", "128"],
}
SETTINGS = {
    "throughput": {"micro": 12, "accumulation": 1, "steps": 80},
    "large_batch": {"micro": 12, "accumulation": 4, "steps": 24},
    "memory": {"micro": 1, "accumulation": 1, "steps": 4},
}


def _cell(
    out: Path,
    model: str,
    strategy: str,
    ranks: int,
    *,
    micro: int,
    accumulation: int,
    steps: int,
    threads: int,
) -> dict:
    args = [
        sys.executable,
        "-m",
        "gaudi3_scale.cli",
        "train",
        "--out",
        str(out),
        *MODELS[model],
        "--parallel.strategy",
        strategy,
        "--train.global_batch_size",
        str(micro * accumulation * ranks),
        "--train.micro_batch_size",
        str(micro),
        "--train.max_steps",
        str(steps),
        "--train.val_every_steps",
        "0",
        "--checkpoint.every_steps",
        "0",
        "--train.log_every_steps",
        str(max(1, steps // 4)),
        "--train.threads",
        str(threads),
        "--sample-tokens",
        "0",
        "--no-progress",
        "--train.resume",
        "never",
    ]
    if ranks > 1:
        args += ["--nproc-per-node", str(ranks)]  # fmt: skip
    env = dict(os.environ)
    if model == "memory":
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    proc = subprocess.run(args, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {
            "error": proc.stderr.strip().splitlines()[-1]
            if proc.stderr.strip()
            else f"exit {proc.returncode}"
        }
    records = [
        json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "train_loss" in line
    ]
    steady = records[1:] or records  # the first window holds warm-up
    tokens_per_s = sum(r["tokens_per_s"] for r in steady) / len(steady)
    return {
        "tokens_per_s": tokens_per_s,
        "peak_memory_bytes_per_rank": records[-1]["peak_memory_bytes_per_rank"],
        "final_train_loss": records[-1]["train_loss"],
    }


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("throughput", "tokens/s, 1 micro-batch per step", "tokens/s"),
              ("large_batch", "tokens/s, 4 micro-batches per step", "tokens/s"),
              ("memory", "peak memory per rank (GPT-2-124M shape)", "GiB (peak RSS)")]  # fmt: skip
    fig, axes = plt.subplots(1, len(panels), figsize=(16, 4.5), dpi=110)
    cells = report["cells"]
    for ax, (setting, title, unit) in zip(axes, panels, strict=True):
        for ranks, offset in ((1, -0.2), (2, 0.2)):
            row = [cells[setting][s][str(ranks)] for s in STRATEGIES]
            if setting == "memory":
                values = [max(c.get("peak_memory_bytes_per_rank", [0])) / 2**30 for c in row]
            else:
                values = [c.get("tokens_per_s", 0) for c in row]
            ax.bar([i + offset for i in range(len(STRATEGIES))], values, width=0.4, label=f"{ranks} rank(s)")
        ax.set_xticks(range(len(STRATEGIES)), [s.replace("deepspeed_", "ds_") for s in STRATEGIES])
        ax.set_title(title)
        ax.set_ylabel(unit)
        ax.legend()
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=positive_int, default=1, help="intra-op threads per rank")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "strategies_cpu.json")
    args = parser.parse_args()
    plan = [(model, s, ranks) for model in MODELS for s in STRATEGIES for ranks in (1, 2)]
    cells: dict[str, dict[str, dict[str, Any]]] = {m: {s: {} for s in STRATEGIES} for m in MODELS}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (model, strategy, ranks) in enumerate(track(plan, description="strategy × ranks")):
            out = Path(tmp) / str(i)
            cells[model][strategy][str(ranks)] = _cell(out, model, strategy, ranks, threads=args.threads,
                                                       **SETTINGS[model])  # fmt: skip
    report: dict[str, Any] = {"benchmark": "strategies_cpu", "machine": environment_info(),
                              "threads_per_rank": args.threads, "settings": SETTINGS, "cells": cells,
                              "weak_scaling_efficiency": {"throughput": {}, "large_batch": {}}}  # fmt: skip
    for setting, efficiency in report["weak_scaling_efficiency"].items():
        for strategy in STRATEGIES:
            one, two = cells[setting][strategy]["1"], cells[setting][strategy]["2"]
            if "tokens_per_s" in one and "tokens_per_s" in two:
                efficiency[strategy] = two["tokens_per_s"] / (2 * one["tokens_per_s"])
    for strategy in STRATEGIES:
        for ranks in ("1", "2"):
            row = {setting: cells[setting][strategy][ranks] for setting in MODELS}
            peak = max(row["memory"].get("peak_memory_bytes_per_rank", [0])) / 2**30
            errors = " ".join(c["error"] for c in row.values() if "error" in c)
            print(f"{strategy:15s} {ranks} rank(s): {row['throughput'].get('tokens_per_s', 0):9,.0f} tok/s   "
                  f"{row['large_batch'].get('tokens_per_s', 0):9,.0f} tok/s (×4 accumulation)   "
                  f"peak/rank {peak:5.2f} GiB   {errors}")  # fmt: skip
    for setting, efficiency in report["weak_scaling_efficiency"].items():
        print(f"weak scaling 1 → 2 ranks ({setting}):", {k: round(v, 3) for k, v in efficiency.items()})
    write_json_atomic(args.out, report)
    _plot(report, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
