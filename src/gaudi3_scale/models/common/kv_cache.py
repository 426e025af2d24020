"""Key/value cache for decoding: a sequence's keys and values are computed once, then each new token attends to them.

Without it every new token re-runs the whole context, so a token costs O(context) forwards' worth of matmuls; with it,
a prompt is run once (prefill) and each further token is one position wide (decode). Keys and values are stored
after RoPE, per layer, as [slots, kv_heads, capacity, head_dim]: `kv_heads`, not `num_heads`, because grouped-query
attention shares each key/value head across its query group (the memory saving of GQA, Ainslie et al. 2023).

The storage is allocated once (slots × capacity) so that a server fails at start rather than mid-request when it
does not fit, and so that a decode step can have the same shapes at every step (`key_length = capacity`), which
torch.compile / CUDA graphs need to capture it. A slot is a row of the batch; `CacheStep` says which rows a forward
uses and where its new tokens go.
"""

from __future__ import annotations

import torch
from torch import nn

from gaudi3_scale.models.config import ModelConfig

__all__ = ["CacheStep", "KVCache", "LayerCache"]


class KVCache:
    """Keys and values of every layer for `num_slots` sequences of up to `capacity` tokens (default: the context)."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_slots: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        capacity: int | None = None,
    ) -> None:
        self.capacity = capacity or cfg.context_length
        assert num_slots >= 1 and 1 <= self.capacity <= cfg.context_length, (num_slots, self.capacity)
        shape = (cfg.num_layers, num_slots, cfg.kv_heads, self.capacity, cfg.head_dim)
        # Zeros, not empty: masked positions still enter attention as 0 × value, and 0 × NaN would be NaN.
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)

    @classmethod
    def for_model(cls, model: nn.Module, num_slots: int, *, capacity: int | None = None) -> KVCache:
        """A cache on the model's device, in its parameters' dtype."""
        cfg = model.config
        assert isinstance(cfg, ModelConfig), "a model from build_model"
        weight = next(model.parameters())
        return cls(cfg, num_slots, device=weight.device, dtype=weight.dtype, capacity=capacity)

    @property
    def num_slots(self) -> int:
        return self.keys.shape[1]

    @property
    def size_bytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def move_slot(self, source: int, target: int, length: int) -> None:
        """Copy the first `length` positions of slot `source` into slot `target` (to keep used slots contiguous)."""
        self.keys[:, target, :, :length] = self.keys[:, source, :, :length]
        self.values[:, target, :, :length] = self.values[:, source, :, :length]

    def step(
        self, positions: torch.Tensor, *, first_slot: int = 0, key_length: int | None = None
    ) -> CacheStep:
        """The view one forward uses: its rows are slots `first_slot …`, `positions` [rows, new tokens] (int64)
        says where each new token goes, attention reads positions [0, key_length) (default: the capacity).

        Positions must be < capacity, and < key_length; they are not checked here (that would sync the device)."""
        rows = positions.shape[0]
        assert first_slot + rows <= self.num_slots, (first_slot, rows, self.num_slots)
        slots = slice(first_slot, first_slot + rows)
        return CacheStep(self.keys[:, slots], self.values[:, slots], positions, key_length or self.capacity)


class CacheStep:
    """One forward's rows of the cache, the positions of its new tokens and the attention mask they share."""

    def __init__(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, key_length: int
    ) -> None:
        self.keys, self.values, self.positions, self.key_length = keys, values, positions, key_length
        self.rows = torch.arange(positions.shape[0], device=positions.device)[:, None]
        # A new token at position p sees the cached positions 0..p: causal over the whole sequence, and positions a
        # row has not reached (padding, or another request's leftovers in a reused slot) are never read.
        key_positions = torch.arange(key_length, device=positions.device)
        self.mask = (key_positions <= positions[..., None]).unsqueeze(1)  # [rows, 1 (heads), new, key_length]

    def layer(self, index: int) -> LayerCache:
        return LayerCache(self, self.keys[index], self.values[index])


class LayerCache:
    """What attention in one layer needs: `update` stores the new keys/values and returns every one so far."""

    def __init__(self, step: CacheStep, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.step, self.keys, self.values = step, keys, values
        self.mask = step.mask

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [rows, new, kv_heads, head_dim] → keys, values [rows, kv_heads, key_length, head_dim]."""
        rows, positions = self.step.rows, self.step.positions
        # Advanced indices on dims 0 and 2 put the [rows, new] dims first: the target is [rows, new, heads, dim].
        # Stored in the cache's dtype: under autocast, fp32 weights give bf16 keys and values (an exact round trip,
        # since autocast casts them back for the attention that reads them).
        self.keys[rows, :, positions] = k.to(self.keys.dtype)
        self.values[rows, :, positions] = v.to(self.values.dtype)
        length = self.step.key_length
        return self.keys[:, :, :length], self.values[:, :, :length]
