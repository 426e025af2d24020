"""Parameter names, shapes and counts and training FLOPs per token, from the config alone.

Every block of a model has the same parameters, so a one-block model built on meta gives the names and shapes of all
(`parameter_shapes`), and models of one and two blocks give the count (`from_one_and_two_blocks`, which
`count_parameters` and `tune.memory`'s shard sizes use): the time taken does not grow with `num_layers`.
`check_parameter_count` bounds a shape by `models.config.MAX_PARAMETERS`.

FLOPs convention — PaLM (Chowdhery et al. 2022, arXiv:2204.02311) Appendix B, as implemented by nanoGPT
`GPT.estimate_mfu` and torchtitan `get_num_flop_per_token`:

    training FLOPs per token = 6·N + 12·L·H·Q·T

* 6·N: each parameter does one multiply-add (2 FLOPs) per token forward and two backward (Kaplan et al. 2020 §2.1).
  N counts only parameters that take part in a matmul: all parameters minus the lookup-only embedding tables
  (nanoGPT `get_num_params(non_embedding=True)`). So GPT-2's position table is excluded but its tied token
  embedding stays in, because it is also the output head; Llama's untied `tok_embeddings` is excluded and its
  `output` head stays in (torchtitan subtracts `tok_embeddings`). Norm weights and biases are included (≪ 1%).
  Note this N is *not* Kaplan's "non-embedding" N, which also drops the tied head.
  For a mixture of experts N is the *active* count: a token passes through k of the E experts of each block, so
  the experts' weights count k/E (router included in full); this is what MFU and the cost planner use. Weights,
  gradients and optimizer state are the *total* count (`count_parameters(cfg)`, the memory estimator's).
* 12·L·H·Q·T: the attention score (QKᵀ) and weighted-sum (AV) matmuls, 2 matmuls × 2 FLOPs × 3 (fwd + bwd),
  with L layers, H query heads, Q head dim, T sequence length. Causal masking is *not* discounted (PaLM counts
  the full T×T product), grouped kv heads do not reduce it, and activation recomputation is not added.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.models.build import build_model
from gaudi3_scale.models.common.init import logical_shape
from gaudi3_scale.models.common.moe import GroupedExperts
from gaudi3_scale.models.config import MAX_PARAMETERS, ModelConfig
from gaudi3_scale.models.transformer import Transformer
from gaudi3_scale.models.vocab import VOCAB_TABLES

__all__ = [
    "check_parameter_count",
    "count_parameters",
    "flops_per_token",
    "forward_flops_per_token",
    "from_one_and_two_blocks",
    "parameter_shapes",
]

_BLOCK = "layers.0."  # the parameter names of the first block start with this


# Elements of the largest weight a shape may have to be built on meta: torch computes a tensor's size in bytes as an
# int64 and refuses one past 2**63 ("Storage size calculation overflowed"), 2**60 elements of 8 bytes. Far above
# MAX_PARAMETERS, so a shape over the limit by less than this still gets its exact count.
_MAX_META_ELEMENTS = 2**56


def _build_on_meta(cfg: ModelConfig) -> Transformer:
    with torch.device("meta"):
        return build_model(cfg)


def _parameters_at_least(cfg: ModelConfig) -> int:
    """A lower bound on `count_parameters(cfg)`, from the config alone: the tables (token; position in gpt2 and bert;
    segment in bert) and each block's query projection and first MLP matrix (of each expert)."""
    tables = (cfg.vocab_size or 0) + (cfg.context_length if cfg.arch != "llama" else 0)
    tables += cfg.type_vocab_size if cfg.arch == "bert" else 0
    block = cfg.dim + (cfg.num_experts or 1) * cfg.hidden_dim
    return (tables + cfg.num_layers * block) * cfg.dim


def _check_buildable(cfg: ModelConfig, where: str) -> None:
    """One line when a weight of `cfg`'s model is too large for torch to build, even on meta: no weight has more
    elements than the largest of these products (the RoPE cache, [context_length, head_dim / 2, 2], included)."""
    rows = [cfg.context_length, cfg.dim, (cfg.num_experts or 1) * cfg.hidden_dim]
    rows += [
        cfg.padded_vocab_size if cfg.vocab_size is not None else 0,
        cfg.type_vocab_size if cfg.arch == "bert" else 0,
    ]
    if max(rows) * cfg.dim <= _MAX_META_ELEMENTS:
        return
    at_least = _parameters_at_least(cfg)
    if at_least > MAX_PARAMETERS:
        # The widths alone in the message: callers count blocks with num_layers 1 (tune.activations).
        raise UserInputError(_over_the_limit(cfg, where, f"at least {at_least:,}", layers=False))
    raise UserInputError(_padding_too_large(cfg, where))  # no parameter: the rows pad_vocab_to_multiple adds


def _padding_too_large(cfg: ModelConfig, where: str) -> str:
    return (
        f"{where}: pad_vocab_to_multiple {cfg.pad_vocab_to_multiple} pads the embedding to {cfg.padded_vocab_size:,} "
        f"rows of {cfg.dim}, too large to build; allowed: a smaller power of two"
    )


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our parameter name → shape for `cfg`, in `named_parameters()` order (a tied head listed once), from a
    one-block model: block 0's entries are repeated for each block."""
    _check_buildable(cfg, "model")
    named = [
        (name, logical_shape(p)) for name, p in _build_on_meta(replace(cfg, num_layers=1)).named_parameters()
    ]
    first = next(i for i, (name, _) in enumerate(named) if name.startswith(_BLOCK))
    block = [(name.removeprefix(_BLOCK), shape) for name, shape in named if name.startswith(_BLOCK)]
    layers = [(f"layers.{i}.{name}", shape) for i in range(cfg.num_layers) for name, shape in block]
    return dict(named[:first] + layers + named[first + len(block) :])


def _lookup_only_embeddings(model: Transformer) -> list[torch.Tensor]:
    tables = [] if model.pos_embeddings is None else [model.pos_embeddings.weight]
    if (types := getattr(model, "type_embeddings", None)) is not None:  # bert's segment table
        tables.append(types.weight)
    if model.output.weight is not model.tok_embeddings.weight:
        tables.append(model.tok_embeddings.weight)
    return tables


def count_parameters(
    cfg: ModelConfig, *, trainable_only: bool = True, exclude_embeddings: bool = False, active: bool = False
) -> int:
    """Parameters of the model `cfg` describes; tied weights are counted once, vocabulary padding rows not at all
    (they are never sampled, so a padded GPT-2 still counts its published 124 M).

    exclude_embeddings drops the lookup-only tables (see the module docstring), leaving the matmul parameters.
    active counts what one token uses: experts_per_token of num_experts experts (Mixtral 8x7B: 12.9 B of 46.7 B).
    """
    (count,) = from_one_and_two_blocks(
        cfg, lambda model: [_count_model(model, trainable_only, exclude_embeddings, active)]
    )
    return count


def from_one_and_two_blocks(cfg: ModelConfig, measure: Callable[[Transformer], Sequence[int]]) -> list[int]:
    """The numbers `measure` gives for the model `cfg` describes, from models of one and two blocks built on meta:
    every block has the same parameters, so each number grows by the same amount per block."""
    _check_buildable(cfg, "model")
    one, two = (measure(_build_on_meta(replace(cfg, num_layers=n))) for n in (1, 2))
    return [a + (cfg.num_layers - 1) * (b - a) for a, b in zip(one, two, strict=True)]


def check_parameter_count(cfg: ModelConfig, where: str) -> None:
    """One line naming `where` and the shape when `cfg` has more than `MAX_PARAMETERS` parameters (its vocabulary
    must be resolved). A shape too large to build even on meta is refused from its config alone (`at least` so many
    parameters)."""
    _check_buildable(cfg, where)
    count = count_parameters(cfg)
    if count > MAX_PARAMETERS:
        raise UserInputError(_over_the_limit(cfg, where, f"{count:,}"))
    # The padding rows are no parameters (not counted above) but are allocated all the same.
    assert cfg.vocab_size is not None
    padding = (cfg.padded_vocab_size - cfg.vocab_size) * cfg.dim * (1 if cfg.tie_embeddings else 2)
    if count + padding > MAX_PARAMETERS:
        raise UserInputError(_padding_too_large(cfg, where))


def _over_the_limit(cfg: ModelConfig, where: str, count: str, *, layers: bool = True) -> str:
    experts = f", num_experts {cfg.num_experts}" if cfg.num_experts else ""
    experts += f", type_vocab_size {cfg.type_vocab_size}" if cfg.arch == "bert" else ""
    depth = f"num_layers {cfg.num_layers}, " if layers else ""
    return (
        f"{where}: the shape ({depth}dim {cfg.dim}, ffn_dim {cfg.hidden_dim}, vocab_size {cfg.vocab_size}, "
        f"context_length {cfg.context_length}{experts}) has {count} parameters, over the limit of {MAX_PARAMETERS:,} "
        "(models.config.MAX_PARAMETERS, ten times the largest open-weight model); allowed: a smaller shape"
    )


def _count_model(model: Transformer, trainable_only: bool, exclude_embeddings: bool, active: bool) -> int:
    cfg = model.config
    params = [
        p for p in model.parameters() if p.requires_grad or not trainable_only
    ]  # parameters() dedups ties
    if exclude_embeddings:
        lookup = {id(p) for p in _lookup_only_embeddings(model)}
        params = [p for p in params if id(p) not in lookup]
    assert cfg.vocab_size is not None  # build_model refused an unresolved vocabulary
    padding_rows = cfg.padded_vocab_size - cfg.vocab_size
    vocab_tables = {id(p) for name, p in model.named_parameters() if name in VOCAB_TABLES}
    total = sum(p.numel() - (padding_rows * p[0].numel() if id(p) in vocab_tables else 0) for p in params)
    if active and cfg.num_experts:
        counted = {id(p) for p in params}
        experts = [p for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()]
        idle = cfg.num_experts - cfg.experts_per_token
        total -= sum(p.numel() // cfg.num_experts * idle for p in experts if id(p) in counted)
    return total


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
    """Training (forward + backward) FLOPs per token at `seq_len` (default: the full context)."""
    seq_len = cfg.context_length if seq_len is None else seq_len
    if not 0 < seq_len <= cfg.context_length:
        raise ValueError(f"seq_len must be in 1..{cfg.context_length} (context_length), got {seq_len}")
    n = count_parameters(cfg, trainable_only=False, exclude_embeddings=True, active=True)
    attention = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len
    return float(6 * n + attention)


def forward_flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
    """Forward-only FLOPs per token: one third of the training figure (backward costs twice the forward)."""
    return flops_per_token(cfg, seq_len) / 3.0
