"""Our Lightning plugins in both Lightning namespaces, and Gaudi defaults for `Trainer(accelerator="hpu")`.

Lightning ships twice: `lightning.pytorch` and the standalone `pytorch_lightning`, each with its own class tree and
registries, and a Trainer of one refuses the other's strategies and precision plugins. `register_namespace` gives
a namespace:
- "hpu": `GaudiAccelerator` (for `pytorch_lightning` a virtual subclass of its Accelerator ABC);
- "habana_ddp" and "habana_fsdp": the hccl strategies built on that namespace's DDPStrategy and, for FSDP2, on its
  ModelParallelStrategy (one body each, `distributed.hpu.HCCLBody` and `distributed.fsdp.FSDP2Body`);
- on Gaudi, any other strategy refused in one line (Lightning's "ddp", "deepspeed", … would not use hccl);
- the defaults Lightning 2.6 no longer has for Gaudi (it raises "HPU is currently not supported" for "hpu" with
  strategy "auto", and its "bf16-mixed" autocasts on "cuda" for an accelerator it does not know): strategy "auto" is
  "habana_ddp" on several devices or nodes and a single-device strategy on hpu otherwise; precision "bf16-mixed",
  "bf16-true" and "32-true" is that namespace's `GaudiMixedPrecision`; other precisions are refused in one line;
- `plugins=[GaudiMixedPrecision(...)]` made for the other namespace (`gaudi3_scale.precision`'s is lightning.pytorch's)
  taken as it is: the object becomes this namespace's variant (`device.precision.rebase_precision_plugin`).
  These four are wrappers around private methods of Lightning's `_AcceleratorConnector` (2.6); the tests pin them.

`gaudi3_scale.lightning_hook` calls this for each namespace as it is imported. Not yet validated on Gaudi hardware.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from gaudi3_scale.config.errors import UserInputError, brief
from gaudi3_scale.device.gaudi_accelerator import GaudiAccelerator, register_gaudi_accelerator
from gaudi3_scale.device.precision import (
    PRECISIONS,
    GaudiMixedPrecision,
    gaudi_precision_class,
    rebase_precision_plugin,
)
from gaudi3_scale.distributed.fsdp import FSDP2Body
from gaudi3_scale.distributed.hpu import (
    HABANA_DDP,
    HABANA_FSDP,
    HCCLBody,
    HPUDDPStrategy,
    HPUFSDPStrategy,
    LazyModeSteps,
    SingleHPUStrategy,
    register_hpu_strategies,
)

__all__ = ["NAMESPACES", "NamespacePlugins", "plugins_for", "register_namespace"]

NAMESPACES = ("lightning.pytorch", "pytorch_lightning")
_PATCHED = "_gaudi3_scale_patched"


@dataclass(frozen=True)
class NamespacePlugins:
    """The classes a namespace's Trainer takes: `GaudiMixedPrecision` for `plugins=[...]`, the two strategies, and
    the one-HPU strategy the Trainer chooses for `devices=1`."""

    namespace: str
    ddp: type
    fsdp: type
    precision: type
    single: type


def _check_namespace(namespace: str) -> None:
    if namespace not in NAMESPACES:
        raise ValueError(f"unknown Lightning namespace {namespace!r}; allowed: {', '.join(NAMESPACES)}")


@functools.cache
def plugins_for(namespace: str) -> NamespacePlugins:
    _check_namespace(namespace)
    if namespace == NAMESPACES[0]:
        return NamespacePlugins(
            namespace, HPUDDPStrategy, HPUFSDPStrategy, GaudiMixedPrecision, SingleHPUStrategy
        )
    strategies = importlib.import_module(f"{namespace}.strategies")
    precision = importlib.import_module(f"{namespace}.plugins.precision")
    model_parallel = strategies.ModelParallelStrategy
    module = {"__module__": __name__}
    fsdp2 = type("FSDPStrategy", (FSDP2Body, model_parallel), {**module, "_model_parallel": model_parallel})
    return NamespacePlugins(
        namespace,
        ddp=type(
            "HPUDDPStrategy", (HCCLBody, strategies.DDPStrategy), {**module, "strategy_name": HABANA_DDP}
        ),
        fsdp=type("HPUFSDPStrategy", (HCCLBody, fsdp2), {**module, "strategy_name": HABANA_FSDP}),
        precision=gaudi_precision_class(precision.Precision, precision.HalfPrecision),
        single=type("SingleHPUStrategy", (LazyModeSteps, strategies.SingleDeviceStrategy), module),
    )


def register_namespace(namespace: str) -> None:
    """ "hpu", "habana_ddp", "habana_fsdp" and the Gaudi Trainer defaults in one namespace (idempotent)."""
    plugins = plugins_for(namespace)
    accelerators = importlib.import_module(f"{namespace}.accelerators")
    strategies = importlib.import_module(f"{namespace}.strategies")
    foreign = None if namespace == NAMESPACES[0] else accelerators.Accelerator
    register_gaudi_accelerator(accelerators.AcceleratorRegistry, foreign)
    register_hpu_strategies(strategies.StrategyRegistry, plugins.ddp, plugins.fsdp)
    connectors = importlib.import_module(f"{namespace}.trainer.connectors.accelerator_connector")
    _patch_connector(connectors._AcceleratorConnector, plugins, strategies.SingleDeviceStrategy)


def _patch_connector(connector: Any, plugins: NamespacePlugins, single_device: type) -> None:
    if getattr(connector, _PATCHED, False):
        return
    check_config = connector._check_config_and_set_final_flags
    choose_strategy = connector._choose_strategy
    check_strategy = connector._check_strategy_and_fallback
    init_precision = connector._check_and_init_precision

    def _check_config_and_set_final_flags(self: Any, **flags: Any) -> Any:
        given = flags.get("plugins")
        if isinstance(given, Iterable):
            given = flags["plugins"] = list(given)  # a generator would be empty when Lightning reads it next
        for plugin in given if isinstance(given, list) else [given]:
            rebase_precision_plugin(plugin, plugins.precision)
        return check_config(self, **flags)

    def _choose_strategy(self: Any) -> Any:
        if not isinstance(self.accelerator, GaudiAccelerator):
            return choose_strategy(self)
        if self._num_nodes_flag > 1 or len(self._parallel_devices) > 1:
            return HABANA_DDP
        return plugins.single(device=torch.device("hpu"))

    def _check_strategy_and_fallback(self: Any) -> Any:
        # On Gaudi only our hccl strategies and one device: Lightning's own "ddp", "ddp_spawn" or "deepspeed" would
        # take torch's default backend for "hpu" (gloo, or the no-op "fake" backend Lightning's FSDP import
        # registers) instead of hccl: replicas that never synchronise.
        flag = self._strategy_flag
        if isinstance(self.accelerator, GaudiAccelerator) and not (
            isinstance(flag, HCCLBody | single_device) or flag in (HABANA_DDP, HABANA_FSDP, "single_device")
        ):
            name = flag if isinstance(flag, str) else type(flag).__name__
            raise UserInputError(
                f"strategy: {brief(name)} does not run over HCCL on Gaudi (HPU); allowed: auto, {HABANA_DDP}, "
                f"{HABANA_FSDP}, single_device"
            )
        return check_strategy(self)

    def _check_and_init_precision(self: Any) -> Any:
        if not isinstance(self.accelerator, GaudiAccelerator) or self._precision_plugin_flag is not None:
            return init_precision(self)
        if self._precision_flag not in PRECISIONS:
            raise UserInputError(
                f"precision={self._precision_flag!r} is not supported on Gaudi (HPU); allowed: {', '.join(PRECISIONS)}"
            )
        return plugins.precision(self._precision_flag)

    connector._check_config_and_set_final_flags = _check_config_and_set_final_flags
    connector._choose_strategy = _choose_strategy
    connector._check_strategy_and_fallback = _check_strategy_and_fallback
    connector._check_and_init_precision = _check_and_init_precision
    setattr(connector, _PATCHED, True)
