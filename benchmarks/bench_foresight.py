"""How right `gaudi3 plan` is (issue #39's goal: with a probe, step time and peak memory within ±10 % of the
measurement on every CPU case; wall time within ±10 % for runs of ≥ 300 steps; without a probe, the error said).

Each case is a run config (overrides of the default one). For each, in this order and in one process tree so the
machine is the same: `gaudi3 plan` without a probe (a fresh calibration store: the catalog and the measured CPU
peak only), `gaudi3 plan --probe` (a short real run of the layout, stored), then the run itself (`gaudi3 train`),
whose summary.json is the measurement. The error of a quantity is predicted ÷ measured − 1. The cases: the default
run (300 steps), and a small GPT and a Llama at context 256 on one process, DDP 2 and FSDP 2, with activation
checkpointing and with accumulation.

    PYTHONPATH=src python benchmarks/bench_foresight.py                # → benchmarks/results/foresight_cpu.json + .png
    PYTHONPATH=src python benchmarks/bench_foresight.py --quick --out /tmp/f.json    # two short cases (a smoke check)
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

from rich.progress import Progress

from gaudi3_scale.bench.result import write_json_atomic
from gaudi3_scale.monitor.environment import environment_info

QUANTITIES = ("step_time_s", "peak_memory_bytes", "wall_s", "tokens_per_s")
GPT = ["--model.name", "gpt2-124m", "--model.num_layers", "4", "--model.dim", "256", "--model.num_heads", "4",
       "--model.context_length", "256", "--data.tokenizer", "char", "--model.vocab_size", "null"]  # fmt: skip
LLAMA = ["--model.name", "llama-tiny", "--model.num_layers", "4", "--model.dim", "256", "--model.num_heads", "4",
         "--model.num_kv_heads", "2", "--model.context_length", "256"]  # fmt: skip
SHORT = ["--train.max_steps", "40", "--train.global_batch_size", "8", "--train.val_batches", "4",
         "--train.val_every_steps", "20", "--checkpoint.every_steps", "20"]  # fmt: skip
TWO = ["--parallel.nproc_per_node", "2"]
CASES: dict[str, list[str]] = {
    "default-300": ["--train.max_steps", "300"],
    "gpt-1": [*GPT, *SHORT],
    "gpt-ddp2": [*GPT, *SHORT, *TWO, "--parallel.strategy", "ddp"],
    "gpt-fsdp2": [*GPT, *SHORT, *TWO, "--parallel.strategy", "fsdp"],
    "gpt-1-ckpt-accum": [*GPT, *SHORT, "--parallel.activation_checkpointing", "true", "--train.micro_batch_size", "4"],
    "llama-1": [*LLAMA, *SHORT],
    "llama-fsdp2-ckpt": [*LLAMA, *SHORT, *TWO, "--parallel.strategy", "fsdp", "--parallel.activation_checkpointing",
                         "true"],
}  # fmt: skip
QUICK = {
    "default-60": ["--train.max_steps", "60", "--train.val_every_steps", "30"],
    "ddp2-30": ["--train.max_steps", "30", *TWO, "--parallel.strategy", "ddp"],
}


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "gaudi3_scale.cli", *args], capture_output=True, text=True, env=env
    )
    if done.returncode:
        raise SystemExit(f"bench_foresight: gaudi3 {args[0]} failed:\n{done.stderr[-2000:]}")
    return done


def _errors(predicted: dict[str, Any], summary: dict[str, Any]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for quantity in QUANTITIES:
        p, m = predicted.get(f"predicted_{quantity}"), summary.get(quantity)
        out[quantity] = p / m - 1 if isinstance(p, int | float) and isinstance(m, int | float) and m else None
    return out


def _case(name: str, overrides: list[str], tmp: Path) -> dict[str, Any]:
    env = {**os.environ, "GAUDI3_CACHE": str(tmp / name / "cache")}
    out = tmp / name
    _cli("plan", *overrides, "--out", str(out / "catalog.json"), env=env)
    _cli("plan", "--probe", *overrides, "--out", str(out / "probed.json"), env=env)
    _cli("train", *overrides, "--out", str(out / "run"), "--no-progress", "--sample-tokens", "0", "--resume", "never",
         env=env)  # fmt: skip
    summary = json.loads((out / "run" / "summary.json").read_text())
    catalog = json.loads((out / "catalog.json").read_text())
    probed = json.loads((out / "probed.json").read_text())
    return {
        "case": name,
        "overrides": overrides,
        "steps": summary["steps"],
        "measured": {q: summary.get(q) for q in QUANTITIES},
        "catalog": {f"predicted_{q}": catalog.get(f"predicted_{q}") for q in QUANTITIES},
        "probed": {f"predicted_{q}": probed.get(f"predicted_{q}") for q in QUANTITIES},
        "error_catalog": _errors(catalog, summary),
        "error_probed": _errors(probed, summary),
        "compute_source_catalog": catalog["step"]["compute_s"]["source"],
    }


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(QUANTITIES), figsize=(14, 3.8), dpi=110)
    for ax, quantity in zip(axes, QUANTITIES, strict=True):
        for mode, marker in (("catalog", "x"), ("probed", "o")):
            points = [(c["measured"][quantity], c[mode][f"predicted_{quantity}"]) for c in result["cases"]
                      if c["measured"][quantity] and c[mode][f"predicted_{quantity}"]]  # fmt: skip
            if points:
                ax.scatter(*zip(*points, strict=True), marker=marker, label="with a probe" if mode == "probed" else
                           "catalog only")  # fmt: skip
        values = [v for c in result["cases"] for v in (c["measured"][quantity],) if v]
        if values:
            low, high = min(values) * 0.5, max(values) * 2
            ax.plot([low, high], [low, high], color="grey", linewidth=0.8)
            ax.fill_between(
                [low, high], [low * 0.9, high * 0.9], [low * 1.1, high * 1.1], color="green", alpha=0.1
            )
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.set_title(quantity, fontsize=9)
        ax.set_xlabel("measured")
        ax.set_ylabel("predicted")
    axes[0].legend(fontsize=7)
    fig.suptitle("gaudi3 plan: predicted vs measured (green: ±10 %)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="two short cases (a smoke check)")
    parser.add_argument("--cases", nargs="*", help="only these cases (by name)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/foresight_cpu.json"))
    args = parser.parse_args()
    cases = QUICK if args.quick else CASES
    chosen = {k: v for k, v in cases.items() if not args.cases or k in args.cases}
    rows = []
    with tempfile.TemporaryDirectory() as tmp, Progress(*Progress.get_default_columns()) as progress:
        task = progress.add_task("cases (plan, probe, run)", total=len(chosen))
        for name, overrides in chosen.items():
            rows.append(_case(name, overrides, Path(tmp)))
            progress.advance(task)
    command = "PYTHONPATH=src python benchmarks/bench_foresight.py " + " ".join(sys.argv[1:])
    result = {
        "benchmark": "foresight",
        "command": command.strip(),
        "machine": environment_info(),
        "cases": rows,
    }
    write_json_atomic(args.out, result)
    _plot(result, args.out.with_suffix(".png"))
    for row in rows:
        shown = "  ".join(
            f"{q}: {row['error_probed'][q]:+.1%} (catalog {row['error_catalog'][q]:+.1%})"
            if row["error_probed"][q] is not None and row["error_catalog"][q] is not None
            else f"{q}: —"
            for q in QUANTITIES
        )
        print(f"{row['case']}: {shown}")
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
