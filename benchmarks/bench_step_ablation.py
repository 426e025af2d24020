"""What each training-step option is worth on this machine: variants stepped in turn, in one process.

Every variant is the shakespeare-char model at batch 12 × 64 with its own weights and optimizer; the loop runs
one step of each variant in turn (A, B, C, A, B, C, …), so machine drift and noise hit all of them alike. Step =
batch gather, forward, cross-entropy, backward, clip, AdamW, zero_grad — what `gaudi3 train` does per step.

    python benchmarks/bench_step_ablation.py          # writes benchmarks/results/step_ablation_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.progress import track
from torch.nn.attention import SDPBackend, sdpa_kernel

from gaudi3_scale.bench.result import write_json_atomic
from gaudi3_scale.models import build_model, get_model_config
from gaudi3_scale.monitor.environment import environment_info

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_args import positive_int

BATCH, VOCAB = 12, 65


@dataclasses.dataclass
class Variant:
    name: str
    fused_adamw: bool = False
    compile: bool = False
    activation: str = "gelu"
    sdpa_math: bool = False
    bf16_autocast: bool = False

    def build(self) -> Callable[[torch.Tensor], float]:
        cfg = dataclasses.replace(
            get_model_config("shakespeare-char"), vocab_size=VOCAB, activation=self.activation
        )
        torch.manual_seed(0)
        model = build_model(cfg)
        forward = torch.compile(model) if self.compile else model
        kernel = {"fused": True} if self.fused_adamw else {}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1, **kernel)

        def step(data: torch.Tensor) -> float:
            t0 = time.perf_counter()
            starts = torch.randint(len(data) - 65, (BATCH,))
            chunk = data[starts[:, None] + torch.arange(65)]
            attention = sdpa_kernel(SDPBackend.MATH) if self.sdpa_math else contextlib.nullcontext()
            autocast = torch.autocast("cpu", torch.bfloat16, enabled=self.bf16_autocast)
            with attention, autocast:
                logits = forward(chunk[:, :-1])
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), chunk[:, 1:].reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return time.perf_counter() - t0

        return step


VARIANTS = [
    Variant("for-each AdamW (baseline)"),
    Variant("fused AdamW", fused_adamw=True),
    Variant("fused AdamW + torch.compile", fused_adamw=True, compile=True),
    Variant("fused AdamW + math SDPA", fused_adamw=True, sdpa_math=True),
    Variant("fused AdamW + bf16 autocast", fused_adamw=True, bf16_autocast=True),
    Variant("for-each AdamW + tanh GELU", activation="gelu_tanh"),
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=positive_int, default=300, help="measured steps per variant")
    parser.add_argument(
        "--warmup", type=int, default=30, help="unmeasured steps per variant (and compilation)"
    )
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "step_ablation_cpu.json"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    data = torch.randint(0, VOCAB, (200_000,), generator=torch.Generator().manual_seed(0))
    steps = [v.build() for v in VARIANTS]
    for step in steps:
        for _ in range(args.warmup):
            step(data)
    times: list[list[float]] = [[] for _ in VARIANTS]
    for _ in track(range(args.steps), description="interleaved steps"):
        for i, step in enumerate(steps):
            times[i].append(step(data))
    base = statistics.median(times[0])
    results: list[dict[str, Any]] = []
    for variant, ts in zip(VARIANTS, times, strict=True):
        median = statistics.median(ts)
        results.append(
            {**dataclasses.asdict(variant), "median_step_s": median, "speedup_over_baseline": base / median}
        )
        print(f"{variant.name:32s} {median * 1e3:7.2f} ms   x{base / median:.3f}")
    report = {"benchmark": "step_ablation_cpu", "machine": environment_info(), "args": vars(args) | {"out": str(args.out)},
              "batch": BATCH, "context_length": 64, "results": results}  # fmt: skip
    write_json_atomic(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
