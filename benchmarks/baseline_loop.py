"""The reference: the tightest plain-PyTorch training loop we can write on a CPU, with `gaudi3 train`'s math.

Same model code, batch shape, AdamW settings, gradient clipping and warmup + cosine LR as `gaudi3 train`'s default
run, no torch.compile. What a careful engineer does to keep Python out of the step (each measured with callgrind
instruction counts and alternated step times, see `python benchmarks/bench_baseline_variants.py`):

- batches: random windows (nanoGPT's get_batch draws) gathered with one `index_select` into a preallocated
  [batch, T + 1] buffer; x and y are views of it, no per-row slicing and `torch.stack`;
- AdamW with the fused kernel (torch >= 2.4 has one for CPU; `adamw="foreach"` / `"for-loop"` for comparison);
- the parameter list and the learning-rate schedule computed once, not per step; `zero_grad(set_to_none=True)`.

`BaselineLoop.step(i)` runs one optimizer step, so a benchmark can interleave it step by step with a framework run
(bench_train.py steps it after each of `gaudi3 train`'s optimizer steps); `evaluate` scores it on the validation
windows `gaudi3 train` uses.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from gaudi3_scale.models import ModelConfig, build_model

__all__ = ["BaselineLoop", "evaluate"]

AdamWKernel = Literal["fused", "foreach", "for-loop"]
BatchPath = Literal["gather", "stack"]


def lr_schedule(*, steps: int, lr: float, min_lr: float, warmup: int) -> list[float]:
    """Linear warmup, then cosine to min_lr over the remaining steps (what `gaudi3 train` does by default)."""
    out = []
    for step in range(steps):
        if step < warmup:
            out.append(lr * (step + 1) / warmup)
            continue
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        out.append(min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr))
    return out


class BaselineLoop:
    """Model, optimizer and batch buffers of the plain loop; `step(i)` is one optimizer step."""

    def __init__(
        self,
        cfg: ModelConfig,
        train: np.ndarray,
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
        adamw: AdamWKernel = "fused",
        batch: BatchPath = "gather",
    ) -> None:
        torch.manual_seed(seed)
        self.model = model = build_model(cfg, seed=seed)  # the same weights gaudi3 train starts from
        # Batches draw from a generator of their own, so a loop stepped in between another run's steps draws the
        # same windows as one run alone (and leaves the global RNG to the other run).
        self.generator = torch.Generator().manual_seed(seed)
        model.train()
        block = self.block = cfg.context_length
        self.train_t = torch.from_numpy(train.astype(np.int64))
        self.params = [p for p in model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in self.params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in self.params if p.dim() < 2], "weight_decay": 0.0},
        ]
        kernel = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}
        self.opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, beta2), **kernel[adamw])
        self.lrs = lr_schedule(steps=steps, lr=lr, min_lr=min_lr, warmup=warmup)
        self.clip = clip
        self.batch_size = batch_size
        self.high = len(self.train_t) - block - 1  # nanoGPT's randint bound: window starts in [0, high)
        self._get_batch = self._gather if batch == "gather" else self._stack
        self._starts = torch.empty(batch_size, dtype=torch.int64)
        self._offsets = torch.arange(block + 1)
        self._index = torch.empty(batch_size, block + 1, dtype=torch.int64)
        self._windows = torch.empty(batch_size, block + 1, dtype=torch.int64)
        self.loss = torch.zeros(())

    def _gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        torch.randint(self.high, (self.batch_size,), out=self._starts, generator=self.generator)
        torch.add(self._starts.unsqueeze(1), self._offsets, out=self._index)
        torch.index_select(self.train_t, 0, self._index.view(-1), out=self._windows.view(-1))
        return self._windows[:, :-1], self._windows[:, 1:]  # y is not contiguous: reshaped below, not viewed

    def _stack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """nanoGPT's get_batch (train.py): one slice per row, then torch.stack; for comparison."""
        ix = torch.randint(self.high, (self.batch_size,), generator=self.generator)
        block, data = self.block, self.train_t
        x = torch.stack([data[i : i + block] for i in ix])
        y = torch.stack([data[i + 1 : i + 1 + block] for i in ix])
        return x, y

    def step(self, i: int) -> None:
        x, y = self._get_batch()
        logits = self.model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        lr = self.lrs[i]
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.loss = loss


@torch.no_grad()
def evaluate(model: torch.nn.Module, val: np.ndarray, starts: np.ndarray, *, block: int) -> float:
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
