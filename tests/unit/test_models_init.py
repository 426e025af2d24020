"""`models.common.init.fill_normal` against its definition, and `build_model`'s use of the global RNG."""

from __future__ import annotations

import hashlib

import pytest
import torch

from gaudi3_scale.models import build_model, get_model_config
from gaudi3_scale.models.common.init import CHUNK_ELEMENTS, fill_normal

_GOLDEN = 0x9E3779B97F4A7C15


def _reference(numel: int, std: float, seed: int, name: str) -> torch.Tensor:
    """The module docstring's definition, one chunk at a time: chunk k of the flattened tensor is drawn from a
    generator seeded with (seed, name, k)."""
    key = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")
    chunks = []
    for k in range(-(-numel // CHUNK_ELEMENTS)):
        generator = torch.Generator().manual_seed((key + k * _GOLDEN) & ((1 << 64) - 1))
        chunks.append(torch.randn(CHUNK_ELEMENTS, generator=generator))
    return torch.cat(chunks)[:numel].mul_(std)


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((5, 3 * CHUNK_ELEMENTS // 5 + 7), torch.float32), ((2 * CHUNK_ELEMENTS + 3,), torch.float32),
     ((3, 40_000), torch.bfloat16), ((2, 3, 30_000), torch.float32), ((16,), torch.float32)],
)  # fmt: skip
def test_fill_normal_is_its_definition(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    param = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))  # requires grad, as the model's do
    fill_normal(param, 0.02, seed=7, name="layers.0.w")
    expected = _reference(param.numel(), 0.02, 7, "layers.0.w").to(dtype).view(shape)
    assert torch.equal(param.detach(), expected)


def test_a_transposed_parameter_is_filled_in_its_own_element_order() -> None:
    """A non-contiguous tensor gets its values by logical element index, not by storage order."""
    base = torch.zeros(CHUNK_ELEMENTS // 4, 6)
    fill_normal(base.t(), 1.0, seed=1, name="w")
    assert torch.equal(base.t().reshape(-1), _reference(base.numel(), 1.0, 1, "w"))


def test_an_explicit_seed_leaves_the_global_rng_alone() -> None:
    """The model is built on meta and then initialised from its seed only: nn.Linear's own init, which drew from
    the global generator and was then overwritten, is never run (it was most of a large model's build time)."""
    cfg = get_model_config("shakespeare-char").resolve_vocab(65)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    model = build_model(cfg, seed=3)
    assert torch.equal(torch.get_rng_state(), before)
    assert model.tok_embeddings.weight.device.type == "cpu"
    assert torch.equal(model.tok_embeddings.weight, build_model(cfg, seed=3).tok_embeddings.weight)
    assert model.output.weight is model.tok_embeddings.weight  # tied, as built directly
