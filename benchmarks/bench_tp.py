"""What tensor parallel costs: tokens/s (and MFU) of TP=2 against FSDP on the same 2 ranks, and one process.

Every cell is a real `gaudi3 train` launch on the same Llama shape, the same global batch and the same number of
steps: `single` (one process with one rank's threads: the scaling reference), `fsdp` (2 data-parallel ranks, each
half the batch), `tp2` (one tensor-parallel pair; both ranks compute on the whole batch, each with half the heads
and MLP columns, and talk twice per block in forward and twice in backward). Cells run interleaved, `--repeats`
times, and each cell's fastest run is kept: this machine's cores are shared, and other work only ever slows a run
down. On CPU with gloo every TP collective is a socket round trip, so expect TP to lose there; the question this
answers on a GPU node (NCCL, NVLink) is how close TP=2 comes to FSDP's MFU.

`--out` defaults to results/tp_<device>.json. A run in which a cell never ran does not replace a results file
whose cells all ran: it goes to `<out stem>.failed.json` beside it (said on stderr, exit 1).

    PYTHONPATH=src python benchmarks/bench_tp.py                      # CPU/gloo → benchmarks/results/tp_cpu.json
    PYTHONPATH=src python benchmarks/bench_tp.py --device cuda --micro 4 --out benchmarks/results/tp_cuda.json \\
        --model-args "--model.name=llama3.2-1b --model.context_length=2048"      # 2 GPUs, NCCL, bf16-mixed
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.progress import track

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_args import positive_int
from gaudi3_scale.bench.result import load_stored_results, write_json_atomic
from gaudi3_scale.monitor.environment import environment_info

RESULTS = Path(__file__).resolve().parent / "results"


def default_out(device: str) -> Path:
    """Each device its own file: a CUDA run never lands in the CPU results."""
    return RESULTS / f"tp_{device}.json"


# A Llama block wide enough that matmuls, not the framework, dominate a CPU step; heads, kv heads, ffn and the
# context all split over 2. The vocabulary is the 65-character Tiny Shakespeare one, padded to 66 rows.
MODEL_ARGS = ("--model.name=llama-tiny --model.num_layers=4 --model.dim=256 --model.num_heads=8 "
              "--model.num_kv_heads=4 --model.ffn_dim=768 --model.context_length=256")  # fmt: skip
CELLS: dict[str, tuple[int, list[str]]] = {  # name: (ranks, overrides)
    "single": (1, []),
    "fsdp": (2, ["--parallel.strategy=fsdp"]),
    "tp2": (2, ["--parallel.tp_size=2"]),
}


def _cell(out: Path, name: str, args: argparse.Namespace) -> dict[str, Any]:
    ranks, overrides = CELLS[name]
    command = [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(out),
               *shlex.split(args.model_args), *overrides,
               f"--train.device={args.device}", f"--train.global_batch_size={args.micro * 2}",
               f"--train.max_steps={args.steps}", f"--train.log_every_steps={max(1, args.steps // 4)}",
               "--train.val_every_steps=0", "--checkpoint.every_steps=0", f"--train.threads={args.threads}",
               "--train.resume=never", "--sample-tokens=0", "--no-progress"]  # fmt: skip
    if args.device == "cpu":  # the same 66 vocabulary rows in every cell (TP=2 pads the 65 to split them)
        command.append("--model.pad_vocab_to_multiple=2")
    if ranks > 1:
        command += ["--nproc-per-node", str(ranks)]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        return {"error": lines[-1] if lines else f"exit {proc.returncode}"}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
               if "train_loss" in line]  # fmt: skip
    steady = records[1:] or records  # the first window holds warm-up
    return {
        "tokens_per_s": statistics.mean(r["tokens_per_s"] for r in steady),
        "mfu": statistics.mean(r["mfu"] for r in steady) if steady[0].get("mfu") is not None else None,
        "peak_memory_bytes_per_rank": records[-1]["peak_memory_bytes_per_rank"],
        "final_train_loss": records[-1]["train_loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu", help="train.device: cpu (gloo) or cuda (NCCL)")
    parser.add_argument("--model-args", default=MODEL_ARGS, help="model overrides for gaudi3 train")
    parser.add_argument(
        "--micro", type=positive_int, default=4, help="sequences per FSDP rank; global batch = 2 × micro"
    )
    parser.add_argument("--steps", type=positive_int, default=12)
    parser.add_argument("--threads", type=positive_int, default=1, help="intra-op threads per rank")
    parser.add_argument("--repeats", type=positive_int, default=2)
    parser.add_argument("--out", type=Path, help="result JSON (default results/tp_<device>.json)")
    args = parser.parse_args()
    args.out = args.out or default_out(args.device)
    try:
        stored = load_stored_results(args.out, {})
    except ValueError as err:
        parser.error(str(err))
    plan = [name for _ in range(args.repeats) for name in CELLS]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CELLS}
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(track(plan, description="single / fsdp / tp2")):
            runs[name].append(_cell(Path(tmp) / str(i), name, args))
    cells: dict[str, Any] = {}
    for name, results in runs.items():
        ok = [r for r in results if "error" not in r]
        best = max(ok, key=lambda r: r["tokens_per_s"]) if ok else results[0]
        cells[name] = {**best, "tokens_per_s_runs": [r.get("tokens_per_s") for r in results]}
    report: dict[str, Any] = {
        "benchmark": "tp_cpu" if args.device == "cpu" else f"tp_{args.device}",
        "machine": environment_info(),
        "command": " ".join(["python", "benchmarks/bench_tp.py", *sys.argv[1:]]),
        "settings": {"model_args": args.model_args, "global_batch_size": args.micro * 2, "steps": args.steps,
                     "threads_per_rank": args.threads, "repeats": args.repeats, "device": args.device},
        "cells": cells,
    }  # fmt: skip
    if all("tokens_per_s" in cells[name] for name in ("fsdp", "tp2")):
        report["tp2_over_fsdp"] = cells["tp2"]["tokens_per_s"] / cells["fsdp"]["tokens_per_s"]
    for name, cell in cells.items():
        print(f"{name:7s} {cell.get('tokens_per_s', 0):9,.0f} tok/s  mfu {cell.get('mfu') or 0:.4f}  "
              f"runs {cell['tokens_per_s_runs']}  {cell.get('error', '')}")  # fmt: skip
    print("TP=2 / FSDP tokens/s:", round(report.get("tp2_over_fsdp", 0.0), 3))
    if not _all_ran(report) and _all_ran(stored):
        failed_out = args.out.with_name(f"{args.out.stem}.failed.json")
        write_json_atomic(failed_out, report)
        print(f"kept {args.out}: a cell of this run never ran; this run is in {failed_out}", file=sys.stderr)
        sys.exit(1)
    write_json_atomic(args.out, report)
    print(f"wrote {args.out}")


def _all_ran(report: dict[str, Any]) -> bool:
    cells = report.get("cells") or {}
    return bool(cells) and all("tokens_per_s" in cell for cell in cells.values())


if __name__ == "__main__":
    main()
