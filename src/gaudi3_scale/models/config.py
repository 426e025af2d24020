"""Shape of a transformer (decoder-only, or a BERT encoder). Presets are instances of this class kept in
`models/registry.py`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from gaudi3_scale.config.core import check_positive, check_range
from gaudi3_scale.config.errors import ConfigError, brief
from gaudi3_scale.config.numbers import check_number

__all__ = [
    "ACCELERATOR_VOCAB_MULTIPLE",
    "MAX_CONTEXT_LENGTH",
    "MAX_NUM_EXPERTS",
    "MAX_NUM_LAYERS",
    "MAX_PARAMETERS",
    "ModelConfig",
]

ACCELERATOR_VOCAB_MULTIPLE = 64  # vocabulary padding on GPUs and Gaudi when the config leaves it null
# Bounds on a shape, so that a typo (num_layers 100000000) is one line, not minutes of building modules while memory
# grows (docs/models.md#shape-limits). Every block is a module of its own (2.5 ms each to build on meta on a 2-core
# AMD EPYC VM, 2026-11-28), so depth is bounded by itself: the deepest transformer trained, DeepNet (Wang et al. 2022,
# arXiv:2203.00555), has 1,000 layers; Llama 3.1 405B has 126. Size is bounded by the parameter count
# (`models.counting.check_parameter_count`): ten times the largest open-weight model, Kimi K2 (1.04 T parameters;
# Kimi Team 2025, arXiv:2507.20534).
MAX_NUM_LAYERS = 1024
MAX_PARAMETERS = 10**13
# The context adds no parameters to a llama, but every model holds a RoPE cache (or a position table) of that many
# rows: float32 cos/sin [context_length, head_dim / 2, 2], 8 GiB at 2**24 tokens and head_dim 128, which a Gaudi 3
# (128 GB) or an H100 (80 GB) holds; 10**11 would be 3.2 TB. 2**24 is above the longest published context, Llama 4
# Scout's 10M tokens (Meta, 2025-04-05 model card).
MAX_CONTEXT_LENGTH = 2**24
# Experts per block: each is a name per projection and block in a Hugging Face checkpoint (and a row of the router),
# so a tiny config of 10**9 experts listed billions of names. 2**16 is 170 times the most experts of an open-weight
# model, Kimi K2's 384 (arXiv:2507.20534).
MAX_NUM_EXPERTS = 2**16
# Fields that count something (torch takes sizes as Python ints: a 64.0 from a JSON file failed inside nn.Linear).
_INT_FIELDS = ("num_layers", "num_heads", "num_kv_heads", "dim", "ffn_dim", "num_experts", "experts_per_token",
               "vocab_size", "pad_vocab_to_multiple", "context_length", "type_vocab_size")  # fmt: skip


@dataclass(kw_only=True)
class ModelConfig:
    name: str = field(
        default="shakespeare-char", metadata={"help": "registry preset the other fields start from"}
    )
    arch: Literal["gpt2", "llama", "bert"] = field(
        default="gpt2",
        metadata={
            "help": "gpt2: learned positions, LayerNorm, GELU; llama: RMSNorm, RoPE, SwiGLU, GQA; bert: "
            "bidirectional encoder, post-LayerNorm, masked-language-model objective (models/encoder.py)"
        },
    )
    num_layers: int = field(default=4, metadata={"help": "transformer blocks"})
    num_heads: int = field(default=4, metadata={"help": "attention (query) heads"})
    num_kv_heads: int | None = field(
        default=None, metadata={"help": "key/value heads for grouped-query attention; null = num_heads"}
    )
    activation: Literal["gelu", "gelu_tanh"] = field(
        default="gelu",
        metadata={
            "help": "gpt2 MLP activation: exact (erf) GELU, or GPT-2's tanh approximation (a CPU training step "
            "0.98x as fast as with erf: 49.5 vs 48.3 ms, benchmarks/bench_step_ablation.py, 2-core AMD EPYC, "
            "2026-11-25; docs/performance/cpu.md)"
        },
    )
    dim: int = field(default=128, metadata={"help": "residual stream width (d_model)"})
    ffn_dim: int | None = field(
        default=None,
        metadata={"help": "hidden width of the MLP (of each expert with num_experts); null = 4 * dim"},
    )
    # Mixture of experts (llama only; models/common/moe.py): Mixtral = Llama blocks whose MLP is this.
    num_experts: int | None = field(
        default=None,
        metadata={
            "help": "SwiGLU experts per block, routed token by token (Mixtral: 8); null = one dense MLP"
        },
    )
    experts_per_token: int = field(
        default=2, metadata={"help": "experts each token is sent to (top-k routing; Mixtral: 2)"}
    )
    moe_aux_loss_coef: float = field(
        default=0.02,
        metadata={
            "help": "weight of the load-balancing loss (Switch Transformer) added to the training loss"
        },
    )
    moe_z_loss_coef: float = field(
        default=0.0, metadata={"help": "weight of the router z-loss (ST-MoE); 0 = off"}
    )
    vocab_size: int | None = field(
        default=None, metadata={"help": "token vocabulary; null = taken from the prepared dataset"}
    )
    pad_vocab_to_multiple: int | None = field(
        default=None,
        metadata={
            "help": "round the embedding and output-head rows up to a multiple of this power of two (padding "
            "rows take no part in the loss, are never sampled nor counted as parameters); null = 64 on GPUs and "
            "Gaudi, 1 on CPU, at least parallel.tp_size under tensor parallel"
        },
    )
    context_length: int = field(default=64, metadata={"help": "maximum sequence length in tokens"})
    dropout: float = field(default=0.0, metadata={"help": "dropout probability on attention and residuals"})
    bias: bool = field(default=True, metadata={"help": "bias terms in linear layers and norms"})
    norm_eps: float = field(default=1e-5, metadata={"help": "epsilon of LayerNorm / RMSNorm"})
    rope_theta: float = field(default=10000.0, metadata={"help": "RoPE base frequency (llama only)"})
    tie_embeddings: bool = field(
        default=True, metadata={"help": "share the input embedding with the output head"}
    )
    type_vocab_size: int = field(
        default=2,
        metadata={
            "help": "bert: token-type (segment) embeddings; training feeds type 0 (single-segment text)"
        },
    )
    init_from: str | None = field(
        default=None,
        metadata={
            "help": "start from pretrained weights: a Hugging Face Llama or GPT-2 directory (config.json + "
            "safetensors, one file or sharded) or a `gaudi3 ckpt export` directory; the shape comes from its "
            "config (set fields must agree; context_length may be shorter) and its tokenizer prepares the data"
        },
    )

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(name, f"expected an integer, got {brief(value)}")
        for name in ("num_layers", "num_heads", "dim", "context_length"):
            check_positive(name, getattr(self, name))
        if self.num_layers > MAX_NUM_LAYERS:
            raise ConfigError(
                "num_layers",
                f"{self.num_layers} is over the limit of {MAX_NUM_LAYERS} layers (models.config.MAX_NUM_LAYERS, "
                f"above the deepest transformer trained); allowed: 1 to {MAX_NUM_LAYERS}",
            )
        if self.context_length > MAX_CONTEXT_LENGTH:
            raise ConfigError(
                "context_length",
                f"{self.context_length} is over the limit of {MAX_CONTEXT_LENGTH:,} tokens "
                f"(models.config.MAX_CONTEXT_LENGTH, the RoPE cache's rows); allowed: 1 to {MAX_CONTEXT_LENGTH:,}",
            )
        pad = self.pad_vocab_to_multiple
        check_number("pad_vocab_to_multiple", pad)  # 64 bits: 2**70 is a power of two too
        if pad is not None and (pad < 1 or pad & (pad - 1)):
            raise ConfigError(
                "pad_vocab_to_multiple",
                f"must be a positive power of two (1, 2, 4, … 64, …) or null for the device default, got {pad}",
            )
        check_positive("num_kv_heads", self.num_kv_heads)
        check_positive("ffn_dim", self.ffn_dim)
        check_positive("vocab_size", self.vocab_size)
        check_positive("norm_eps", self.norm_eps)
        # RoPE's base: its wavelengths run from 2π to 2π·theta (published models: 10,000 to 1,000,000); at or below
        # 1 they stop growing, and far below it the frequencies overflow to inf and the table to NaN.
        check_number("rope_theta", self.rope_theta, above=1)
        check_positive("type_vocab_size", self.type_vocab_size)
        check_range("dropout", self.dropout, 0.0, 1.0)
        if self.dim % self.num_heads:
            raise ConfigError("dim", f"must be divisible by num_heads ({self.num_heads}), got {self.dim}")
        if self.num_heads % self.kv_heads:
            raise ConfigError(
                "num_kv_heads", f"must divide num_heads ({self.num_heads}), got {self.num_kv_heads}"
            )
        if self.arch == "llama" and (self.dim // self.num_heads) % 2:
            raise ConfigError(
                "dim",
                f"dim / num_heads must be even for RoPE (it rotates pairs of dimensions), got {self.dim} / "
                f"{self.num_heads} = {self.dim // self.num_heads}; allowed: a dim that is an even multiple of "
                "num_heads",
            )
        self._check_experts()

    def _check_experts(self) -> None:
        check_positive("num_experts", self.num_experts)
        check_positive("experts_per_token", self.experts_per_token)
        check_positive("moe_aux_loss_coef", self.moe_aux_loss_coef, allow_zero=True)
        check_positive("moe_z_loss_coef", self.moe_z_loss_coef, allow_zero=True)
        if self.num_experts is None:
            return
        if self.num_experts > MAX_NUM_EXPERTS:
            raise ConfigError(
                "num_experts",
                f"{self.num_experts} is over the limit of {MAX_NUM_EXPERTS:,} experts (models.config.MAX_NUM_EXPERTS); "
                f"allowed: 1 to {MAX_NUM_EXPERTS:,}, or null",
            )
        if self.arch != "llama":
            raise ConfigError(
                "num_experts", f"mixture of experts is an option of arch llama, not {self.arch}; use null"
            )
        if self.bias:
            raise ConfigError(
                "bias", "must be false with num_experts: expert and router weights have no bias"
            )
        if self.experts_per_token > self.num_experts:
            raise ConfigError(
                "experts_per_token",
                f"{self.experts_per_token} is more than num_experts ({self.num_experts}); allowed: 1 to "
                f"{self.num_experts}",
            )

    def resolve_vocab(self, vocab_size: int) -> ModelConfig:
        """A copy with `vocab_size` taken from the dataset's tokenizer when this config leaves it null.

        A preset that fixes its vocabulary (GPT-2's 50257) keeps it as long as every token id of the data fits.
        """
        check_positive("vocab_size", vocab_size)
        if self.vocab_size is None:
            return replace(self, vocab_size=vocab_size)
        if self.vocab_size < vocab_size:
            raise ConfigError(
                "vocab_size",
                f"{self.vocab_size} is smaller than the dataset's vocabulary ({vocab_size}); "
                f"set it to null or to at least {vocab_size}",
            )
        return replace(self)

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def hidden_dim(self) -> int:
        return self.ffn_dim or 4 * self.dim

    def resolve_padding(self, accelerator: str, *, tp_size: int = 1) -> ModelConfig:
        """A copy whose `pad_vocab_to_multiple` is set: the device default when this config leaves it null, at least
        `tp_size` when that is a power of two (tensor parallel splits the embedding and head rows evenly).

        On a GPU an output head with an odd row count (GPT-2's 50,257) falls off the tensor-core kernels: on an
        H100 it ran on sm75 cutlass kernels, about 26 ms per call at micro-batch 32, against sm90 kernels once padded
        to a multiple of 64 (measured 2026-11-25, see benchmarks/). On CPU padding only adds work.
        """
        if self.pad_vocab_to_multiple is not None:
            return replace(self)
        multiple = 1 if accelerator == "cpu" else ACCELERATOR_VOCAB_MULTIPLE
        if tp_size & (tp_size - 1) == 0:
            multiple = max(multiple, tp_size)
        return replace(self, pad_vocab_to_multiple=multiple)

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and output head (an unresolved padding counts as 1)."""
        if self.vocab_size is None:
            raise ValueError(
                "vocab_size is unresolved; call resolve_vocab() with the dataset's vocabulary first"
            )
        m = self.pad_vocab_to_multiple or 1
        return -(-self.vocab_size // m) * m
