"""`from gaudi3_scale.batch import AdaptiveBatchFinder`: a public import path kept for users, not a home.

The path is the one the seed's snippets and the docs' Python API page (docs/reference/python.md) use, and
tests/unit/test_public_imports.py imports it in a fresh interpreter. The finder lives in `tune.api`; nothing in the package imports this module
(tests/unit/test_import_layers.py refuses a facade import), so code reads the real home.
"""

from gaudi3_scale.tune.api import AdaptiveBatchFinder

__all__ = ["AdaptiveBatchFinder"]
