"""Training throughput of `gaudi3 train` against a minimal plain-PyTorch loop, stepped in turn in one process.

The plain loop (baseline_loop.py) runs one optimizer step after every optimizer step of the framework run, inside
it (a callback), so the two alternate step by step: a noisy or drifting machine (a shared VM's step time moves by
±15 % from minute to minute) slows both alike, and the ratio is of steps taken seconds apart, not of runs taken
minutes apart. Each side's step is timed on its own: the framework's from its previous step's end to this one's
(data loading, every hook, callback and metric included; the loop's step and validation excluded), the loop's
around its `step()`.

  overhead  identical math: `gaudi3 train`'s defaults (fused AdamW, no compile) against the tightest plain loop
            (fused AdamW, gathered batches); framework step time / loop's.
  default   the published shakespeare-char run (batch 12, 2,000 steps, lr 1e-3 cosine to 1e-4, warmup 100,
            AdamW beta2 0.99, wd 0.1, clip 1.0): gaudi3's default settings against a nanoGPT-style loop (for-loop
            AdamW, torch.stack batches); both report tokens/s and final val loss (same validation windows).

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
import numpy as np
import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from baseline_loop import BaselineLoop, evaluate
from bench_args import positive_int
from gaudi3_scale.bench.result import write_json_atomic
from gaudi3_scale.config.core import parse_overrides
from gaudi3_scale.data import load_prepared, prepare_dataset, val_window_starts
from gaudi3_scale.models import ModelConfig
from gaudi3_scale.monitor.environment import environment_info
from gaudi3_scale.train import GaudiTrainer, build_run_config
from gaudi3_scale.train.step import at_step_boundary

WARMUP_STEPS = 30  # excluded from step-time statistics (allocator, thread pool, first-touch, compilation)


class InterleavedLoop(pl.Callback):
    """Times every optimizer step of the fit end to end, and after each one runs (and times) one step of `loop`.

    A framework step is measured from the end of the previous one (or the start of training) to its own end, so
    fetching the batch and all of the loop's hooks are counted; the plain loop's step and validation are not.
    """

    def __init__(self, loop: BaselineLoop, progress: Progress, task: Any) -> None:
        self.loop, self.progress, self.task = loop, progress, task
        self.framework_s: list[float] = []
        self.loop_s: list[float] = []
        self._last = 0.0
        self._validation_start = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last = time.perf_counter()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._validation_start = time.perf_counter()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last += time.perf_counter() - self._validation_start

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not at_step_boundary(pl_module):
            return  # inside gradient accumulation: the optimizer step has not happened yet
        now = time.perf_counter()
        self.framework_s.append(now - self._last)
        step = len(self.loop_s)
        t0 = time.perf_counter()
        self.loop.step(step)
        self.loop_s.append(time.perf_counter() - t0)
        self.progress.advance(self.task)
        self._last = time.perf_counter()


def _pair(
    out: Path,
    model_cfg: ModelConfig,
    data: tuple[np.ndarray, np.ndarray, np.ndarray | None],
    steps: int,
    extra: list[str],
    loop_options: dict[str, Any],
    progress: Progress,
    task: Any,
) -> dict[str, Any]:
    """One framework fit with the plain loop stepped in between its steps: both sides' step times and val loss."""
    train, val, val_starts = data
    cfg = build_run_config()
    loop = BaselineLoop(model_cfg, train, steps=steps, seed=cfg.seed, **loop_options)
    clock = InterleavedLoop(loop, progress, task)
    args = ["--out_dir", str(out), "--train.max_steps", str(steps), "--train.threads", "2",
            "--train.val_every_steps", str(250 if val_starts is not None else 0), "--checkpoint.every_steps", "0",
            "--train.resume", "never", *extra]  # fmt: skip
    summary = GaudiTrainer(
        build_run_config(None, parse_overrides(args)), progress=False, callbacks=[clock]
    ).fit()
    loop_val = evaluate(loop.model, val, val_starts, block=loop.block) if val_starts is not None else None
    return {
        "framework_step_s": clock.framework_s,
        "loop_step_s": clock.loop_s,
        "framework_val_loss": summary["val_loss"] if val_starts is not None else None,
        "loop_val_loss": loop_val,
    }


def _stats(steady: list[float], tokens_per_step: int) -> dict[str, float]:
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
    parser.add_argument(
        "--repeats", type=positive_int, default=1, help="interleaved fits per comparison and variant"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "train_cpu.json")
    parser.add_argument("--only", choices=["overhead", "default"], help="run one comparison")
    args = parser.parse_args()
    overhead_steps = 120 if args.quick else 600
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
    # comparison → (steps, validate?, {framework variant: extra CLI overrides}, plain loop options)
    comparisons: dict[str, tuple[int, bool, dict[str, list[str]], dict[str, Any]]] = {
        "overhead": (overhead_steps, False, {"gaudi3": []}, {"adamw": "fused", "batch": "gather"}),
        "default": (
            default_steps,
            True,
            {"gaudi3": [], "gaudi3 --train.compile true": ["--train.compile", "true"]},
            # nanoGPT on a CPU: plain AdamW (it asks for fused only on CUDA; torch's CPU default is the for-loop
            # kernel) and torch.stack batches
            {"adamw": "for-loop", "batch": "stack"},
        ),
    }
    if args.only:
        comparisons = {args.only: comparisons[args.only]}
    total = sum(repeats * len(v) * steps for steps, _, v, _ in comparisons.values())
    progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                        TimeRemainingColumn())  # fmt: skip
    report: dict[str, Any] = {
        "benchmark": "train_cpu",
        "method": "plain loop stepped after every framework optimizer step, in the same process (interleaved)",
        "machine": environment_info(),
        "tokens_per_step": tokens_per_step,
        "warmup_steps_excluded": WARMUP_STEPS,
    }
    with progress, tempfile.TemporaryDirectory() as tmp:
        task = progress.add_task("bench_train", total=total)
        for kind, (steps, validate, variants, loop_options) in comparisons.items():
            data = (prepared.train, prepared.val, val_starts if validate else None)
            summary: dict[str, Any] = {"steps": steps, "baseline_options": loop_options}
            for j, (name, extra) in enumerate(variants.items()):
                pairs = []
                for i in range(repeats):
                    progress.update(task, description=f"{kind}: {name} #{i} + plain loop")
                    pair = _pair(Path(tmp) / f"{kind}-{j}-{i}", model_cfg, data, steps, extra, loop_options,
                                 progress, task)  # fmt: skip
                    pairs.append(pair)
                summary[name] = _summarise(pairs, tokens_per_step)
                line = summary[name]
                print(f"{kind}: {name:28s} {line['tokens_per_s']:9,.0f} tok/s vs plain loop "
                      f"{line['baseline_tokens_per_s']:9,.0f}  x{line['tokens_per_s_ratio_over_baseline']:.3f} "
                      f"(median step-time ratio {line['median_step_time_ratio_over_baseline']:.3f})  val loss "
                      f"{line['val_loss']} vs {line['baseline_val_loss']}")  # fmt: skip
            report[kind] = summary
    if not args.quick:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        if (
            args.only and args.out.is_file()
        ):  # one comparison again: the other keeps its cells and its machine
            kept = json.loads(args.out.read_text())
            for kind in set(kept) & {"overhead", "default"} - {args.only}:
                report[kind] = kept[kind]
                report[f"{kind}_machine"] = kept.get(f"{kind}_machine", kept.get("machine"))
        write_json_atomic(args.out, report)
        print(f"wrote {args.out}")


def _summarise(pairs: list[dict[str, Any]], tokens_per_step: int) -> dict[str, Any]:
    """Both sides' statistics over the steps after warm-up, pooled over the repeats; ratios framework / loop."""
    framework = [t for p in pairs for t in p["framework_step_s"][WARMUP_STEPS:]]
    loop = [t for p in pairs for t in p["loop_step_s"][WARMUP_STEPS:]]
    f, b = _stats(framework, tokens_per_step), _stats(loop, tokens_per_step)
    return {
        "tokens_per_s": f["tokens_per_s"],
        "baseline_tokens_per_s": b["tokens_per_s"],
        "tokens_per_s_ratio_over_baseline": b["mean_step_time_s"] / f["mean_step_time_s"],
        "step_time_ratio_over_baseline": f["mean_step_time_s"] / b["mean_step_time_s"],
        "median_step_time_ratio_over_baseline": f["median_step_time_s"] / b["median_step_time_s"],
        "framework": f,
        "baseline": b,
        "val_loss": [p["framework_val_loss"] for p in pairs],
        "baseline_val_loss": [p["loop_val_loss"] for p in pairs],
        "measured_steps": len(framework),
    }


if __name__ == "__main__":
    main()
