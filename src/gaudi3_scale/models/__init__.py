"""Model zoo, single-device model code, parameter/FLOPs counting and sampling."""

from gaudi3_scale.models.config import ModelConfig
from gaudi3_scale.models.counting import count_parameters, flops_per_token, forward_flops_per_token
from gaudi3_scale.models.generate import generate
from gaudi3_scale.models.registry import get_model_config, list_models, register_model
from gaudi3_scale.models.transformer import Transformer, TransformerBlock, build_model

__all__ = [
    "ModelConfig",
    "Transformer",
    "TransformerBlock",
    "build_model",
    "count_parameters",
    "flops_per_token",
    "forward_flops_per_token",
    "generate",
    "get_model_config",
    "list_models",
    "register_model",
]
