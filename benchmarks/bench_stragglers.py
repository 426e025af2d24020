"""How soon a straggler is named (issue #38's goal: within 3 logging windows), and at what slowdown.

Each cell is a fresh 2-rank `gaudi3 train` (DDP, gloo, the default model with one layer) in which rank 1 sleeps
`delay` seconds before each forward from data step `--onset` on (`GAUDI3_INJECT_FAULTS`, test-only); a delay of 0
is the control, which must name nobody. A window is `--log-every` steps. For each cell the JSON has every window's
compute per rank, rank 1's ratio to the median, the step it was named at and how many windows after the onset
that is. Delays too small to pass `health.straggler_threshold` (0.2 over the median; on 2 ranks, 1.5× the other
rank) are expected never to be named.

    PYTHONPATH=src python benchmarks/bench_stragglers.py        # → benchmarks/results/stragglers_cpu.json + .png
    PYTHONPATH=src python benchmarks/bench_stragglers.py --delays 0.05 --steps 30 --out /tmp/s.json   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from gaudi3_scale.bench.result import write_json_atomic
from gaudi3_scale.monitor.environment import environment_info

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_args import positive_int


def _cell(delay: float, *, steps: int, onset: int, log_every: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        env = {
            **os.environ,
            "GAUDI3_INJECT_FAULTS": f"sleep:rank=1:step={onset}:seconds={delay}" if delay else "",
        }
        command = [sys.executable, "-m", "gaudi3_scale.cli", "train", f"--out={out}", "--no-progress",
                   "--sample-tokens=0", f"--train.max_steps={steps}", f"--train.log_every_steps={log_every}",
                   "--train.val_every_steps=0", "--checkpoint.enabled=false", "--parallel.nproc_per_node=2",
                   "--model.num_layers=1", "--train.threads=1", "--train.global_batch_size=4",
                   "--train.micro_batch_size=2"]  # fmt: skip
        proc = subprocess.run(command, capture_output=True, text=True, env=env)
        if proc.returncode:
            raise SystemExit(f"bench_stragglers: a run failed:\n{proc.stderr[-2000:]}")
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    windows = []
    for r in records:
        if "compute_s_per_rank" in r:
            compute = r["compute_s_per_rank"]
            median = statistics.median(compute)  # over all ranks, as health.stragglers takes it
            windows.append({"step": r["step"], "compute_s_per_rank": compute, "rank1_over_median": compute[1] / median,
                            "stragglers": r.get("stragglers", [])})  # fmt: skip
    named = [w["step"] for w in windows if 1 in w["stragglers"]]
    first = named[0] if named else None
    return {
        "delay_s": delay,
        "windows": windows,
        "named_at_step": first,
        "detection_windows": None if first is None or not delay else -(-(first - onset) // log_every),
        "false_positive": any(w["stragglers"] for w in windows if not delay or w["step"] <= onset),
    }


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=110)
    for cell in result["cells"]:
        steps = [w["step"] for w in cell["windows"]]
        label = f"delay {cell['delay_s'] * 1000:g} ms: " + (
            f"named after {cell['detection_windows']} windows" if cell["named_at_step"] else "not named"
        )
        ax.plot(
            steps, [w["rank1_over_median"] for w in cell["windows"]], marker="o", markersize=3, label=label
        )
    ax.axhline(1.2, color="red", linewidth=0.8, linestyle="--", label="threshold (1.2 × median)")
    ax.axvline(result["onset_step"], color="grey", linewidth=0.8)
    ax.set_xlabel("step (window end)")
    ax.set_ylabel("rank 1's compute / median")
    ax.set_title("Straggler detection, 2 ranks, rank 1 slowed from the grey line")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--delays", type=float, nargs="+", default=[0.0, 0.0005, 0.002, 0.005, 0.05],
                        help="seconds rank 1 sleeps before each forward (0: the control)")  # fmt: skip
    parser.add_argument("--steps", type=positive_int, default=60, help="optimizer steps per run")
    parser.add_argument("--onset", type=int, default=10, help="the data step the slowdown starts at")
    parser.add_argument("--log-every", type=int, default=5, help="train.log_every_steps: steps per window")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/stragglers_cpu.json"))
    args = parser.parse_args()
    cells = []
    for delay in args.delays:
        cells.append(_cell(delay, steps=args.steps, onset=args.onset, log_every=args.log_every))
        cell = cells[-1]
        named = f"named after {cell['detection_windows']} windows" if cell["named_at_step"] else "not named"
        print(f"delay {delay * 1000:g} ms: {named}; false positive: {cell['false_positive']}", flush=True)
    command = "PYTHONPATH=src python benchmarks/bench_stragglers.py " + " ".join(sys.argv[1:])
    result = {"benchmark": "straggler_detection", "command": command.strip(), "machine": environment_info(),
              "onset_step": args.onset, "log_every_steps": args.log_every, "cells": cells}  # fmt: skip
    write_json_atomic(args.out, result)
    _plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
