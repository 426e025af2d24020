"""Public home of the Gaudi precision plugin: `from gaudi3_scale.precision import GaudiMixedPrecision`."""

from gaudi3_scale.device.precision import GaudiMixedPrecision

__all__ = ["GaudiMixedPrecision"]
