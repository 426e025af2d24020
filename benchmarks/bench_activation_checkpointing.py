"""Peak memory and step time with and without activation checkpointing (`MemoryOptimizer`), side by side.

Each case runs in a fresh process (so peak RSS is its own): a model where activations dominate, trained for a few
AdamW steps on random tokens at one thread, measured three ways:

* `peak_alloc_bytes`: the highest net allocation during one forward + backward (GaudiProfiler's memory events,
  counted from the start of the step, so weights and optimizer state already allocated are not in it);
* `peak_rss_bytes`: the process's peak resident set size after all steps (MALLOC_MMAP_THRESHOLD_=131072, so freed
  tensors go back to the OS at once and RSS tracks live tensors);
* `step_time_s`: median wall time of an optimizer step (the price: about one more forward per step).

    python benchmarks/bench_activation_checkpointing.py   # → benchmarks/results/activation_checkpointing_cpu.{json,png}
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"

# (model preset, overrides): nanoGPT's shakespeare-char shape and a Llama shape of the same width.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "char-6x384": ("shakespeare-char", {"num_layers": 6, "dim": 384, "num_heads": 6, "context_length": 256,
                                        "dropout": 0.0}),
    "llama-6x384": ("llama-tiny", {"dim": 384, "num_layers": 6, "num_heads": 6, "num_kv_heads": 2,
                                   "ffn_dim": 1024, "context_length": 256}),
}  # fmt: skip
MICRO_BATCHES = (8, 16, 32)
STEPS = 4  # the first is a warmup and not timed


def _case(model_name: str, micro_batch: int, checkpointing: bool) -> dict[str, Any]:
    """One case in this process; returns its measurements."""
    import torch
    from torch import nn

    from gaudi3_scale.memory import MemoryOptimizer
    from gaudi3_scale.models import build_model, get_model_config
    from gaudi3_scale.models.counting import count_parameters
    from gaudi3_scale.profiler import GaudiProfiler

    torch.set_num_threads(1)
    preset, overrides = MODELS[model_name]
    cfg = replace(get_model_config(preset), **overrides).resolve_vocab(65)
    model = MemoryOptimizer(enable_gradient_checkpointing=checkpointing).optimize_model(
        build_model(cfg, seed=0)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.randint(
        0, 65, (micro_batch, cfg.context_length + 1), generator=torch.Generator().manual_seed(0)
    )

    def step() -> None:
        logits = model(data[:, :-1])
        nn.functional.cross_entropy(logits.flatten(0, 1), data[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = []
    for i in range(STEPS):
        start = time.perf_counter()
        step()
        if i:
            times.append(time.perf_counter() - start)
    with GaudiProfiler(
        activities=["cpu", "memory"], schedule_wait=0, schedule_warmup=1, schedule_active=1
    ) as prof:
        for _ in range(2):
            step()
            prof.step()
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "model": model_name,
        "parameters": count_parameters(cfg),
        "context_length": cfg.context_length,
        "micro_batch": micro_batch,
        "activation_checkpointing": checkpointing,
        "peak_alloc_bytes": prof.peak_memory_bytes(),
        "peak_rss_bytes": rss_kib * 1024,
        "step_time_s": statistics.median(times),
    }


def _run_child(model_name: str, micro_batch: int, checkpointing: bool) -> dict[str, Any]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    args = [sys.executable, __file__, "--case", model_name, str(micro_batch), str(int(checkpointing))]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(
            f"case {model_name} b{micro_batch} ckpt={checkpointing} failed:\n{proc.stderr[-2000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_key = {(r["model"], r["micro_batch"], r["activation_checkpointing"]): r for r in rows}
    out = []
    for (model, micro, ckpt), row in by_key.items():
        if ckpt:
            plain = by_key[(model, micro, False)]
            out.append({
                "model": model,
                "micro_batch": micro,
                "peak_alloc_ratio": row["peak_alloc_bytes"] / plain["peak_alloc_bytes"],
                "peak_rss_ratio": row["peak_rss_bytes"] / plain["peak_rss_bytes"],
                "step_time_ratio": row["step_time_s"] / plain["step_time_s"],
            })  # fmt: skip
    return out


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(MODELS), figsize=(5.5 * len(MODELS), 4), squeeze=False)
    for ax, model in zip(axes[0], MODELS, strict=True):
        for ckpt, style in ((False, "o-"), (True, "s--")):
            sel = [r for r in rows if r["model"] == model and r["activation_checkpointing"] == ckpt]
            label = "activation checkpointing" if ckpt else "no checkpointing"
            ax.plot(
                [r["micro_batch"] for r in sel],
                [r["peak_alloc_bytes"] / 2**20 for r in sel],
                style,
                label=label,
            )
        ax.set(title=model, xlabel="micro-batch (sequences of 256)", ylabel="peak allocation in a step (MiB)")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", nargs=3, metavar=("MODEL", "MICRO_BATCH", "CKPT"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS / "activation_checkpointing_cpu.json")
    args = parser.parse_args()
    if args.case:
        print(json.dumps(_case(args.case[0], int(args.case[1]), bool(int(args.case[2])))))
        return

    from rich.console import Console
    from rich.progress import track
    from rich.table import Table

    from gaudi3_scale.bench.result import write_json_atomic
    from gaudi3_scale.monitor.environment import environment_info

    cases = [(m, b, c) for m in MODELS for b in MICRO_BATCHES for c in (False, True)]
    rows = [_run_child(*case) for case in track(cases, description="activation checkpointing cases")]
    ratios = _ratios(rows)
    result = {
        "benchmark": "activation_checkpointing",
        "command": "python benchmarks/bench_activation_checkpointing.py",
        "machine": environment_info(),
        "steps": STEPS,
        "rows": rows,
        "ratios": ratios,
    }
    write_json_atomic(args.out, result)
    _plot(rows, args.out.with_suffix(".png"))

    table = Table(title="activation checkpointing / none (same model, micro-batch)")
    for column in (
        "model",
        "micro-batch",
        "peak alloc MiB (none → ckpt)",
        "alloc ×",
        "peak RSS ×",
        "step time ×",
    ):
        table.add_column(column)
    by_key = {(r["model"], r["micro_batch"], r["activation_checkpointing"]): r for r in rows}
    for r in ratios:
        plain, ckpt = (
            by_key[(r["model"], r["micro_batch"], False)],
            by_key[(r["model"], r["micro_batch"], True)],
        )
        table.add_row(
            r["model"],
            str(r["micro_batch"]),
            f"{plain['peak_alloc_bytes'] / 2**20:,.0f} → {ckpt['peak_alloc_bytes'] / 2**20:,.0f}",
            f"{r['peak_alloc_ratio']:.2f}",
            f"{r['peak_rss_ratio']:.2f}",
            f"{r['step_time_ratio']:.2f}",
        )
    Console().print(table)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
