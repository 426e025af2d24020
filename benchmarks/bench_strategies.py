"""Tokens/s and peak memory per rank for every strategy at 1 and 2 ranks on this CPU; weak scaling 1 → 2 ranks.

Each cell is a real `gaudi3 train` launch (2 ranks through the elastic launcher, gloo). Weak scaling keeps the
micro-batch per rank fixed, so 2 ranks process twice the global batch; threads per rank are fixed too (default
1, so 2 ranks use the machine's 2 cores and 1 rank uses one). Efficiency = tokens/s(2 ranks) / (2 × tokens/s(1)).

Two models: `throughput` is shakespeare-char (the default run's shape); `memory` is GPT-2-124M's 12 × 768 shape on
a 65-character vocabulary and context 128, big enough that parameters, gradients and AdamW state dominate the
peak, so the ZeRO stages show (DDP > ZeRO-2 style > ZeRO-3).

    python benchmarks/bench_strategies.py     # writes benchmarks/results/strategies_cpu.json and .png
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.progress import track

from gaudi3_scale.monitor.environment import environment_info

STRATEGIES = ["ddp", "fsdp_grad_op", "fsdp"]
MODELS: dict[str, list[str]] = {
    "throughput": ["--model.name", "shakespeare-char"],
    "memory": ["--model.name", "gpt2-124m", "--model.vocab_size", "65", "--model.context_length", "128"],
}


def _cell(out: Path, model: str, strategy: str, ranks: int, *, micro: int, steps: int, threads: int) -> dict:
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
        str(micro * ranks),
        "--train.micro_batch_size",
        str(micro),
        "--train.max_steps",
        str(steps),
        "--train.val_every_steps",
        "0",
        "--train.checkpoint_every_steps",
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
    proc = subprocess.run(args, capture_output=True, text=True)
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

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4), dpi=110)
    cells = report["cells"]
    for ranks, offset in ((1, -0.2), (2, 0.2)):
        values = [cells["throughput"][s][str(ranks)].get("tokens_per_s", 0) for s in STRATEGIES]
        ax1.bar([i + offset for i in range(len(STRATEGIES))], values, width=0.4, label=f"{ranks} rank(s)")
        peaks = [
            max(cells["memory"][s][str(ranks)].get("peak_memory_bytes_per_rank", [0])) / 2**30
            for s in STRATEGIES
        ]
        ax2.bar([i + offset for i in range(len(STRATEGIES))], peaks, width=0.4, label=f"{ranks} rank(s)")
    for ax, title, unit in ((ax1, "throughput (shakespeare-char)", "tokens/s"),
                            (ax2, "peak memory per rank (GPT-2-124M shape)", "GiB (peak RSS)")):  # fmt: skip
        ax.set_xticks(range(len(STRATEGIES)), STRATEGIES)
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
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "strategies_cpu.json")
    args = parser.parse_args()
    plan = [(model, s, ranks) for model in MODELS for s in STRATEGIES for ranks in (1, 2)]
    settings = {"throughput": {"micro": 12, "steps": 120}, "memory": {"micro": 2, "steps": 6}}
    cells: dict[str, dict[str, dict[str, Any]]] = {m: {s: {} for s in STRATEGIES} for m in MODELS}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (model, strategy, ranks) in enumerate(track(plan, description="strategy × ranks")):
            out = Path(tmp) / str(i)
            cells[model][strategy][str(ranks)] = _cell(out, model, strategy, ranks, threads=args.threads,
                                                       **settings[model])  # fmt: skip
    report: dict[str, Any] = {"benchmark": "strategies_cpu", "machine": environment_info(),
                              "threads_per_rank": args.threads, "settings": settings, "cells": cells,
                              "weak_scaling_efficiency": {}}  # fmt: skip
    for strategy in STRATEGIES:
        one, two = cells["throughput"][strategy]["1"], cells["throughput"][strategy]["2"]
        if "tokens_per_s" in one and "tokens_per_s" in two:
            report["weak_scaling_efficiency"][strategy] = two["tokens_per_s"] / (2 * one["tokens_per_s"])
        for ranks in ("1", "2"):
            t, m = cells["throughput"][strategy][ranks], cells["memory"][strategy][ranks]
            peak = max(m.get("peak_memory_bytes_per_rank", [0])) / 2**30
            print(f"{strategy:13s} {ranks} rank(s): {t.get('tokens_per_s', 0):9,.0f} tok/s   "
                  f"peak/rank {peak:5.2f} GiB   {t.get('error', '')}{m.get('error', '')}")  # fmt: skip
    print("weak scaling 1 → 2 ranks:", {k: round(v, 3) for k, v in report["weak_scaling_efficiency"].items()})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    _plot(report, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
