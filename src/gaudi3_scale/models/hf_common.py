"""What the Hugging Face mappings (`models.hf`, `models.hf_bert`) share: layer-name splitting, config checks."""

from __future__ import annotations

from typing import Any

from gaudi3_scale.config.errors import UserInputError, brief
from gaudi3_scale.config.numbers import finite_number

__all__ = ["GPT2_ACTIVATIONS", "check_ints", "check_supported", "split_layer", "typed"]

GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def split_layer(module: str) -> tuple[str, str]:
    """`layers.3.attention.wq` → ("3", "attention.wq"); a top-level module → ("", module)."""
    if module.startswith("layers."):
        _, index, inner = module.split(".", 2)
        return index, inner
    return "", module


def check_supported(where: str, differences: dict[str, tuple[Any, Any]]) -> None:
    for key, (got, supported) in differences.items():
        if got != supported:
            raise UserInputError(f"{where}: {key} {got!r} is not supported (only {supported!r})")


_KINDS = {bool: "true or false", dict: "an object", float: "a finite number"}


def typed(where: str, config: dict[str, Any], key: str, default: Any, kind: type) -> Any:
    """`config[key]`, or `default` when absent or null; a value of another JSON type is one line (bool("false") is
    true, float([1]) raises: neither may reach the model's config)."""
    value = config.get(key)
    if value is None:
        return default
    checked = finite_number(value) if kind is float else value if isinstance(value, kind) else None
    if checked is None:
        raise UserInputError(f"{where}: {key} is {brief(value)}; a config.json has {_KINDS[kind]} there")
    return checked


def check_ints(where: str, config: dict[str, Any], keys: tuple[str, ...], what: str) -> None:
    for key in keys:
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool):
            raise UserInputError(f"{where}: {key} is {value!r}; a {what} config needs an integer there")
