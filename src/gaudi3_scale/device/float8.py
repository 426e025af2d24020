"""FP8 training of the transformer's linear layers through torchao's float8 (`train.precision fp8`).

Why: an FP8 matmul moves and multiplies half the bytes of a BF16 one. The formats are E4M3 for weights and
activations and E5M2 for gradients (Micikevicius et al. 2022, "FP8 Formats for Deep Learning", arXiv:2209.05433).
torchao's `convert_to_float8_training` swaps each chosen `nn.Linear` for a `Float8Linear` that casts its input,
weight and output gradient to FP8 on the fly and multiplies with `torch._scaled_mm`; master weights, optimizer
state and every other op stay in high precision, so Lightning's bf16-mixed runs around it. Scales are dynamic:
taken from each tensor's current absolute maximum. "tensorwise" (one scale per tensor, cuBLAS kernel) is torchao's
default recipe and its fastest; "rowwise" (one scale per row, rounded to a power of two) is more accurate, and its
CUTLASS kernel is Hopper-only in PyTorch (sm_90, pytorch/pytorch#145728); "rowwise_with_gw_hp" is rowwise with the
weight gradient computed in high precision, the most accurate of torchao's recipes (its `Float8LinearRecipeName`).
The recipe, whether the output head is converted too and whether small linears stay in high precision are
`train.fp8_recipe`, `train.fp8_head` and `train.fp8_skip_small_linears`, carried to `apply_float8` by the run's
`ParallelPlan` as a `Float8Plan`.

FP8 tensor cores start at compute capability 8.9 (Ada, Hopper), the bound torchtitan checks too. On Gaudi 3 the FP8
and BF16 dense peaks are equal (1,835 TFLOP/s on Intel's spec sheet), so FP8 there would save memory and bandwidth,
not matmul peak; Gaudi's FP8 training goes through Intel Gaudi's Transformer Engine
(docs.habana.ai/en/latest/PyTorch/PyTorch_FP8_Training/), not torchao, and is not yet validated on Gaudi hardware,
so this option refuses hpu.

Order, as torchtitan applies it: `apply_float8` on the freshly built model (meta device is fine), then tensor
parallel, activation checkpointing, torch.compile and FSDP. torchao's casts are separate kernels in eager mode;
torch.compile fuses them, which is where the speed comes from.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

from gaudi3_scale.config.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

# torch is imported inside the functions: the run config types its `train.fp8_recipe` with `Float8Recipe`, and
# loading a config stays free of torch.

__all__ = [
    "FLOAT8_RECIPES",
    "SKIP_SMALL_RECIPES",
    "Float8Plan",
    "Float8Recipe",
    "apply_float8",
    "check_float8_supported",
    "convertible_linears",
    "float8_unsupported_reason",
]

# The values of torchao's Float8LinearRecipeName (torchao 0.18), in order of accuracy.
Float8Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]
FLOAT8_RECIPES: tuple[str, ...] = get_args(Float8Recipe)
# The recipes torchao has size thresholds for (`_auto_filter_for_recipe`, torchao 0.18: tensorwise skips a linear
# with in_features <= 4096 and out_features <= 1024; rowwise one with out <= 2048, in <= 1024, or out <= 4096 and
# in <= 2048), taken from its H100 GEMM tables (torchao/float8/README.md, "Performance"); none for rowwise_with_gw_hp.
SKIP_SMALL_RECIPES: tuple[str, ...] = ("tensorwise", "rowwise")

MIN_CAPABILITY = (8, 9)  # first compute capability with FP8 tensor cores (Ada)
_NO_TORCHAO = "fp8 training needs torchao: pip install 'gaudi3-scale[fp8]'"
_NEEDS_GPU = "fp8 training needs an NVIDIA GPU with compute capability >= 8.9 (Ada/Hopper or newer)"
# By default the head stays in high precision, as torchtitan's float8 configs keep it (filter_fqns ["output"]): its
# logits feed the softmax over the whole vocabulary, where FP8 rounding reaches the loss most directly; in GPT-2 its
# weight is also the token embedding (tied), which an embedding lookup reads, not a matmul. `head=True` converts it.
HEAD_NAME = "output"


@dataclass(frozen=True, kw_only=True)
class Float8Plan:
    """How `apply_float8` converts a model (`train.fp8_recipe`, `train.fp8_head`, whose defaults are the ones); a
    plan without one has no fp8."""

    recipe: Float8Recipe
    head: bool
    skip_small_linears: bool


def float8_unsupported_reason(device_type: str, *, device_index: int | None = None) -> str | None:
    """Why fp8 training cannot run on this device (one line, without the field name), or None when it can."""
    import torch

    if device_type == "hpu":
        return "fp8 through this option is not yet validated on Gaudi hardware; use bf16-mixed"
    if device_type != "cuda":
        return f"{_NEEDS_GPU}; allowed on {device_type}: 32-true, bf16-mixed, bf16-true"
    capability = torch.cuda.get_device_capability(device_index)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device_index)
        allowed = "bf16-mixed, bf16-true, 32-true" if torch.cuda.is_bf16_supported() else "16-mixed, 32-true"
        return f"{_NEEDS_GPU}; {name} has {capability[0]}.{capability[1]}; allowed here: {allowed}"
    return _NO_TORCHAO if _import_float8() is None else None


def check_float8_supported(device_type: str, *, device_index: int | None = None) -> None:
    """Refuse `train.precision fp8` where it cannot run: one line naming the field (exit code 2 in the CLI)."""
    reason = float8_unsupported_reason(device_type, device_index=device_index)
    if reason is not None:
        raise ConfigError("train.precision", reason)


def apply_float8(
    model: nn.Module, *, recipe: str = "tensorwise", head: bool = False, skip_small_linears: bool = False
) -> int:
    """Swap the eligible `nn.Linear` layers of `model` for torchao's `Float8Linear`, in place; how many were swapped.

    `recipe` is one of torchao's recipe names (`Float8LinearConfig.from_recipe_name`). Skipped: the output head
    (`output`) unless `head`, every linear whose in or out features are not multiples of 16 (what
    `torch._scaled_mm` requires), and with `skip_small_linears` every linear torchao's size thresholds for the
    recipe expect to be slower in fp8 than in bf16 (the casts cost more than the faster GEMM saves; e.g. the
    key/value projections of Llama 3.2 1B, 2048 -> 512, under tensorwise). Layers already swapped are left alone,
    so a second call returns 0. `Float8Linear` keeps the very `weight` and `bias` Parameters, so state-dict keys,
    weight tying and checkpoints stay exactly those of a bf16 run. Call it before activation checkpointing,
    torch.compile and FSDP.
    """
    if recipe not in FLOAT8_RECIPES:
        raise ValueError(f"float8 recipe {recipe!r} is not one of {', '.join(FLOAT8_RECIPES)}")
    if skip_small_linears and recipe not in SKIP_SMALL_RECIPES:
        raise ValueError(f"torchao has no size thresholds for the float8 recipe {recipe!r}")
    float8 = _import_float8()
    if float8 is None:
        raise ConfigError("train.precision", _NO_TORCHAO)
    # torchao's filter for the recipe, with no names of its own to skip: it says False for a linear it expects to
    # be slower in fp8 (and for one that is not an nn.Linear or whose sizes are not multiples of 16).
    fast_in_fp8 = float8._auto_filter_for_recipe(recipe, filter_fqns=[]) if skip_small_linears else None
    eligible = {
        name
        for name, module in convertible_linears(model, head=head)
        if fast_in_fp8 is None or fast_in_fp8(module, name)
    }
    if eligible:
        float8.convert_to_float8_training(
            model,
            config=float8.Float8LinearConfig.from_recipe_name(recipe),
            module_filter_fn=lambda module, name: name in eligible,
        )
    return len(eligible)


def convertible_linears(model: nn.Module, *, head: bool) -> Iterator[tuple[str, nn.Linear]]:
    """(name, linear) of every layer `apply_float8` may convert, before torchao's size thresholds: exactly
    `nn.Linear` (a Float8Linear, a subclass, is already converted; other subclasses are not ours), the head only with
    `head`, in and out features multiples of 16 (what `torch._scaled_mm` requires)."""
    from torch import nn

    for name, module in model.named_modules():
        if type(module) is nn.Linear and (head or name != HEAD_NAME) and _fits_scaled_mm(module):
            yield name, module


def _fits_scaled_mm(linear: nn.Linear) -> bool:
    return linear.in_features % 16 == 0 and linear.out_features % 16 == 0


def _import_float8() -> Any | None:
    """`torchao.float8`, imported on first use (the `fp8` extra); None when torchao is not installed."""
    try:
        import torchao.float8
    except ImportError:
        return None
    return torchao.float8
