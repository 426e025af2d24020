"""Model zoo, single-device model code, parameter/FLOPs counting and sampling (`models.generate.generate`: the
function shares its module's name, so it is imported from the module).

The config and the registry load at once; the torch pieces (the transformer, counting, sampling) on first access,
so configs resolve without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gaudi3_scale.lazy import lazy_exports
from gaudi3_scale.models.config import ModelConfig
from gaudi3_scale.models.registry import get_model_config, list_models, register_model

if TYPE_CHECKING:
    from gaudi3_scale.models.build import build_model
    from gaudi3_scale.models.counting import count_parameters, flops_per_token, forward_flops_per_token
    from gaudi3_scale.models.transformer import Transformer, TransformerBlock

__all__ = [
    "ModelConfig",
    "Transformer",
    "TransformerBlock",
    "build_model",
    "count_parameters",
    "flops_per_token",
    "forward_flops_per_token",
    "get_model_config",
    "list_models",
    "register_model",
]

_LAZY = {
    "count_parameters": "gaudi3_scale.models.counting",
    "flops_per_token": "gaudi3_scale.models.counting",
    "forward_flops_per_token": "gaudi3_scale.models.counting",
    "Transformer": "gaudi3_scale.models.transformer",
    "TransformerBlock": "gaudi3_scale.models.transformer",
    "build_model": "gaudi3_scale.models.build",
}

__getattr__ = lazy_exports(__name__, _LAZY)
