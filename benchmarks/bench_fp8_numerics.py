"""How far FP8 training's loss lands from bf16's, per torchao recipe, beside the gap between two bf16 seeds.

The goal of `train.precision fp8` is a loss within 1 % of bf16's after 200 steps. One bf16 run against one fp8 run
cannot tell a 1 % gap from seed noise, and the recipes have not all been measured on a GPU. This runs the arithmetic
on a CPU, where `torch._scaled_mm` exists too (torch ≥ 2.13, fp32 accumulation), so it needs no GPU:

  variants  bf16 autocast; fp8 through `device.float8.apply_float8` with each recipe (tensorwise, rowwise,
            rowwise_with_gw_hp), head in bf16 as the trainer's default; tensorwise with the head in fp8 as well
  seeds     every variant with each seed (initial weights and batch draws both follow it)
  loop      baseline_loop.BaselineLoop under bf16 autocast, the trainer's math: AdamW (β2 0.95, weight decay 0.1
            on matrices), clip 1.0, warmup + cosine, random windows of the bundled corpus (char tokens)
  measures  train loss as the mean of the last 20 steps (one step is noisy), and the loss on fixed validation
            windows the runs never train on; gaps are relative to bf16's mean over the seeds, and the bf16 seeds'
            own spread is the noise band

It is a proxy: a small Llama (default dim 256, 4 layers) on characters, not Llama 3.2 1B on BPE tokens, and a CPU's
_scaled_mm accumulates in fp32 where an H100's fp8 tensor cores accumulate with fewer bits. What carries over is
each recipe's rounding of activations, weights and gradients, and how big seed noise is against a 1 % goal.

    python benchmarks/bench_fp8_numerics.py                 # 200 steps, 2 seeds: JSON + PNG in benchmarks/results
    python benchmarks/bench_fp8_numerics.py --quick         # a few steps (smoke check, numbers not meaningful)
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from baseline_loop import BaselineLoop, evaluate
from bench_args import positive_int
from gaudi3_scale.bench.result import write_json_atomic
from gaudi3_scale.data import load_prepared, prepare_dataset, val_window_starts
from gaudi3_scale.device.float8 import apply_float8
from gaudi3_scale.models import ModelConfig, build_model, get_model_config
from gaudi3_scale.monitor.environment import environment_info
from gaudi3_scale.train import build_run_config

RESULTS = Path(__file__).resolve().parent / "results"
BASE = "bf16"


@dataclass(frozen=True)
class Variant:
    name: str
    fp8_recipe: str | None = None  # None: bf16 autocast alone
    fp8_head: bool = False


VARIANTS = (
    Variant(BASE),
    Variant("fp8 tensorwise", "tensorwise"),
    Variant("fp8 rowwise", "rowwise"),
    Variant("fp8 rowwise_with_gw_hp", "rowwise_with_gw_hp"),
    Variant("fp8 tensorwise + head", "tensorwise", fp8_head=True),
)


@dataclass(frozen=True, kw_only=True)
class Setup:
    steps: int
    micro_batch_size: int
    lr: float
    warmup_steps: int
    tail: int  # train loss: the mean of this many last steps
    val_batches: int


def train_one(
    variant: Variant, seed: int, cfg: ModelConfig, train: np.ndarray, val: np.ndarray, val_starts: np.ndarray,
    setup: Setup, advance: Any,
) -> dict[str, Any]:  # fmt: skip
    """One run: per-step losses, the tail mean, the validation loss and how many linears ran in fp8.

    The plain loop of `baseline_loop` (weights and batch draws from `seed`), stepped under bf16 autocast; fp8
    swaps its linears in place, and `Float8Linear` keeps their Parameters, so the loop's optimizer still holds them.
    """
    loop = BaselineLoop(cfg, train, steps=setup.steps, batch_size=setup.micro_batch_size, lr=setup.lr,
                        min_lr=setup.lr / 10, warmup=setup.warmup_steps, beta2=0.95, seed=seed)  # fmt: skip
    model = loop.model
    converted = 0
    if variant.fp8_recipe:
        converted = apply_float8(model, recipe=variant.fp8_recipe, head=variant.fp8_head)
        _cast_inputs_as_under_cuda_autocast(model)
    losses: list[float] = []
    started = time.perf_counter()
    for step in range(setup.steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loop.step(step)
        losses.append(float(loop.loss.detach()))
        if not math.isfinite(losses[-1]):
            break
        advance()
    elapsed_s = time.perf_counter() - started
    with torch.autocast("cpu", dtype=torch.bfloat16):
        val_loss = evaluate(model, val, val_starts, block=cfg.context_length)
    return {
        "variant": variant.name,
        "seed": seed,
        "fp8_linears": converted,
        "losses": losses,
        "train_loss_tail": float(np.mean(losses[-setup.tail :])),
        "val_loss": val_loss,
        "s_per_step": elapsed_s / max(1, len(losses)),
    }


def _cast_inputs_as_under_cuda_autocast(model: torch.nn.Module) -> None:
    """torchao's `Float8Linear.forward` casts its input to the autocast dtype only under CUDA's autocast (it asks
    `torch.is_autocast_enabled()`, which is CUDA's); under the CPU's its input stays fp32, so its saved input and
    bf16 output gradient differ in dtype and rowwise_with_gw_hp's high-precision weight-gradient matmul refuses
    them. Cast it here, as on a GPU, so the CPU runs the arithmetic a GPU run does."""

    def cast(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | None:
        if torch.is_autocast_enabled("cpu"):
            return (args[0].to(torch.get_autocast_dtype("cpu")), *args[1:])
        return None

    for module in model.modules():
        if type(module).__name__ == "Float8Linear":
            module.register_forward_pre_hook(cast)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per variant: mean train-tail and validation losses over the seeds and their gaps to bf16's means; bf16's
    own spread (max − min over seeds, relative to its mean) is the band a gap must clear to be more than noise.
    The paired gaps set each seed's run against bf16's run of the same seed (same weights and batches at step 0)."""
    by: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by.setdefault(run["variant"], []).append(run)
    base_train = float(np.mean([r["train_loss_tail"] for r in by[BASE]]))
    base_val = float(np.mean([r["val_loss"] for r in by[BASE]]))
    base_by_seed = {r["seed"]: r for r in by[BASE]}
    out: dict[str, Any] = {}
    for name, group in by.items():
        train = [r["train_loss_tail"] for r in group]
        val = [r["val_loss"] for r in group]
        out[name] = {
            "seeds": [r["seed"] for r in group],
            "fp8_linears": group[0]["fp8_linears"],
            "train_loss_tail_mean": float(np.mean(train)),
            "val_loss_mean": float(np.mean(val)),
            "train_relative_to_bf16": float(np.mean(train)) / base_train - 1,
            "val_relative_to_bf16": float(np.mean(val)) / base_val - 1,
            "train_seed_spread_relative": (max(train) - min(train)) / float(np.mean(train)),
            "val_seed_spread_relative": (max(val) - min(val)) / float(np.mean(val)),
            "train_paired_relative": [
                r["train_loss_tail"] / base_by_seed[r["seed"]]["train_loss_tail"] - 1 for r in group
            ],
            "val_paired_relative": [r["val_loss"] / base_by_seed[r["seed"]]["val_loss"] - 1 for r in group],
            "s_per_step": float(np.mean([r["s_per_step"] for r in group])),
        }
    return out


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), dpi=110)
    base = np.mean([r["losses"] for r in report["runs"] if r["variant"] == BASE], axis=0)
    window = max(1, report["setup"]["tail"])
    kernel = np.ones(window) / window
    for name in report["summary"]:
        curves = [r["losses"] for r in report["runs"] if r["variant"] == name]
        if any(len(c) != len(base) for c in curves):
            continue  # a run that diverged stopped early
        mean = np.mean(curves, axis=0)
        relative = np.convolve(mean, kernel, mode="valid") / np.convolve(base, kernel, mode="valid") - 1
        left.plot(np.arange(len(relative)) + window, 100 * relative, label=name)
    left.axhspan(-1, 1, color="grey", alpha=0.15, label="±1 % (the goal)")
    left.set_xlabel("step")
    left.set_ylabel(f"train loss vs bf16, % ({window}-step mean)")
    left.legend(fontsize=7)
    names = list(report["summary"])
    values = [100 * report["summary"][n]["val_relative_to_bf16"] for n in names]
    right.bar(range(len(names)), values)
    band = 100 * report["summary"][BASE]["val_seed_spread_relative"]
    right.axhspan(-band, band, color="grey", alpha=0.25, label=f"bf16 seed spread ({band:.2f} %)")
    right.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=7)
    right.set_ylabel("validation loss vs bf16, %")
    right.legend(fontsize=7)
    fig.suptitle(f"fp8 vs bf16 loss on a CPU proxy — {report['model']['summary']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _range(relative: list[float]) -> str:
    return f"{100 * min(relative):+.2f}…{100 * max(relative):+.2f}%"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="a few steps (smoke check, numbers not meaningful)"
    )
    parser.add_argument("--steps", type=positive_int, default=200)
    parser.add_argument(
        "--seeds", type=positive_int, default=2, help="seeds per variant (≥ 2 gives a noise band)"
    )
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--variants", nargs="+", choices=[v.name for v in VARIANTS], metavar="NAME",
                        help=f"some of: {', '.join(repr(v.name) for v in VARIANTS)} (bf16 always runs)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS / "fp8_numerics_cpu.json")
    args = parser.parse_args()
    if args.seeds < 1 or args.steps < 1 or args.dim % 16 or args.dim < 16:
        parser.error("--seeds and --steps must be ≥ 1, --dim a positive multiple of 16 (torch._scaled_mm)")
    steps = 6 if args.quick else args.steps
    setup = Setup(steps=steps, micro_batch_size=args.micro_batch_size, lr=args.lr,
                  warmup_steps=max(1, steps // 10), tail=max(1, min(20, steps // 4)),
                  val_batches=2 if args.quick else 20)  # fmt: skip
    variants = [v for v in VARIANTS if v.name == BASE or not args.variants or v.name in args.variants]
    torch.set_num_threads(min(torch.get_num_threads(), 2))

    run_cfg = build_run_config()
    prepared = load_prepared(prepare_dataset(run_cfg.data, progress=False))
    base = get_model_config("llama-tiny")
    heads = max(1, args.dim // 64)
    cfg = replace(base, dim=args.dim, num_layers=args.layers, num_heads=heads, num_kv_heads=max(1, heads // 2),
                  context_length=args.context, pad_vocab_to_multiple=16).resolve_vocab(prepared.vocab_size)  # fmt: skip
    cfg = cfg.resolve_padding("cpu")
    val_starts = val_window_starts(len(prepared.val), cfg.context_length, micro_batch_size=args.micro_batch_size,
                                   max_batches=setup.val_batches)  # fmt: skip
    seeds = list(range(args.seeds))
    runs: list[dict[str, Any]] = []
    progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                        TimeRemainingColumn())  # fmt: skip
    with progress:
        task = progress.add_task("fp8 numerics", total=len(variants) * len(seeds) * steps)
        for seed in seeds:  # seed-major: drift of the machine hits every variant alike
            for variant in variants:
                progress.update(task, description=f"{variant.name}, seed {seed}")
                runs.append(train_one(variant, seed, cfg, prepared.train, prepared.val, val_starts, setup,
                                      lambda: progress.advance(task)))  # fmt: skip
    summary = summarize(runs)
    parameters = sum(p.numel() for p in build_model(cfg).parameters())
    report = {
        "benchmark": "fp8_numerics_cpu",
        "machine": environment_info(),
        "model": {
            **asdict(cfg),
            "summary": f"Llama dim {cfg.dim}, {cfg.num_layers} layers, {parameters:,} "
            f"parameters, context {cfg.context_length}, char tokens",
        },
        "setup": asdict(setup),
        "quick": args.quick,
        "summary": summary,
        "runs": runs,
    }
    write_json_atomic(args.out, report, indent=1)
    plot(report, args.out.with_suffix(".png"))
    print(f"{'variant':26} {'fp8 lin':>7} {'train tail':>10} {'vs bf16':>8} {'val':>7} {'vs bf16':>8} "
          f"{'seed spread':>11} {'paired val gaps':>17} {'s/step':>7}")  # fmt: skip
    for name, row in summary.items():
        print(f"{name:26} {row['fp8_linears']:7d} {row['train_loss_tail_mean']:10.4f} "
              f"{100 * row['train_relative_to_bf16']:+7.2f}% {row['val_loss_mean']:7.4f} "
              f"{100 * row['val_relative_to_bf16']:+7.2f}% {100 * row['val_seed_spread_relative']:10.2f}% "
              f"{_range(row['val_paired_relative']):>17} {row['s_per_step']:7.3f}")  # fmt: skip
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
