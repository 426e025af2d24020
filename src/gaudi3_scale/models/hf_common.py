"""What the Hugging Face mappings (`models.hf`, `models.hf_bert`) share: layer-name splitting, config checks."""

from __future__ import annotations

from typing import Any

from gaudi3_scale.config.errors import UserInputError, brief
from gaudi3_scale.config.numbers import finite_number

__all__ = ["GPT2_ACTIVATIONS", "check_ints", "check_supported", "gpt2_activation", "split_layer", "typed"]

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
            raise UserInputError(f"{where}: {key} {brief(got)} is not supported (only {supported!r})")


def gpt2_activation(where: str, config: dict[str, Any], key: str, default: str) -> str:
    """Our `activation` for the HF activation name `config[key]` (GPT-2's and BERT's); one line for another name
    or a value that is not a name at all (a list is unhashable: a bare `in` raised TypeError)."""
    activation = config.get(key, default)
    if not isinstance(activation, str) or activation not in GPT2_ACTIVATIONS:
        raise UserInputError(
            f"{where}: {key} {brief(activation)} is not supported; allowed: {', '.join(GPT2_ACTIVATIONS)}"
        )
    return GPT2_ACTIVATIONS[activation]


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


def check_ints(
    where: str, config: dict[str, Any], keys: tuple[str, ...], what: str, *, optional: tuple[str, ...] = ()
) -> None:
    """Each of `keys` is an integer, each of `optional` an integer or null: 64.0 is a float to torch, which refuses
    it as a size deep inside a module's constructor."""
    for key in (*keys, *optional):
        value = config.get(key)
        if key in optional and value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            allowed = "an integer or null" if key in optional else "an integer"
            raise UserInputError(f"{where}: {key} is {brief(value)}; a {what} config needs {allowed} there")
