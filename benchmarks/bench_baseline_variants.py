"""What each choice in the plain reference loop (baseline_loop.py) is worth: loop variants stepped in turn, one process.

Every variant is `BaselineLoop` on the default shakespeare-char run with its own weights and optimizer; the loop runs
one step of each variant in turn (A, B, C, A, B, C, …), so machine drift and noise hit all of them alike. Median step
time over the steps after warmup, relative to the nanoGPT-style loop (for-loop AdamW — torch's default on CPU, where
nanoGPT asks for fused only on CUDA — and torch.stack batches).

    python benchmarks/bench_baseline_variants.py      # writes benchmarks/results/baseline_variants_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.progress import track

sys.path.insert(0, str(Path(__file__).resolve().parent))

from baseline_loop import AdamWKernel, BaselineLoop, BatchPath
from bench_args import positive_int
from gaudi3_scale.bench.result import write_json_atomic
from gaudi3_scale.data import load_prepared, prepare_dataset
from gaudi3_scale.monitor.environment import environment_info
from gaudi3_scale.train import build_run_config

WARMUP_STEPS = 30
VARIANTS: dict[str, tuple[AdamWKernel, BatchPath]] = {
    "nanoGPT-style: for-loop AdamW, stack batches": ("for-loop", "stack"),
    "for-loop AdamW, gathered batches": ("for-loop", "gather"),
    "for-each AdamW, gathered batches": ("foreach", "gather"),
    "fused AdamW, stack batches": ("fused", "stack"),
    "fused AdamW, gathered batches (baseline_loop default)": ("fused", "gather"),
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=positive_int, default=300)
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "baseline_variants_cpu.json"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = build_run_config()
    prepared = load_prepared(prepare_dataset(cfg.data, progress=False))
    model_cfg = cfg.model.resolve_vocab(prepared.vocab_size)
    loops = {
        name: BaselineLoop(
            model_cfg, prepared.train, steps=args.steps, seed=cfg.seed, adamw=adamw, batch=batch
        )
        for name, (adamw, batch) in VARIANTS.items()
    }
    times: dict[str, list[float]] = {name: [] for name in loops}
    for i in track(range(args.steps), description="baseline variants"):
        for name, loop in loops.items():
            t0 = time.perf_counter()
            loop.step(i)
            times[name].append(time.perf_counter() - t0)
    reference = statistics.median(next(iter(times.values()))[WARMUP_STEPS:])
    results = {}
    for name, series in times.items():
        median = statistics.median(series[WARMUP_STEPS:])
        results[name] = {"median_step_time_s": median, "speed_vs_nanogpt_style": reference / median}
        print(f"{name:55s} {median * 1e3:7.2f} ms  x{reference / median:.3f}")
    report = {
        "benchmark": "baseline_variants_cpu",
        "machine": environment_info(),
        "steps": args.steps,
        "warmup_steps_excluded": WARMUP_STEPS,
        "variants": results,
    }
    write_json_atomic(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
