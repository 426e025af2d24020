"""Signal → committed checkpoint: how long a preempted run takes from SIGTERM to a verified, committed checkpoint.

Each cell is a real `gaudi3 train` launch (2 ranks through the elastic launcher, gloo). Once a few steps are logged,
SIGTERM goes to the launcher (as Kubernetes or a spot reclaim would send it); the ranks agree at the next step
boundary, save (sharded for FSDP), commit the manifest and exit 143. The run's own summary records
`signal_to_checkpoint_s` (rank 0: from the signal to the commit, including the rest of the current step).

    python benchmarks/bench_preemption.py    # writes benchmarks/results/preemption_cpu.json and .png
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.progress import track

from gaudi3_scale.bench.result import write_json_atomic
from gaudi3_scale.checkpoint.manifest import read_manifest
from gaudi3_scale.monitor.environment import environment_info

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_args import positive_int

RESULTS = Path(__file__).parent / "results"
MODELS: dict[str, list[str]] = {
    "shakespeare-char": ["--model.name", "shakespeare-char", "--train.micro_batch_size", "4"],
    "gpt2-124m-shape": [
        "--model.name",
        "gpt2-124m",
        "--model.vocab_size",
        "65",
        "--model.context_length",
        "128",
        "--train.micro_batch_size",
        "1",
    ],
}
LAUNCHES: dict[str, list[str]] = {
    "1 process": [],
    "ddp x2": ["--nproc-per-node", "2", "--parallel.strategy", "ddp"],
    "fsdp x2": ["--nproc-per-node", "2", "--parallel.strategy", "fsdp"],
}


def _cell(out: Path, model: list[str], launch: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(out), "--no-progress",
           "--sample-tokens", "0", "--train.max_steps", "100000", "--train.val_every_steps", "0",
           "--train.log_every_steps", "1", "--checkpoint.every_steps", "0", "--train.global_batch_size", "8",
           *model, *launch]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + 600
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{cmd} ended early: {proc.communicate()[1][-2000:]}")
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=600)
    if proc.returncode != 143:
        raise RuntimeError(f"exit {proc.returncode}, expected 143: {stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    manifest = read_manifest(Path(summary["checkpoint"]))
    assert manifest is not None
    return {
        "signal_to_checkpoint_s": summary["signal_to_checkpoint_s"],
        "step_time_s": summary["step_time_s"],
        "checkpoint_bytes": sum(f["size_bytes"] for f in manifest["files"].values()),
        "checkpoint_files": len(manifest["files"]),
        "layout": manifest.get("layout"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=positive_int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "preemption_cpu.json")
    args = parser.parse_args()
    cells = [(m, launch) for m in MODELS for launch in LAUNCHES]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (model, launch) in enumerate(track(cells * args.repeats, description="preemption cells")):
            result = _cell(Path(tmp) / f"cell-{i}", MODELS[model], LAUNCHES[launch])
            rows.append({"model": model, "launch": launch, **result})
    table = []
    for model, launch in cells:
        mine = [r for r in rows if r["model"] == model and r["launch"] == launch]
        table.append({"model": model, "launch": launch, "layout": mine[0]["layout"],
                      "checkpoint_bytes": mine[0]["checkpoint_bytes"],
                      "signal_to_checkpoint_s_median": statistics.median(r["signal_to_checkpoint_s"] for r in mine),
                      "step_time_s_median": statistics.median(r["step_time_s"] for r in mine)})  # fmt: skip
    result = {"benchmark": "preemption", "command": "python benchmarks/bench_preemption.py", "cells": table,
              "runs": rows, "environment": environment_info()}  # fmt: skip
    write_json_atomic(args.out, result)
    _plot(table, args.out.with_suffix(".png"))
    for row in table:
        print(f"{row['model']:18s} {row['launch']:10s} {row['checkpoint_bytes'] / 1e6:8.1f} MB  "
              f"signal→commit {row['signal_to_checkpoint_s_median']:6.2f} s  (step {row['step_time_s_median']:.2f} s)")  # fmt: skip


def _plot(table: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r['model']}\n{r['launch']}" for r in table]
    bars = ax.bar(labels, [r["signal_to_checkpoint_s_median"] for r in table], color="#1f77b4")
    ax.bar_label(bars, fmt="%.2f s")
    ax.set_ylabel("SIGTERM → committed checkpoint (s, median)")
    ax.set_title("Preemption: signal to committed checkpoint (CPU, gloo)")
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
