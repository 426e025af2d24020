"""Mixture-of-experts training step vs a dense Llama with the same ACTIVE parameters, side by side in one process.

    PYTHONPATH=src python benchmarks/bench_moe.py --out benchmarks/results/moe_cpu.json

The MoE model has `--experts` SwiGLU experts of width `--expert-ffn` per block, `--top-k` per token; the dense one
is the same Llama with one MLP of width top_k × expert_ffn, so a token meets as many feed-forward weights in both
(the MoE adds its router, dim × experts per block). Step = forward, cross-entropy (+ the router losses for the MoE,
as `train.module` adds them), backward, fused AdamW step, zero_grad. The two models alternate in blocks of
`--steps` steps (order flipped each repeat), so drifting machine load hits both; the ratio of the medians is
reported, of wall-clock step time and of the process's CPU time per step. With one thread (the default) CPU time is
what the step takes on an idle core, and it is what a machine shared with other jobs still measures reliably (wall
time there includes the waits for a core). Target: MoE / dense ≤ 1.3.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench_args import positive_int
from gaudi3_scale.config.atomic import write_text_atomic
from gaudi3_scale.models import ModelConfig, build_model, count_parameters, flops_per_token, get_model_config
from gaudi3_scale.models.common.moe import moe_layers, router_losses
from gaudi3_scale.monitor.environment import environment_info
from gaudi3_scale.train.optim import build_optimizer
from gaudi3_scale.train.optim_config import OptimConfig


def _configs(args: argparse.Namespace) -> dict[str, ModelConfig]:
    base = replace(get_model_config("moe-tiny"), num_layers=args.layers, dim=args.dim, num_heads=args.heads,
                   num_kv_heads=args.heads // 2, context_length=args.seq_len, vocab_size=args.vocab)  # fmt: skip
    moe = replace(
        base, name="moe", num_experts=args.experts, experts_per_token=args.top_k, ffn_dim=args.expert_ffn
    )
    dense = replace(base, name="dense", num_experts=None, ffn_dim=args.top_k * args.expert_ffn)
    return {"moe": moe, "dense": dense}


def _step_fn(cfg: ModelConfig) -> Callable[[torch.Tensor, torch.Tensor], None]:
    model = build_model(cfg, seed=0).train()
    optimizer = build_optimizer(model, OptimConfig(), device_type="cpu")
    layers = moe_layers(model)

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> None:
        logits = model(inputs)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        if layers:
            router = router_losses(layers)
            loss = loss + cfg.moe_aux_loss_coef * router.aux + cfg.moe_z_loss_coef * router.z
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=positive_int, default=2)
    parser.add_argument("--dim", type=positive_int, default=256)
    parser.add_argument("--heads", type=positive_int, default=8)
    parser.add_argument("--experts", type=positive_int, default=8)
    parser.add_argument("--top-k", type=positive_int, default=2)
    parser.add_argument("--expert-ffn", type=positive_int, default=512)
    parser.add_argument("--vocab", type=positive_int, default=512)
    parser.add_argument("--batch", type=positive_int, default=4)
    parser.add_argument("--seq-len", type=positive_int, default=256)
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=positive_int, default=5, help="steps per timed block")
    parser.add_argument("--repeats", type=positive_int, default=6, help="blocks per model, alternating")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    if args.heads < 2:  # the model has heads // 2 key/value heads
        parser.error(f"argument --heads: must be at least 2, got {args.heads}")
    if args.warmup < 0:
        parser.error(f"argument --warmup: must be at least 0, got {args.warmup}")

    torch.set_num_threads(args.threads)
    configs = _configs(args)
    gen = torch.Generator().manual_seed(0)
    batch = tuple(torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=gen) for _ in range(2))
    steps = {name: _step_fn(cfg) for name, cfg in configs.items()}
    for step in steps.values():
        for _ in range(args.warmup):
            step(*batch)
    times: dict[str, list[float]] = {name: [] for name in steps}
    cpu_times: dict[str, list[float]] = {name: [] for name in steps}
    for repeat in range(args.repeats):
        for name in list(steps)[:: 1 if repeat % 2 == 0 else -1]:
            for _ in range(args.steps):
                start, start_cpu = time.perf_counter(), time.process_time()
                steps[name](*batch)
                cpu_times[name].append(time.process_time() - start_cpu)
                times[name].append(time.perf_counter() - start)
    results: dict[str, Any] = {}
    for name, cfg in configs.items():
        median = statistics.median(times[name])
        results[name] = {
            "ffn_dim": cfg.ffn_dim,
            "num_experts": cfg.num_experts,
            "parameters": count_parameters(cfg),
            "active_parameters": count_parameters(cfg, active=True),
            "flops_per_token": flops_per_token(cfg),
            "median_step_s": median,
            "min_step_s": min(times[name]),
            "median_step_cpu_s": statistics.median(cpu_times[name]),
            "tokens_per_s": args.batch * args.seq_len / median,
            "step_s": [round(t, 4) for t in times[name]],
            "step_cpu_s": [round(t, 4) for t in cpu_times[name]],
        }
    report = {
        "benchmark": "moe_cpu",
        "machine": environment_info(),
        "command": "PYTHONPATH=src python benchmarks/bench_moe.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "results": results,
        "moe_over_dense_step_time": results["moe"]["median_step_s"] / results["dense"]["median_step_s"],
        "moe_over_dense_step_cpu_time": results["moe"]["median_step_cpu_s"]
        / results["dense"]["median_step_cpu_s"],
        "target": 1.3,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(args.out, text + "\n")


if __name__ == "__main__":
    main()
