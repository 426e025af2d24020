"""`GaudiOptimizer.FusedAdamW`: Habana's fused AdamW for parameters on Gaudi, torch's AdamW kernels elsewhere.

Habana's kernel is `habana_frameworks.torch.hpex.optimizers.FusedAdamW` (docs.habana.ai "Fused Optimizers and Custom
Ops for Intel Gaudi", PyTorch/Model_Optimization_PyTorch/Custom_Ops_PyTorch.html; exported by
`hpex/optimizers/__init__.py` of the habana_frameworks package). Its constructor takes `params, lr, betas, eps,
weight_decay, bias_correction, moments_dtype`. Not yet validated on Gaudi hardware.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import WarningCache

from gaudi3_scale.device.hpu import hpu_available

__all__ = ["GaudiOptimizer"]

# Habana's FusedAdamW defaults to eps=1e-6 and weight_decay=0.0 (hpex/optimizers/FusedAdamW.py), torch's AdamW to
# 1e-8 and 1e-2: the same call would train differently on Gaudi, so both get torch's values unless the caller sets them.
_TORCH_ADAMW_DEFAULTS: dict[str, Any] = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}

# Device types torch has a fused AdamW kernel for that we use (cpu since torch 2.4).
_TORCH_FUSED_DEVICE_TYPES = frozenset({"cpu", "cuda"})

_WARNINGS = WarningCache()  # each message once per process, on rank 0


def _materialize(params: Iterable[Any]) -> list[Any]:
    """A list of the optimizer's params with each group's "params" a list, so they can be read twice."""
    items = []
    for item in params:
        if isinstance(item, dict):
            group = item["params"]
            item = {**item, "params": [group] if isinstance(group, torch.Tensor) else list(group)}
        items.append(item)
    return items


def _device_types(items: list[Any]) -> set[str]:
    types = set()
    for item in items:
        for entry in item["params"] if isinstance(item, dict) else [item]:
            # torch also accepts (name, parameter) pairs
            tensor = entry[1] if isinstance(entry, tuple) else entry
            if isinstance(tensor, torch.Tensor):
                types.add(tensor.device.type)
    return types


class GaudiOptimizer:
    """Optimizers that use Habana's fused kernels on Gaudi and fall back to torch's elsewhere."""

    @staticmethod
    def FusedAdamW(
        params: Iterable[Any], lr: float = 1e-3, use_habana: bool = True, **adamw_kwargs: Any
    ) -> torch.optim.Optimizer:
        """AdamW with decoupled weight decay; `adamw_kwargs` go to the optimizer that is built.

        Habana's FusedAdamW when every parameter is on hpu and `use_habana` is set; otherwise
        `torch.optim.AdamW`, with `fused=True` when all parameters are on cpu/cuda and `foreach=True` otherwise
        (unless the caller passes `fused` or `foreach`).
        """
        items = _materialize(params)
        device_types = _device_types(items)
        if use_habana and device_types == {"hpu"}:
            from habana_frameworks.torch.hpex.optimizers import FusedAdamW

            kwargs = {**_TORCH_ADAMW_DEFAULTS, **adamw_kwargs}
            optimizer: torch.optim.Optimizer = FusedAdamW(items, lr=lr, **kwargs)
            return optimizer
        if use_habana:
            where = "parameters are not on hpu" if hpu_available() else "no Gaudi (HPU) is usable here"
            _WARNINGS.warn(f"GaudiOptimizer.FusedAdamW(use_habana=True): {where}; using torch.optim.AdamW")
        if "fused" not in adamw_kwargs and "foreach" not in adamw_kwargs:
            fused = bool(device_types) and device_types <= _TORCH_FUSED_DEVICE_TYPES
            adamw_kwargs["fused" if fused else "foreach"] = True
        return torch.optim.AdamW(items, lr=lr, **adamw_kwargs)
