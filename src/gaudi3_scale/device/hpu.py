"""Intel Gaudi (HPU) runtime: availability, documented environment variables, lazy-mode step marking.

This module and `device/gaudi_accelerator.py` are the only places that import `habana_frameworks`; every import is
inside a function, so nothing Habana is needed off Gaudi. Not yet validated on Gaudi hardware.
"""

from __future__ import annotations

import os
from typing import Any

from gaudi3_scale.config.errors import UserInputError

__all__ = [
    "DOCUMENTED_HPU_ENV",
    "HPU_COMPILE_BACKEND",
    "apply_hpu_environment",
    "apply_hpu_graphs",
    "hpu_available",
    "hpu_device_count",
    "hpu_environment",
    "load_hccl",
    "mark_step",
    "require_hpu",
    "torch_hpu",
]

# Only variables Habana documents (docs.habana.ai "Runtime Environment Variables"; "Run Inference Using HPU Graphs"),
# and PT_HPU_MAX_COMPOUND_OP_SIZE, which the bridge prints in its "HABANA PT BRIDGE CONFIGURATION" and Intel's
# optimum-habana READMEs set. Internal bridge flags (PT_HPU_POOL_STRATEGY, PT_HPU_ENABLE_WEIGHT_CPU_PERMUTE: in the
# bridge's source, not in its documentation) are never set, nor invented names
# such as PT_HPU_ENABLE_LAZY_COMPILATION or PT_HPU_GRAPH_COMPILER_OPT_LEVEL. Not yet validated on Gaudi hardware.
# torch.compile's backend on Gaudi: Habana's graph compiler, registered with TorchDynamo when habana_frameworks.torch
# is imported (docs.habana.ai "Getting Started with Training on Intel Gaudi", its eager-mode + torch.compile
# example: `torch.compile(model, backend="hpu_backend")`; Hugging Face's TrainingArguments pick it on HPU). Inductor,
# the default backend, generates Triton or C++ kernels, which Gaudi does not run. Not yet validated on Gaudi hardware.
HPU_COMPILE_BACKEND = "hpu_backend"

DOCUMENTED_HPU_ENV = {
    "PT_HPU_LAZY_MODE": "1 = lazy (legacy) mode, 0 = eager + torch.compile (default in current releases)",
    "PT_HPU_ENABLE_LAZY_COLLECTIVES": "required for HPU graphs with multi-card collectives",
    "PT_HPU_MAX_COMPOUND_OP_SIZE": "upper bound on ops fused into one graph (integer; printed by the bridge)",
}


def hpu_environment(
    *,
    lazy_mode: bool = False,
    lazy_collectives: bool | None = None,
    max_compound_op_size: int | None = None,
) -> dict[str, str]:
    """The Habana variables for a run; unset options are left to the runtime's defaults."""
    env = {"PT_HPU_LAZY_MODE": "1" if lazy_mode else "0"}
    if lazy_collectives is not None:
        env["PT_HPU_ENABLE_LAZY_COLLECTIVES"] = "true" if lazy_collectives else "false"
    if max_compound_op_size is not None:
        env["PT_HPU_MAX_COMPOUND_OP_SIZE"] = str(int(max_compound_op_size))
    assert set(env) <= set(DOCUMENTED_HPU_ENV)
    return env


def apply_hpu_environment(env: dict[str, str]) -> None:
    """Set the variables before habana_frameworks is imported; values the user exported win."""
    for key, value in env.items():
        os.environ.setdefault(key, value)


def _import_core() -> Any:
    import habana_frameworks.torch.core as htcore

    return htcore


def torch_hpu() -> Any:
    """`torch.hpu`, which habana_frameworks attaches to torch on import (so type checkers do not know it)."""
    import torch

    return getattr(torch, "hpu")  # noqa: B009


def hpu_available() -> bool:
    try:
        _import_core()
        return bool(torch_hpu().is_available())
    except (ImportError, AttributeError, RuntimeError):
        return False


def require_hpu() -> None:
    if not hpu_available():
        raise UserInputError(
            "Gaudi (HPU) was requested but no HPU is usable here (habana_frameworks is not installed or sees no "
            "device); allowed here: cpu" + (", cuda" if _cuda() else "")
        )


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def hpu_device_count() -> int:
    if not hpu_available():
        return 0
    return int(torch_hpu().device_count())


def load_hccl() -> None:
    """Register the `hccl` process-group backend with torch.distributed."""
    require_hpu()
    import habana_frameworks.torch.distributed.hccl  # noqa: F401


def mark_step() -> None:
    """In lazy mode, cut the accumulated graph here and run it (no-op in eager mode)."""
    if os.environ.get("PT_HPU_LAZY_MODE", "0") == "1":
        _import_core().mark_step()


def apply_hpu_graphs(model: Any, *, max_graphs: int = 10) -> None:
    """Record the model's graphs once and replay them each step (HPU graphs), cutting host overhead in lazy mode.

    Uses `habana_frameworks.torch.hpu.ModuleCacher`, the API Habana recommends for training (docs.habana.ai,
    "HPU Graphs for Training"; HPU graphs run in lazy mode only). Not yet validated on Gaudi hardware.
    """
    require_hpu()
    if os.environ.get("PT_HPU_LAZY_MODE") != "1":
        raise UserInputError(
            "train.hpu_graphs needs lazy mode (PT_HPU_LAZY_MODE=1): Habana runs HPU graphs in lazy mode only"
        )
    import habana_frameworks.torch as ht

    ht.hpu.ModuleCacher(max_graphs=max_graphs)(model=model, inplace=True)
