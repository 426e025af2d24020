"""`GaudiMixedPrecision`: Lightning precision plugin that autocasts to bf16 on the device the model is on.

Lightning's own `precision="bf16-mixed"` autocasts on "cuda" for every accelerator it does not know (Lightning 2.6
`_AcceleratorConnector._check_and_init_precision`: `device = accelerator if accelerator in ("cpu", "mps") else
"cuda"`), so on Gaudi the hpu ops would stay in fp32. This plugin reads the device from the model when the forward pass starts: `torch.autocast("hpu",
torch.bfloat16)` on Gaudi, as Habana documents ("Mixed Precision Training with PyTorch Autocast",
docs.habana.ai/en/latest/PyTorch/PyTorch_Mixed_Precision/), and the same on "cpu" or "cuda" elsewhere, so one
config trains everywhere. Not yet validated on Gaudi hardware.

Kernel options: Habana ships fused kernels for attention (`habana_frameworks.torch.hpex.kernels.FusedSDPA`, whose
flash-style recompute mode `habana_frameworks.torch.hpu.sdp_kernel(enable_recompute=True)` selects) and rotary
embeddings (`habana_frameworks.torch.hpex.kernels.RotaryPosEmbeddingHelperV1/V2/V3`, `apply_rotary_pos_emb`); read in
`hpex/kernels/__init__.py` and `hpu/__init__.py` of the habana_frameworks package. They replace calls inside the model's attention, which a
precision plugin cannot reach, and it is not confirmed that `torch.nn.functional.scaled_dot_product_attention` (what
`models/common/attention.py` calls) dispatches to FusedSDPA on HPU: Habana's GPU-migration layer swaps it for
FusedSDPA explicitly. So `use_fused_rope` and `use_flash_attention_v2` only record the request and warn that they have
no effect yet. `optimize_bmm` has no Habana switch we could confirm; bmm already runs in bf16 under autocast on hpu,
cpu and cuda (it is on each device's lower-precision op list), so it too only records the request.
"""

from __future__ import annotations

import itertools
from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, ClassVar, Literal, get_args

import torch
from lightning.fabric.utilities.rank_zero import WarningCache
from lightning.pytorch.plugins.precision import HalfPrecision, Precision
from torch import nn

__all__ = ["PRECISIONS", "GaudiMixedPrecision", "gaudi_precision_class"]

# The body below is shared by the plugin of each Lightning namespace (`lightning.pytorch`, `pytorch_lightning`):
# a mixin, typed against lightning.pytorch's Precision for the checker only.
if TYPE_CHECKING:
    _PrecisionBase = Precision
else:
    _PrecisionBase = object

GaudiPrecision = Literal["bf16-mixed", "bf16-true", "32-true"]
PRECISIONS: tuple[str, ...] = get_args(GaudiPrecision)

# One warning per option per process (Lightning's rank-zero de-duplicating cache; each message is fixed per option).
_WARNINGS = WarningCache()

_NO_EFFECT_YET = {
    "optimize_bmm": (
        "GaudiMixedPrecision(optimize_bmm=True) has no effect: bmm already runs in bf16 under autocast on hpu, cpu "
        "and cuda, and no separate Habana switch for it is known"
    ),
    "use_fused_rope": (
        "GaudiMixedPrecision(use_fused_rope=True) has no effect yet: the model's rotary embedding does not call "
        "Habana's fused RoPE kernel, and a precision plugin cannot swap it in"
    ),
    "use_flash_attention_v2": (
        "GaudiMixedPrecision(use_flash_attention_v2=True) has no effect yet: the plugin does not choose attention "
        "kernels (on cuda, torch's scaled_dot_product_attention already picks FlashAttention-2 when the inputs allow)"
    ),
}


class _GaudiPrecisionBody(_PrecisionBase):
    """bf16 autocast on the model's device (hpu, cuda or cpu); also "bf16-true" and "32-true".

    `cache_fp32_weights` is torch.autocast's `cache_enabled`: within one forward pass, each fp32 weight is cast to
    bf16 once and the copy reused. Lightning's own MixedPrecision turns it off, so the default matches Lightning.
    """

    _half_precision: ClassVar[type[HalfPrecision]]  # the namespace's HalfPrecision, for "bf16-true"

    def __init__(
        self,
        precision: GaudiPrecision = "bf16-mixed",
        *,
        optimize_bmm: bool = False,
        use_fused_rope: bool = False,
        use_flash_attention_v2: bool = False,
        cache_fp32_weights: bool = False,
    ) -> None:
        if precision not in PRECISIONS:
            raise ValueError(
                f"GaudiMixedPrecision(precision={precision!r}) is not supported; allowed: {', '.join(PRECISIONS)}"
            )
        self.precision = precision
        self.optimize_bmm = optimize_bmm
        self.use_fused_rope = use_fused_rope
        self.use_flash_attention_v2 = use_flash_attention_v2
        self.cache_fp32_weights = cache_fp32_weights
        # bf16-true is exactly Lightning's HalfPrecision; reuse it rather than copy it.
        self._half = self._half_precision("bf16-true") if precision == "bf16-true" else None
        self._module: nn.Module | None = None
        for option, message in _NO_EFFECT_YET.items():
            if getattr(self, option):
                _WARNINGS.warn(message)
        if cache_fp32_weights and precision != "bf16-mixed":
            _WARNINGS.warn(
                "GaudiMixedPrecision(cache_fp32_weights=True) has no effect unless precision='bf16-mixed': "
                "only autocast casts fp32 weights"
            )

    def convert_module(self, module: nn.Module) -> nn.Module:
        # Lightning calls this before moving the model to its device; the device is read again at each forward.
        self._module = module
        return self._half.convert_module(module) if self._half else module

    def autocast_device_type(self) -> str:
        """The device type autocast runs on: that of the model's first parameter or buffer ("hpu", "cuda", "cpu")."""
        if self._module is None:
            raise RuntimeError(
                "GaudiMixedPrecision does not know the model yet; pass it to a Lightning Trainer "
                "(plugins=[GaudiMixedPrecision()]) or call convert_module(model) first"
            )
        for tensor in itertools.chain(self._module.parameters(), self._module.buffers()):
            return tensor.device.type
        return "cpu"

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.precision == "bf16-mixed":
            device_type = self.autocast_device_type()
            with torch.autocast(device_type, dtype=torch.bfloat16, cache_enabled=self.cache_fp32_weights):
                yield
        elif self._half is not None:
            with self._half.forward_context():
                yield
        else:
            yield

    def tensor_init_context(self) -> AbstractContextManager[Any]:
        return self._half.tensor_init_context() if self._half else nullcontext()

    def module_init_context(self) -> AbstractContextManager[Any]:
        return self._half.module_init_context() if self._half else nullcontext()

    def convert_input(self, data: Any) -> Any:
        return self._half.convert_input(data) if self._half else data


class GaudiMixedPrecision(_GaudiPrecisionBody, Precision):
    __doc__ = _GaudiPrecisionBody.__doc__
    _half_precision = HalfPrecision


def gaudi_precision_class(precision_base: type, half_precision: type) -> type:
    """The plugin for another Lightning namespace (`pytorch_lightning`): the same body on that namespace's
    `Precision`, so that namespace's Trainer accepts it."""
    return type(
        "GaudiMixedPrecision",
        (_GaudiPrecisionBody, precision_base),
        {"_half_precision": half_precision, "__doc__": _GaudiPrecisionBody.__doc__, "__module__": __name__},
    )
