"""gaudi3-scale: train LLMs with one config from a 2-core laptop to multi-node GPU or Intel Gaudi clusters."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("gaudi3-scale")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0"

__all__ = ["GaudiAccelerator", "GaudiOptimizer", "__version__"]


def __getattr__(name: str) -> object:
    # Lazy: `import gaudi3_scale` stays light; the first use registers "hpu" and "habana_ddp" with Lightning.
    if name == "GaudiAccelerator":
        from gaudi3_scale.device.gaudi_accelerator import GaudiAccelerator, register_gaudi_accelerator
        from gaudi3_scale.distributed.hpu import register_hpu_strategies

        register_gaudi_accelerator()
        register_hpu_strategies()
        return GaudiAccelerator
    if name == "GaudiOptimizer":
        from gaudi3_scale.device.optim import GaudiOptimizer

        return GaudiOptimizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
