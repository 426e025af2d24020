"""gaudi3-scale: train LLMs with one config from a 2-core laptop to multi-node GPU or Intel Gaudi clusters."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("gaudi3-scale")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0"

__all__ = ["GaudiAccelerator", "GaudiOptimizer", "__version__"]

# "hpu", "habana_ddp" and "habana_fsdp" in lightning.pytorch and pytorch_lightning, as soon as either is imported.
from gaudi3_scale.lightning_hook import install as _install_lightning_hook

_install_lightning_hook()


def __getattr__(name: str) -> object:
    # Lazy: `import gaudi3_scale` stays light (no torch, no Lightning).
    if name == "GaudiAccelerator":
        from gaudi3_scale.device.gaudi_accelerator import GaudiAccelerator

        return GaudiAccelerator
    if name == "GaudiOptimizer":
        from gaudi3_scale.device.optim import GaudiOptimizer

        return GaudiOptimizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
