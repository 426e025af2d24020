"""`import gaudi3_scale` registers our Lightning plugins ("hpu", "habana_ddp", "habana_fsdp", Gaudi defaults) in
every Lightning namespace, whichever is imported first and whenever.

A namespace already imported is registered at once; for one imported later, a finder at the front of
`sys.meta_path` lets the usual finder locate it and registers after the module has run. Nothing here imports torch
or Lightning: `import gaudi3_scale` stays light for the verbs that need neither.

Registering imports our own Lightning classes (`distributed.lightning_ns` and what it imports). A namespace is
often imported *by* one of those modules (`from gaudi3_scale import GaudiAccelerator` imports `gaudi_accelerator`,
which imports Lightning before it defines the class), so registering at that moment would import a half-run
module. The same finder therefore also wraps the execution of every `gaudi3_scale` module: registration waits
until none is running, and happens as the outermost one finishes, before the user's import statement returns.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType

__all__ = ["install"]

_NAMESPACES = (
    "lightning.pytorch",
    "pytorch_lightning",
)  # distributed.lightning_ns.NAMESPACES, without importing it
_PACKAGE = __name__.partition(".")[0]
_queue: list[str] = []
_registering = False
_running = 0  # gaudi3_scale modules executing right now (nested imports)


def _register(namespace: str) -> None:
    _queue.append(namespace)
    _flush()


def _flush() -> None:
    # Registering one namespace may import the other (our classes are built on lightning.pytorch): that one waits
    # in the queue until the first is done, instead of registering from inside a half-imported module.
    global _registering
    if _registering or _running:
        return
    _registering = True
    try:
        while _queue:
            from gaudi3_scale.distributed.lightning_ns import register_namespace

            name = _queue.pop(0)
            try:
                register_namespace(name)
            except Exception as exc:  # a failure must not break the user's `import pytorch_lightning`
                warnings.warn(f"gaudi3-scale could not register its plugins with {name}: {exc}", stacklevel=2)
    finally:
        _registering = False


def _run_own_module(exec_module: Callable[[ModuleType], None], module: ModuleType) -> None:
    global _running
    _running += 1
    try:
        exec_module(module)
    finally:
        _running -= 1
    _flush()  # only after a module ran to the end; a failed import leaves the queue for the next one


def _run_namespace(exec_module: Callable[[ModuleType], None], module: ModuleType) -> None:
    exec_module(module)
    _register(module.__name__)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname in _NAMESPACES:
            run = _run_namespace
        elif fullname.startswith(f"{_PACKAGE}."):
            run = _run_own_module
        else:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_register(module: ModuleType) -> None:
            run(exec_module, module)

        loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec


def install() -> None:
    if not any(isinstance(finder, _RegisterAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
    for namespace in _NAMESPACES:
        if namespace in sys.modules:
            _register(namespace)
