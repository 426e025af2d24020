"""Training throughput of `gaudi3 train` against a minimal plain-PyTorch loop, side by side in one process.

Two comparisons, runs alternated (baseline, framework, baseline, framework, ...) so drift hits both equally:

  overhead  identical math: `gaudi3 train`'s defaults (fused AdamW, no compile) against the tightest plain loop
            (baseline_loop.py: fused AdamW, gathered batches); framework step time / loop's.
  default   the published shakespeare-char run (batch 12, 2,000 steps, lr 1e-3 cosine to 1e-4, warmup 100,
            AdamW beta2 0.99, wd 0.1, clip 1.0): gaudi3's default settings against a nanoGPT-style loop (for-loop
            AdamW, torch.stack batches); both report tokens/s and final val loss (same validation windows).

Step times on both sides are end to end: from one optimizer step's end to the next one's, data loading included.

    python benchmarks/bench_train.py                  # both, writes benchmarks/results/train_cpu.json
    python benchmarks/bench_train.py --quick          # short runs, for a smoke check
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from baseline_loop import run_baseline
from gaudi3_scale.config.core import parse_overrides
from gaudi3_scale.data import load_prepared, prepare_dataset, val_window_starts
from gaudi3_scale.monitor.environment import environment_info
from gaudi3_scale.train import GaudiTrainer, build_run_config

WARMUP_STEPS = 30  # excluded from step-time statistics (allocator, thread pool, first-touch)


class StepClock(pl.Callback):
    """Wall time of every optimizer step, end to end like the baseline loop's: from the previous step's end (or the
    start of training) to this one's, so fetching the batch and all of the loop's hooks are counted. Validation
    is not (the loop validates only after its timed steps)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._last = 0.0
        self._validation_start = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last = time.perf_counter()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._validation_start = time.perf_counter()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last += time.perf_counter() - self._validation_start

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if getattr(pl_module, "_micro_step", 0) == 0:
            now = time.perf_counter()
            self.times.append(now - self._last)
            self._last = now


def _framework(
    out: Path, steps: int, extra: list[str], val_every: int
) -> tuple[list[float], float | None, dict]:
    args = ["--out_dir", str(out), "--train.max_steps", str(steps), "--train.threads", "2",
            "--train.val_every_steps", str(val_every), "--checkpoint.every_steps", "0",
            "--train.resume", "never", *extra]  # fmt: skip
    clock = StepClock()
    summary = GaudiTrainer(
        build_run_config(None, parse_overrides(args)), progress=False, callbacks=[clock]
    ).fit()
    return clock.times, summary["val_loss"], summary


def _stats(times: list[float], tokens_per_step: int) -> dict[str, float]:
    steady = times[WARMUP_STEPS:]
    mean = statistics.fmean(steady)
    return {
        "mean_step_time_s": mean,
        "median_step_time_s": statistics.median(steady),
        "tokens_per_s": tokens_per_step / mean,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="short runs (smoke check, numbers not meaningful)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="alternating pairs per comparison")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "train_cpu.json")
    parser.add_argument("--only", choices=["overhead", "default"], help="run one comparison")
    args = parser.parse_args()
    overhead_steps = 120 if args.quick else 400
    default_steps = 150 if args.quick else 2000
    repeats = 1 if args.quick else args.repeats
    torch.set_num_threads(2)

    cfg = build_run_config()
    prepared = load_prepared(prepare_dataset(cfg.data, progress=False))
    model_cfg = cfg.model.resolve_vocab(prepared.vocab_size)
    tokens_per_step = cfg.train.global_batch_size * model_cfg.context_length
    val_starts = val_window_starts(
        len(prepared.val), model_cfg.context_length, micro_batch_size=12, max_batches=cfg.train.val_batches
    )
    # comparison → (steps, validate every, {framework variant: extra CLI overrides}, baseline loop options)
    comparisons: dict[str, tuple[int, int, dict[str, list[str]], dict[str, Any]]] = {
        "overhead": (overhead_steps, 0, {"gaudi3": []}, {}),
        "default": (
            default_steps,
            250,
            {"gaudi3": [], "gaudi3 --train.compile true": ["--train.compile", "true"]},
            # nanoGPT on a CPU: plain AdamW (it asks for fused only on CUDA; torch's CPU default is the for-loop
            # kernel) and torch.stack batches
            {"adamw": "for-loop", "batch": "stack"},
        ),
    }
    if args.only:
        comparisons = {args.only: comparisons[args.only]}
    results: dict[str, dict[str, list[dict[str, Any]]]] = {
        kind: {"baseline": [], **{name: [] for name in variants}}
        for kind, (_, _, variants, _) in comparisons.items()
    }
    total = sum(repeats * (1 + len(v)) for _, _, v, _ in comparisons.values())
    progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                        TimeRemainingColumn())  # fmt: skip
    with progress, tempfile.TemporaryDirectory() as tmp:
        task = progress.add_task("bench_train", total=total)
        for kind, (steps, val_every, variants, loop_options) in comparisons.items():
            for i in range(repeats):
                progress.update(task, description=f"{kind} #{i} baseline")
                base = run_baseline(model_cfg, prepared.train, prepared.val, steps=steps, threads=2, seed=cfg.seed,
                                    val_starts=val_starts if val_every else None, **loop_options)  # fmt: skip
                stats = _stats(base.step_times_s, tokens_per_step)
                results[kind]["baseline"].append({**stats, "val_loss": base.val_loss})
                progress.advance(task)
                for j, (name, extra) in enumerate(variants.items()):
                    progress.update(task, description=f"{kind} #{i} {name}")
                    out = Path(tmp) / f"{kind}-{i}-{j}"
                    times, val_loss, _ = _framework(out, steps, extra, val_every=val_every)
                    results[kind][name].append({**_stats(times, tokens_per_step), "val_loss": val_loss})
                    progress.advance(task)

    report: dict[str, Any] = {
        "benchmark": "train_cpu",
        "machine": environment_info(),
        "tokens_per_step": tokens_per_step,
        "warmup_steps_excluded": WARMUP_STEPS,
        "runs": results,
    }
    for kind, runs in results.items():
        base_s = statistics.median(r["mean_step_time_s"] for r in runs["baseline"])
        summary: dict[str, Any] = {
            "steps": comparisons[kind][0],
            "baseline_tokens_per_s": tokens_per_step / base_s,
            "baseline_val_loss": [r["val_loss"] for r in runs["baseline"]],
            "baseline_options": comparisons[kind][3],
        }
        print(
            f"{kind}: baseline {tokens_per_step / base_s:,.0f} tok/s, val loss {summary['baseline_val_loss']}"
        )
        for name in comparisons[kind][2]:
            f = statistics.median(r["mean_step_time_s"] for r in runs[name])
            summary[name] = {
                "tokens_per_s": tokens_per_step / f,
                "tokens_per_s_ratio_over_baseline": base_s / f,
                "step_time_ratio_over_baseline": f / base_s,
                "val_loss": [r["val_loss"] for r in runs[name]],
            }
            print(f"  {name:28s} {tokens_per_step / f:9,.0f} tok/s  x{base_s / f:.3f} tokens/s  "
                  f"step-time ratio {f / base_s:.3f}  val loss {summary[name]['val_loss']}")  # fmt: skip
        report[kind] = summary
    if not args.quick:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
