"""gaudi3-scale: train LLMs with one config from a 2-core laptop to multi-node GPU or Intel Gaudi clusters."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("gaudi3-scale")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0"

__all__ = ["__version__"]
