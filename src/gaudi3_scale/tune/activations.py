"""What one rank's tensors weigh, from the model shape alone: parameter counts per block and per tensor-parallel
rank, bytes per element for a precision under a strategy, activations saved for backward and the loss workspace.
`tune.memory` adds them up into the phases of a step.

Activations — Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (MLSys 2023,
arXiv:2205.05198) §4.1: a GPT layer saves s·b·h·(34 + 5·a·s/h) bytes with 16-bit activations (s tokens, b
sequences, h width, a heads). Adapted to the real blocks (`models/transformer.py`), tensor by tensor (checked with
autograd's saved tensors on CPU, torch 2.13):
* fused attention (FlashAttention/SDPA, Dao et al. 2022) keeps q, k, v, the output and a fp32 log-sum-exp instead
  of the a·s² score, softmax and dropout tensors (the 5·a·s·b·s term); the math fallback keeps a·s²·b softmax
  probabilities, ×3 with dropout (mask and dropped probabilities). CPU flash has no dropout; on HPU dispatch of
  `scaled_dot_product_attention` to Habana's FusedSDPA is not confirmed (`device/precision.py`), so math is assumed;
* grouped-query k and v are h·kv_heads/heads wide; the MLP saves 2 tensors of the real ffn width (GELU) or 4
  (SwiGLU: w1 x, w3 x, silu(w1 x), their product); LayerNorm saves its input, RMSNorm (composite on CPU; assumed
  elsewhere) its input and x·rsqrt, upcast to fp32; dropout masks (input dtype on CPU, 1-byte bool on CUDA) only
  when dropout > 0;
* the residual stream stays fp32 under autocast (fp32 embeddings), and autocast casts a norm's fp32 output once
  per linear that reads it (3 copies for wq/wk/wv, plus 1 or 2 for the MLP input);
* full activation checkpointing (Chen et al. 2016; Korthikanti §4, "2·s·b·h·L") keeps each block's input and, in
  backward, one recomputed block's activations.
The loss adds logits work of b·s·V: log_softmax output, its gradient and the logits' gradient (3·b·s·V in fp32,
cross-entropy runs in fp32 under autocast), or the logits' gradient plus the head weight's fresh gradient
(b·s·V + V·h), whichever is larger; for small models with a large vocabulary this dominates.

Under `torch.compile` (`train.compile`: the model and its loss in one region) the min-cut partitioner of AOTAutograd
chooses what the forward keeps for backward, and recomputes the rest (`compiled_layer_bytes`; held against the
partitioner's own choice on CPU by tests/integration/test_compiled_activations.py, and against
`torch.cuda.max_memory_allocated` on an H200 by benchmarks/bench_gpu_shapes.py, within 2 % on every compiled shape
measured). Per block it keeps each norm's fp32 input (RMSNorm) or normalised value (LayerNorm) and statistics,
each norm's output once in the compute dtype (not once per reading linear), q, k, v, the attention output and its
log-sum-exp, the MLP's up-projections and product (SwiGLU) or GELU input and output, and a 1-byte mask per dropout;
residual adds and casts are recomputed. The loss keeps the logits in the compute dtype and writes their gradient
over them (b·s·V); log_softmax is never stored. Under compiled fp8 (torchao tensorwise and rowwise recipes) the
converted linears keep their inputs in fp8 (1 byte) and no cast copy of their weights (recast from the fp32
parameter in backward); these two terms were set from the one fp8 shape measured on an H200 (+2 %): the CPU
partitioner recomputes the fp8 inputs as well, so CPU inventories cannot check them.

Under tensor parallel with sequence parallel (Korthikanti §4.2.2; `distributed/tensor_parallel.py`) the norms, the
residual stream and the attention/MLP tensors are split over tp ranks, but DTensor saves the all-gathered inputs
of the column-parallel linears whole (Megatron re-gathers them in backward instead), and the loss runs on
vocabulary-sharded logits (loss parallel).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gaudi3_scale.config.errors import ConfigError
from gaudi3_scale.models.config import ModelConfig
from gaudi3_scale.models.counting import count_parameters

__all__ = [
    "ElementBytes",
    "ModelShape",
    "activation_bytes",
    "compiled_layer_bytes",
    "element_bytes",
    "loss_workspace_bytes",
    "model_shape",
    "tp_shape",
]


@dataclass(frozen=True)
class ModelShape:
    """Parameter counts (elements) and widths, from `count_parameters` on one- and two-block copies (meta)."""

    params: float  # whole numbers, except one tensor-parallel rank's share (`tp_shape`)
    block: float  # one transformer block
    root: float  # embeddings, final norm, head
    head: float  # output weight, padded_vocab × dim
    tied: bool
    layers: int
    dim: int
    ffn: int
    kv_dim: int
    heads: int
    vocab: int
    llama: bool
    dropout: bool
    encoder: bool = False  # arch bert: post-norm blocks, an MLM transform before the head
    experts: bool = False  # a mixture of experts (`ffn` is then the active experts' width)
    embedding: float = 0.0  # the lookup-only tables (token, position embeddings), part of `root`
    # A pipeline stage (`tune.pipeline_shape`) holds the embeddings only if it is the first, the final norm and
    # head only if it is the last; the whole model is both.
    first: bool = True
    last: bool = True


_SHAPES: dict[
    str, ModelShape
] = {}  # by repr(config): the tuner and the layout table estimate one model many times


def model_shape(cfg: ModelConfig) -> ModelShape:
    key = repr(cfg)
    if key not in _SHAPES:
        _SHAPES[key] = _count_shape(cfg)
    return _SHAPES[key]


def _count_shape(cfg: ModelConfig) -> ModelShape:
    if cfg.vocab_size is None:
        raise ConfigError(
            "model.vocab_size",
            "is null; resolve it from the dataset (ModelConfig.resolve_vocab) before estimating",
        )
    one_block = replace(cfg, num_layers=1)
    one = count_parameters(one_block)
    block = count_parameters(replace(cfg, num_layers=2)) - one
    return ModelShape(
        params=(one - block) + cfg.num_layers * block,
        block=block,
        root=one - block,
        head=cfg.padded_vocab_size * cfg.dim,
        tied=cfg.tie_embeddings,
        layers=cfg.num_layers,
        dim=cfg.dim,
        # Mixture of experts: a token passes through experts_per_token experts (models/common/moe.py), so it saves
        # that many expert MLPs' activations; its routed input copies (k·dim per token) are left out. The weights
        # above are the total count, all experts.
        ffn=cfg.hidden_dim * (cfg.experts_per_token if cfg.num_experts else 1),
        kv_dim=cfg.kv_heads * cfg.head_dim,
        heads=cfg.num_heads,
        vocab=cfg.padded_vocab_size,
        llama=cfg.arch == "llama",
        dropout=cfg.dropout > 0,
        encoder=cfg.arch == "bert",
        experts=bool(cfg.num_experts),
        embedding=one - count_parameters(one_block, exclude_embeddings=True),
    )


def tp_shape(sh: ModelShape, tp: int) -> ModelShape:
    """One tensor-parallel rank's parameters under the Llama plan (`distributed/tensor_parallel.py`, Megatron's
    layout): every matmul weight, the embedding table and the head split over `tp` ranks; the RMSNorm weights (two
    per block, one final) replicated."""
    if tp == 1:
        return sh
    block_norms, final_norm = 2 * sh.dim, sh.dim
    block = (sh.block - block_norms) / tp + block_norms
    root = (sh.root - final_norm) / tp + final_norm
    return replace(
        sh,
        params=root + sh.layers * block,
        block=block,
        root=root,
        head=sh.head / tp,
        embedding=sh.embedding / tp,
    )


@dataclass(frozen=True)
class ElementBytes:
    """Bytes per element of each kind of tensor, for one precision under one strategy."""

    weight: int  # stored parameters (replicas or shards)
    gathered: int  # FSDP/ZeRO-3 gathered parameters and their unsharded gradients
    grad: int  # gradients as kept (DDP buckets, FSDP shards, ZeRO partitions)
    state: int  # one optimizer state tensor
    master: int  # separate fp32 master copy (DeepSpeed), 0 = none
    compute: int  # activations on the matmul path
    residual: int  # residual stream and the norms' saved tensors
    loss: int  # log_softmax and its gradients
    autocast: bool  # torch.autocast: a norm's fp32 output is cast once per linear that reads it
    weight_casts: bool  # autocast also casts every fp32 matmul weight (kept for backward)


def element_bytes(precision: str, strategy: str) -> ElementBytes:
    half = precision != "32-true"
    if strategy.startswith("deepspeed"):
        # Lightning's DeepSpeedPrecision turns on DeepSpeed's bf16/fp16 mode: 16-bit module, fp32 master partitions.
        w = 2 if half else 4
        return ElementBytes(w, w, w, 4, 4, w, w, w, autocast=False, weight_casts=False)
    if precision == "32-true":
        return ElementBytes(4, 4, 4, 4, 0, 4, 4, 4, autocast=False, weight_casts=False)
    if precision == "bf16-true":  # Lightning HalfPrecision: module, gradients and AdamW moments in bf16
        return ElementBytes(2, 2, 2, 2, 0, 2, 2, 2, autocast=False, weight_casts=False)
    if strategy in ("fsdp", "fsdp_grad_op"):  # MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
        return ElementBytes(4, 2, 4, 4, 0, 2, 2, 4, autocast=True, weight_casts=False)
    return ElementBytes(4, 4, 4, 4, 0, 2, 4, 4, autocast=True, weight_casts=True)


def _fused_attention(device_kind: str, dropout: bool) -> bool:
    """Flash/memory-efficient SDPA on CUDA; CPU flash has no dropout; on HPU not confirmed (module docstring)."""
    return device_kind == "cuda" or (device_kind == "cpu" and not dropout)


def _layer_bytes(sh: ModelShape, b: int, s: int, e: ElementBytes, device_kind: str, tp: int = 1) -> float:
    """Activations one block saves for backward (Korthikanti §4.1, adapted: module docstring); under tensor
    parallel with sequence parallel (§4.2.2) everything is split over `tp` ranks except the all-gathered inputs of
    the column-parallel linears, which DTensor saves whole."""
    sbh, sbf, sb = s * b * sh.dim, s * b * sh.ffn / tp, s * b
    statistics = 2 * sb * (4 if sh.llama else 2 * e.residual)  # fp32 rstd (RMSNorm); mean, rstd (LayerNorm)
    # LayerNorm keeps its input; the composite RMSNorm keeps its input and x·rsqrt, both upcast to fp32.
    norm_side = ((4 * sbh * 4 if sh.llama else 2 * sbh * e.residual) + statistics) / tp
    linear_inputs = ((5 if sh.llama else 4) if e.autocast else 2) * sbh * e.compute
    mlp = (4 if sh.llama else 2) * sbf * e.compute
    if _fused_attention(device_kind, sh.dropout):
        attention = (2 * sbh + 2 * sb * sh.kv_dim) * e.compute + b * sh.heads * s * 4  # q, out, k, v; lse
    else:  # math path: scaled q/k copies, k/v repeated to all heads, softmax (+ mask and dropped probabilities)
        attention = 4 * sbh * e.compute + (3 if sh.dropout else 1) * sh.heads * s * s * b * e.compute
    masks = 2 * sbh * _mask_bytes(e, device_kind) if sh.dropout else 0
    return norm_side + linear_inputs + mlp + (attention + masks) / tp  # local heads under tensor parallel


def _mask_bytes(e: ElementBytes, device_kind: str) -> int:
    """Dropout keeps a bool mask on CUDA, a scaled mask in the input dtype on CPU (and, assumed, HPU)."""
    return 1 if device_kind == "cuda" else e.compute


def compiled_layer_bytes(
    sh: ModelShape, b: int, s: int, e: ElementBytes, device_kind: str, tp: int = 1, fp8_inputs: bool = False
) -> float:
    """Activations one block saves for backward under `torch.compile` (module docstring); `fp8_inputs`: compiled
    fp8, whose converted linears keep their inputs in fp8. Under tensor parallel, as `_layer_bytes`: the norms'
    outputs (the column-parallel linears' all-gathered inputs) whole, the rest split over `tp` ranks."""
    sb = s * b
    sbh, sbf = sb * sh.dim, sb * sh.ffn / tp
    linear_input = 1 if fp8_inputs else e.compute
    norms = (2 * sbh * e.residual + 2 * sb * 4) / tp + 2 * sbh * linear_input  # fp32 input or x̂, rstd; output
    attention = (2 * sbh + 2 * sb * sh.kv_dim) * e.compute  # q, k, v, output
    if fp8_inputs:
        attention += sbh * 1  # the output once more, in fp8, for the output projection
    if _fused_attention(device_kind, sh.dropout):
        attention += b * sh.heads * s * 4  # fp32 log-sum-exp
    else:  # math path: fp32 probabilities (+ a 1-byte dropout mask)
        attention += sh.heads * s * s * b * (4 + (1 if sh.dropout else 0))
    if sh.experts:  # the experts run eagerly (models/common/moe.py): eager autograd's four SwiGLU tensors
        mlp = 4 * sbf * e.compute
    elif sh.llama:  # w1·x, w3·x, and their product (the input of w2)
        mlp = 2 * sbf * e.compute + sbf * linear_input
    else:  # the GELU's input, and its output (the input of the second linear)
        mlp = sbf * e.compute + sbf * linear_input
    masks = 2 * sbh * 1 if sh.dropout else 0  # the two residual dropouts' bool masks
    return norms + (attention + mlp + masks) / tp


def activation_bytes(
    sh: ModelShape,
    b: int,
    s: int,
    e: ElementBytes,
    ckpt: bool,
    device_kind: str,
    tp: int = 1,
    *,
    compiled: bool = False,
    fp8_inputs: bool = False,
) -> float:
    sbh = s * b * sh.dim
    if compiled:
        layer = compiled_layer_bytes(sh, b, s, e, device_kind, tp, fp8_inputs)
        # The final norm's fp32 input or x̂ and its output; an encoder's MLM transform keeps its dense input and GELU
        # input; the embedding dropout's mask. The logits are the loss's (`loss_workspace_bytes`).
        head_side = (
            sbh * e.residual / tp
            + sbh * e.compute
            + (0 if sh.llama or not sh.encoder else 2 * sbh * e.compute)
        )
        embedding_mask = sbh * 1 if sh.dropout else 0
    else:
        layer = _layer_bytes(sh, b, s, e, device_kind, tp)
        # final norm (sequence-parallel under tp); the head's input (all-gathered whole under tp)
        head_side = (2 * sbh * 4 if sh.llama else sbh * e.residual) / tp + sbh * e.compute
        embedding_mask = sbh * _mask_bytes(e, device_kind) if sh.dropout else 0
    blocks = sh.layers * sbh * e.residual / tp + layer if ckpt else sh.layers * layer
    return blocks + (head_side if sh.last else 0) + (embedding_mask if sh.first else 0)


def loss_workspace_bytes(
    sh: ModelShape,
    b: int,
    s: int,
    e: ElementBytes,
    head_grad_bytes: int,
    tp: int = 1,
    *,
    compiled: bool = False,
) -> float:
    """The loss's 3·b·s·V, or the logits' gradient with the head weight's fresh gradient, whichever is larger;
    compiled, the logits kept in the compute dtype (their gradient is written over them) and the head weight's fresh
    gradient. Under tensor parallel the logits and the head are split over the vocabulary (loss parallel). A
    pipeline stage without the head has no loss."""
    if not sh.last:
        return 0.0
    logits = b * s * sh.vocab / tp
    if compiled:
        return logits * e.compute + sh.head * head_grad_bytes
    return max(3 * logits * e.loss, logits * e.compute + sh.head * head_grad_bytes)
