"""Public home of the batch-size finder: `from gaudi3_scale.batch import AdaptiveBatchFinder` (it lives in `tune/`)."""

from gaudi3_scale.tune.api import AdaptiveBatchFinder

__all__ = ["AdaptiveBatchFinder"]
