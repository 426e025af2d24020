"""Rotary position embeddings (Su et al. 2021, "RoFormer", arXiv:2104.09864), as in Meta's Llama 3 reference.

Pairs are the *interleaved* channels (0, 1), (2, 3), … like `apply_rotary_emb` in meta-llama/llama3 `model.py`,
so Meta checkpoints load without permuting wq/wk. The rotation is written with real cos/sin instead of complex
numbers because complex tensors are not supported by every backend we target (HPU graphs, some compile paths).
"""

from __future__ import annotations

import torch

__all__ = ["apply_rope", "build_rope_cache"]


def build_rope_cache(
    head_dim: int, max_seq_len: int, theta: float, device: torch.device | str | None = None
) -> torch.Tensor:
    """cos/sin of every (position, frequency) pair: float32 tensor of shape [max_seq_len, head_dim // 2, 2]. On the
    meta device only the shape: computing it there runs torch's Python decompositions, whose first use imports
    torch._dynamo (1.1 s) in the shape-only commands (plan, tune --estimate-only, the launcher's forecast)."""
    if torch.device(device or torch.get_default_device()).type == "meta":
        return torch.empty(max_seq_len, len(range(0, head_dim, 2)), 2, device="meta", dtype=torch.float32)
    # θ_i = theta^(-2i/d) for i in [0, d/2)  (RoFormer eq. 15; Llama 3 uses theta = 500000)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
    """Rotate `x` of shape [batch, seq, heads, head_dim] by position; `rope_cache` is [seq, head_dim // 2, 2], or
    [batch, seq, head_dim // 2, 2] when each row has its own positions (decoding with a KV cache)."""
    # Rotate in float32 and cast back, as the reference does, so bf16 runs keep positional precision.
    pairs = x.float().unflatten(-1, (-1, 2))
    x_even, x_odd = pairs[..., 0], pairs[..., 1]
    cos = rope_cache[..., None, :, 0]  # broadcast over heads
    sin = rope_cache[..., None, :, 1]
    rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)
