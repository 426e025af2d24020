"""Forward+backward step time of one model, eager vs torch.compile, measured side by side in one process.

    python benchmarks/bench_model_step.py --model shakespeare-char --batch 12 --seq-len 64 --threads 2 \
        --out benchmarks/results/model_step.json

Prints one JSON object (machine info, compile time, median step times, the eager/compiled ratio). Step = forward,
cross-entropy, backward (no optimizer), the part the model code owns.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from gaudi3_scale.bench.result import write_json_atomic
from gaudi3_scale.models import build_model, get_model_config
from gaudi3_scale.monitor.environment import environment_info

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_args import positive_int


def _step_fn(model: torch.nn.Module, vocab: int) -> Callable[[torch.Tensor, torch.Tensor], None]:
    def step(inputs: torch.Tensor, targets: torch.Tensor) -> None:
        loss = F.cross_entropy(model(inputs).view(-1, vocab), targets.view(-1))
        loss.backward()

    return step


def _time_steps(
    step: Callable[[torch.Tensor, torch.Tensor], None], batch: tuple, warmup: int, steps: int
) -> dict:
    first_start = time.perf_counter()
    step(*batch)
    first_step_s = time.perf_counter() - first_start
    for _ in range(warmup):
        step(*batch)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step(*batch)
        times.append(time.perf_counter() - start)
    return {"first_step_s": first_step_s, "median_step_s": statistics.median(times), "min_step_s": min(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="shakespeare-char")
    parser.add_argument("--vocab-size", type=int, default=65, help="used when the preset leaves it null")
    parser.add_argument("--batch", type=positive_int, default=12)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=positive_int, default=100)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    cfg = get_model_config(args.model).resolve_vocab(args.vocab_size)
    gen = torch.Generator().manual_seed(0)
    batch = tuple(
        torch.randint(0, cfg.vocab_size or 1, (args.batch, args.seq_len), generator=gen) for _ in range(2)
    )
    vocab = cfg.padded_vocab_size
    results: dict[str, Any] = {}
    results["eager"] = _time_steps(_step_fn(build_model(cfg, seed=0), vocab), batch, args.warmup, args.steps)
    compiled = torch.compile(build_model(cfg, seed=0))
    results["compile"] = _time_steps(_step_fn(compiled, vocab), batch, args.warmup, args.steps)
    results["compile"]["compile_s"] = results["compile"]["first_step_s"] - results["eager"]["median_step_s"]
    tokens = args.batch * args.seq_len
    for r in results.values():
        r["tokens_per_s"] = tokens / r["median_step_s"]
    report = {
        "machine": environment_info(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "results": results,
        "eager_over_compiled_step_time": results["eager"]["median_step_s"]
        / results["compile"]["median_step_s"],
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        write_json_atomic(args.out, report)


if __name__ == "__main__":
    main()
