"""`from gaudi3_scale.profiler import GaudiProfiler`: a public import path kept for users, not a home.

The path is the one the seed's snippets and the docs' Python API page (docs/reference/python.md) use, and
tests/unit/test_public_imports.py imports it in a fresh interpreter. The profiler lives in `monitor.profiler`; nothing in the package imports this
module (tests/unit/test_import_layers.py refuses a facade import), so code reads the real home.
"""

from gaudi3_scale.monitor.profiler import ACTIVITIES, GaudiProfiler

__all__ = ["ACTIVITIES", "GaudiProfiler"]
