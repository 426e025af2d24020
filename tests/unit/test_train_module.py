"""LanguageModel's attribute fast path leaves the module exactly as nn.Module.__setattr__ would."""

from __future__ import annotations

import inspect
import types
from typing import Any

import pytest
import torch
from torch import nn

from gaudi3_scale.models import get_model_config
from gaudi3_scale.train.module import _PLAIN_ATTRS, LanguageModel
from gaudi3_scale.train.optim_config import OptimConfig

CFG = get_model_config("shakespeare-char").resolve_vocab(65)


def _module() -> LanguageModel:
    return LanguageModel(CFG, OptimConfig(), max_steps=10)


def _state(module: nn.Module) -> dict[str, Any]:
    # Objects each module owns (its step state, its gradient sync) compare by type: two modules never share them.
    owned = ("step_state", "_sync")
    return {
        "plain": {
            k: type(v) if k in owned else v
            for k, v in vars(module).items()
            if k not in ("_parameters", "_buffers", "_modules")
        },
        **{name: dict(vars(module)[name]) for name in ("_parameters", "_buffers", "_modules")},
    }


@pytest.mark.parametrize(
    ("name", "value"),
    [("_current_fx_name", "training_step"), ("_current_fx_name", None)],
)
def test_plain_attributes_land_where_nn_module_puts_them(name: str, value: Any) -> None:
    fast, reference = _module(), _module()
    setattr(fast, name, value)
    nn.Module.__setattr__(reference, name, value)
    assert vars(fast)[name] is value
    assert _state(fast) == _state(reference)


def test_fast_path_names_have_no_descriptor_on_the_class() -> None:
    # The fast path stores into __dict__, which is what object.__setattr__ does only without a data descriptor.
    for name in _PLAIN_ATTRS:
        assert not any(name in vars(cls) for cls in LanguageModel.__mro__)


def test_other_values_and_names_take_nn_modules_path() -> None:
    module = _module()
    module._current_fx_name = "training_step"
    del module._current_fx_name
    module.register_buffer("_current_fx_name", torch.zeros(()))
    module._current_fx_name = torch.ones(())  # a registered buffer stays a buffer
    assert torch.equal(module._buffers["_current_fx_name"], torch.ones(()))
    del module._current_fx_name
    module._current_fx_name = nn.Linear(2, 2)  # a submodule, whatever its name
    assert "_current_fx_name" in module._modules and "_current_fx_name" not in vars(module)
    module.last_loss = nn.Parameter(torch.ones(2))
    assert "last_loss" in module._parameters and "last_loss" not in vars(module)


def test_preset_training_step_signature_is_the_real_one() -> None:
    # Lightning reads it every step (inspect.getfullargspec); the preset must be what inspect would compute.
    fn = LanguageModel.training_step
    bare = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    bare.__annotations__ = fn.__annotations__
    assert inspect.signature(fn) == inspect.signature(bare)
    assert inspect.getfullargspec(_module().training_step) == inspect.getfullargspec(bare)
