"""`GaudiMixedPrecision`: Lightning precision plugin that autocasts to bf16 on the device the model is on.

Lightning's own `precision="bf16-mixed"` autocasts on "cuda" for every accelerator it does not know (Lightning 2.6
`_AcceleratorConnector._check_and_init_precision`: `device = accelerator if accelerator in ("cpu", "mps") else
"cuda"`), so on Gaudi the hpu ops would stay in fp32. This plugin reads the device from the model when the forward pass starts: `torch.autocast("hpu",
torch.bfloat16)` on Gaudi, as Habana documents ("Mixed Precision Training with PyTorch Autocast",
docs.habana.ai/en/latest/PyTorch/PyTorch_Mixed_Precision/), and the same on "cpu" or "cuda" elsewhere, so one
config trains everywhere. Not yet validated on Gaudi hardware.

Kernel options of the seed's API:
- `use_flash_attention_v2=True` restricts `torch.nn.functional.scaled_dot_product_attention` (what
  `models/common/attention.py` calls) to its flash backend during the forward pass (`torch.nn.attention.sdpa_kernel`):
  FlashAttention-2 on cuda, torch's flash kernel on cpu. Where flash cannot run (fp32 inputs on cuda, dropout on cpu)
  torch refuses the call ("No available kernel") instead of quietly using another kernel. On hpu it is refused in one
  line: it is not confirmed that torch's scaled_dot_product_attention reaches Habana's FusedSDPA (Habana's
  GPU-migration layer swaps it in explicitly), and FusedSDPA is not among the Habana APIs this project relies on.
- `use_fused_rope=True` and `optimize_bmm=True` are refused in one line. No fused RoPE kernel is wired on any device
  (the models rotate with their own code, `models/common/rope.py`, and a precision plugin cannot reach inside
  them); bmm already runs in bf16 under autocast on hpu, cpu and cuda (it is on each device's lower-precision op
  list) and no separate Habana switch for it is known.
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
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["PRECISIONS", "GaudiMixedPrecision", "gaudi_precision_class", "rebase_precision_plugin"]

# The body below is shared by the plugin of each Lightning namespace (`lightning.pytorch`, `pytorch_lightning`):
# a mixin, typed against lightning.pytorch's Precision for the checker only.
if TYPE_CHECKING:
    _PrecisionBase = Precision
else:
    _PrecisionBase = object

GaudiPrecision = Literal["bf16-mixed", "bf16-true", "32-true"]
PRECISIONS: tuple[str, ...] = get_args(GaudiPrecision)

# One warning per message per process (Lightning's rank-zero de-duplicating cache).
_WARNINGS = WarningCache()

_REFUSED = {
    "optimize_bmm": (
        "GaudiMixedPrecision(optimize_bmm=True) is not supported: there is nothing to switch on (bmm already runs in "
        "bf16 under autocast on hpu, cpu and cuda, and no separate Habana switch for it is known); leave it False"
    ),
    "use_fused_rope": (
        "GaudiMixedPrecision(use_fused_rope=True) is not supported: no fused RoPE kernel is wired on any device (the "
        "models rotate with their own code, models/common/rope.py); leave it False"
    ),
}


class _GaudiPrecisionBody(_PrecisionBase):
    """bf16 autocast on the model's device (hpu, cuda or cpu); also "bf16-true" and "32-true".

    `use_flash_attention_v2` runs attention on torch's flash kernel (FlashAttention-2 on cuda; cuda and cpu only).
    `cache_fp32_weights` is torch.autocast's `cache_enabled`: within one forward pass, each fp32 weight is cast to
    bf16 once and the copy reused. Lightning's own MixedPrecision turns it off, so the default matches Lightning.
    `optimize_bmm` and `use_fused_rope` are the seed's names, kept so False still works; True is refused.
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
        for option, requested in (("optimize_bmm", optimize_bmm), ("use_fused_rope", use_fused_rope)):
            if requested:
                raise ValueError(_REFUSED[option])
        self.precision = precision
        self.use_flash_attention_v2 = use_flash_attention_v2
        self.cache_fp32_weights = cache_fp32_weights
        # bf16-true is exactly Lightning's HalfPrecision; reuse it rather than copy it.
        self._half = self._half_precision("bf16-true") if precision == "bf16-true" else None
        self._module: nn.Module | None = None
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
        """The device type autocast runs on: the model's accelerator ("hpu", "cuda"), i.e. the first parameter or
        buffer not on the CPU, else "cpu". Not simply the first parameter: under FSDP2 CPU offload
        (parallel.offload all) the parameter shards live on the host while the forward runs on the device that holds
        the buffers."""
        if self._module is None:
            raise RuntimeError(
                "GaudiMixedPrecision does not know the model yet; pass it to a Lightning Trainer "
                "(plugins=[GaudiMixedPrecision()]) or call convert_module(model) first"
            )
        for tensor in itertools.chain(self._module.parameters(), self._module.buffers()):
            if tensor.device.type != "cpu":
                return tensor.device.type
        return "cpu"

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with self._attention_context(), self._precision_context():
            yield

    def _precision_context(self) -> AbstractContextManager[Any]:
        if self.precision == "bf16-mixed":
            device_type = self.autocast_device_type()
            return torch.autocast(device_type, dtype=torch.bfloat16, cache_enabled=self.cache_fp32_weights)
        return self._half.forward_context() if self._half else nullcontext()

    def _attention_context(self) -> AbstractContextManager[Any]:
        if not self.use_flash_attention_v2:
            return nullcontext()
        device_type = self.autocast_device_type()
        if device_type not in ("cuda", "cpu"):
            raise ValueError(
                f"GaudiMixedPrecision(use_flash_attention_v2=True) is not supported on {device_type}: the model calls "
                "torch's scaled_dot_product_attention, whose flash backend exists on cuda and cpu only (Habana's "
                "FusedSDPA is not wired); allowed on: cuda, cpu"
            )
        if device_type == "cuda" and self.precision == "32-true":
            raise ValueError(
                "GaudiMixedPrecision(use_flash_attention_v2=True) needs bf16 on cuda (FlashAttention-2 takes no fp32); "
                "allowed with precision: bf16-mixed, bf16-true"
            )
        return sdpa_kernel(SDPBackend.FLASH_ATTENTION)

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


def rebase_precision_plugin(plugin: object, precision_class: type) -> None:
    """Make a GaudiMixedPrecision built for another Lightning namespace an instance of `precision_class` (this
    namespace's, from `gaudi_precision_class`), so this namespace's Trainer takes the very object the user made.

    `pytorch_lightning`'s Precision is a plain class, not an ABC like its Accelerator (GaudiAccelerator is registered
    as a virtual subclass there), so the object's class changes instead: the variants share one body and one
    instance layout, and the `HalfPrecision` a "bf16-true" plugin holds only calls torch. Anything else is left as is.
    """
    if isinstance(plugin, _GaudiPrecisionBody) and not isinstance(plugin, precision_class):
        plugin.__class__ = precision_class
