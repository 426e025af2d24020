"""Next-token logits for every request in the batch: recomputed from the context, or from a KV cache slot each.

`RecomputeDecoder` (`--kv-cache off`): each step right-pads every row's last `context_length` tokens into one [B, T]
batch and runs ONE forward. Attention is causal and every row's positions start at 0, so the padding after a row's
last real token cannot change that token's logits: no attention mask is needed, and each row reads its logits at
its own last real position.

`CachedDecoder` (`--kv-cache dynamic`, the default, or `static`): a request that joins gets a slot of a `KVCache`
preallocated for `max_batch_size` requests of `context_length` tokens; its prompt runs once (prefill, the joiners of
a step right-padded together), then each step is ONE forward of one token per request (decode) with an attention
mask over the positions each slot holds. Slots are kept contiguous: when a request leaves, the last slot moves into
its place, so a decode step reads slots [0, n) without gathering them. `dynamic` runs the n active slots over the
longest one's positions; `static` always runs every slot over the whole context (idle slots decode a dummy token)
so the decode step has the same shapes at every step, which torch.compile / CUDA graphs need to capture it.

Past `context_length` a request leaves its slot and is recomputed on its last `context_length` tokens, as without a
cache (models/generate.py explains why): its tokens stay those of `generate`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from gaudi3_scale.models.common.kv_cache import KVCache
from gaudi3_scale.models.config import ModelConfig

__all__ = ["KV_CACHE_MODES", "CachedDecoder", "RecomputeDecoder", "build_decoder", "last_position_logits"]

KvCacheMode = Literal["dynamic", "static", "off"]
KV_CACHE_MODES: tuple[KvCacheMode, ...] = ("dynamic", "static", "off")
Row = tuple[int, Sequence[int]]  # (a key unique to the request while it runs, its tokens so far)


def last_position_logits(
    model: nn.Module, contexts: Sequence[Sequence[int]], vocab_size: int
) -> torch.Tensor:
    """Next-token logits [B, vocab_size] (float32) of every context, from ONE forward of the right-padded batch."""
    device = next(model.parameters()).device
    lengths = torch.tensor([len(c) for c in contexts], device=device)
    batch = _right_padded(contexts, device)
    logits = model(batch)
    rows = torch.arange(len(contexts), device=device)
    return logits[rows, lengths - 1, :vocab_size].float()


def _right_padded(contexts: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    batch = torch.zeros(len(contexts), max(len(c) for c in contexts), dtype=torch.long)
    for row, context in enumerate(contexts):
        batch[row, : len(context)] = torch.tensor(context, dtype=torch.long)
    return batch.to(device)


class RecomputeDecoder:
    """No cache: every step re-reads each request's (cropped) context."""

    def __init__(self, model: nn.Module, vocab_size: int) -> None:
        cfg = model.config
        assert isinstance(cfg, ModelConfig), "a model from build_model"
        self.model, self.vocab_size, self.context_length = model, vocab_size, cfg.context_length

    def next_logits(self, rows: Sequence[Row]) -> torch.Tensor:
        contexts = [tokens[-self.context_length :] for _, tokens in rows]
        return last_position_logits(self.model, contexts, self.vocab_size)

    def reset(self) -> None:
        """Nothing is kept between steps."""


class CachedDecoder:
    """A KV cache slot per request; slot i belongs to `self._keys[i]` and holds `self._lengths[i]` positions."""

    def __init__(
        self, model: nn.Module, vocab_size: int, max_batch_size: int, *, static_shapes: bool
    ) -> None:
        self.model, self.vocab_size, self.static_shapes = model, vocab_size, static_shapes
        self.cache = KVCache.for_model(model, max_batch_size)
        self.context_length = self.cache.capacity
        self.device = self.cache.keys.device
        self._recompute = RecomputeDecoder(model, vocab_size)
        self._keys: list[int] = []
        self._lengths: list[int] = []

    @property
    def slots_in_use(self) -> int:
        return len(self._keys)

    def reset(self) -> None:
        """Free every slot (after a failed step: the slots' contents are not trusted)."""
        self._keys.clear()
        self._lengths.clear()

    def next_logits(self, rows: Sequence[Row]) -> torch.Tensor:
        """Logits [len(rows), vocab_size] (float32); slots of requests absent from `rows` are freed first."""
        self._free_all_but({key for key, tokens in rows if len(tokens) <= self.context_length})
        slot_of = {key: slot for slot, key in enumerate(self._keys)}
        logits = torch.empty(len(rows), self.vocab_size, device=self.device)
        decoding = [(row, slot_of[key], tokens) for row, (key, tokens) in enumerate(rows) if key in slot_of]
        if decoding:  # before the prefill: a static step also writes (dummy) keys into the free slots
            rows_, slots, tokens = zip(*decoding, strict=True)
            logits[list(rows_)] = self._decode(slots, tokens)
        joining = [(row, key, tokens) for row, (key, tokens) in enumerate(rows)
                   if key not in slot_of and len(tokens) <= self.context_length]  # fmt: skip
        if joining:
            rows_, keys, tokens = zip(*joining, strict=True)
            logits[list(rows_)] = self._prefill(keys, tokens)
        overflowed = [row for row, (_, tokens) in enumerate(rows) if len(tokens) > self.context_length]
        if overflowed:
            logits[overflowed] = self._recompute.next_logits([rows[row] for row in overflowed])
        return logits

    def _free_all_but(self, keep: set[int]) -> None:
        # From the highest slot down, so that the slot moved into a hole is always one that stays.
        for slot in reversed(range(len(self._keys))):
            if self._keys[slot] in keep:
                continue
            last = len(self._keys) - 1
            if slot != last:
                self.cache.move_slot(last, slot, self._lengths[last])
                self._keys[slot], self._lengths[slot] = self._keys[last], self._lengths[last]
            self._keys.pop()
            self._lengths.pop()

    def _decode(self, slots: Sequence[int], contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        """One new token per slot; the slots are 0..n-1 in some order."""
        width = self.cache.num_slots if self.static_shapes else len(slots)
        tokens, positions = [0] * width, [0] * width  # idle slots (static): token 0 at position 0
        for slot, context in zip(slots, contexts, strict=True):
            assert len(context) == self._lengths[slot] + 1, "one new token per step"
            tokens[slot], positions[slot] = context[-1], self._lengths[slot]
            self._lengths[slot] += 1
        key_length = self.context_length if self.static_shapes else max(positions) + 1
        logits = self.decode_step(torch.tensor(tokens, device=self.device)[:, None],
                                  torch.tensor(positions, device=self.device)[:, None], key_length)  # fmt: skip
        return logits[list(slots), -1, : self.vocab_size].float()

    def decode_step(self, tokens: torch.Tensor, positions: torch.Tensor, key_length: int) -> torch.Tensor:
        """The forward of a decode step: tokens, positions [slots, 1] → logits [slots, 1, vocab]. With static
        shapes every argument has the same shape (and key_length the same value) at every step."""
        return self.model(tokens, self.cache.step(positions, key_length=key_length))

    def _prefill(self, keys: Sequence[int], contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        """New requests take the next free slots; their prompts run together, right-padded (the padding's keys are
        written past each prompt's end, where the mask hides them until real tokens overwrite them)."""
        first = len(self._keys)
        self._keys.extend(keys)
        self._lengths.extend(len(c) for c in contexts)
        batch = _right_padded(contexts, self.device)
        positions = torch.arange(batch.shape[1], device=self.device).expand(batch.shape[0], -1)
        logits = self.model(batch, self.cache.step(positions, first_slot=first, key_length=batch.shape[1]))
        last = torch.tensor([len(c) - 1 for c in contexts], device=self.device)
        return logits[torch.arange(len(contexts), device=self.device), last, : self.vocab_size].float()


def build_decoder(
    model: nn.Module, vocab_size: int, max_batch_size: int, kv_cache: KvCacheMode
) -> RecomputeDecoder | CachedDecoder:
    if kv_cache == "off":
        return RecomputeDecoder(model, vocab_size)
    return CachedDecoder(model, vocab_size, max_batch_size, static_shapes=kv_cache == "static")
