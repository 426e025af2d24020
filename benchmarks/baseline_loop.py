"""The reference: a minimal plain-PyTorch training loop, written the way nanoGPT's train.py runs on a CPU.

Same model code and batch as `gaudi3 train`'s default run; batches are random windows drawn with torch.randint and
stacked (nanoGPT's get_batch), AdamW with nanoGPT's choice of kernel (fused only on CUDA, so the default for-each
kernel on CPU), gradient clipping, warmup + cosine LR set by hand each step, no torch.compile (nanoGPT's CPU
command passes --compile=False). It is the baseline the training benchmark divides by.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from gaudi3_scale.models import ModelConfig, build_model

__all__ = ["BaselineResult", "run_baseline"]


@dataclass
class BaselineResult:
    step_times_s: list[float]
    val_loss: float | None
    final_train_loss: float


def _lr(step: int, *, lr: float, min_lr: float, warmup: int, max_steps: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def run_baseline(
    cfg: ModelConfig,
    train: np.ndarray,
    val: np.ndarray,
    *,
    steps: int,
    batch_size: int = 12,
    lr: float = 1e-3,
    min_lr: float = 1e-4,
    warmup: int = 100,
    weight_decay: float = 0.1,
    beta2: float = 0.99,
    clip: float = 1.0,
    seed: int = 1337,
    val_starts: np.ndarray | None = None,
    threads: int | None = None,
    fused_adamw: bool = False,
) -> BaselineResult:
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    model = build_model(cfg)
    block = cfg.context_length
    train_t = torch.from_numpy(train.astype(np.int64))
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    kernel = {"fused": True} if fused_adamw else {}
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, beta2), **kernel)

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(train_t) - block - 1, (batch_size,))
        x = torch.stack([train_t[i : i + block] for i in ix])
        y = torch.stack([train_t[i + 1 : i + 1 + block] for i in ix])
        return x, y

    times: list[float] = []
    loss = torch.zeros(())
    model.train()
    for step in range(steps):
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = _lr(step, lr=lr, min_lr=min_lr, warmup=warmup, max_steps=steps)
        x, y = get_batch()
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    val_loss = _evaluate(model, val, val_starts, block=block) if val_starts is not None else None
    return BaselineResult(step_times_s=times, val_loss=val_loss, final_train_loss=float(loss.detach()))


@torch.no_grad()
def _evaluate(model: torch.nn.Module, val: np.ndarray, starts: np.ndarray, *, block: int) -> float:
    """Mean loss over the given [batches, micro] window offsets: the set `gaudi3 train` validates on."""
    model.eval()
    val_t = torch.from_numpy(val.astype(np.int64))
    losses = []
    for batch in starts:
        chunk = val_t[torch.from_numpy(batch)[:, None] + torch.arange(block + 1)]
        logits = model(chunk[:, :-1])
        losses.append(float(F.cross_entropy(logits.view(-1, logits.size(-1)), chunk[:, 1:].reshape(-1))))
    model.train()
    return float(np.mean(losses))
