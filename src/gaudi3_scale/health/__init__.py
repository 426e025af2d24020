"""Training health: the non-finite guard, the loss-spike policy, the hang watchdog and straggler detection
(docs/health.md). `HealthConfig` is the run config's `health` section."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gaudi3_scale.lazy import lazy_exports

if TYPE_CHECKING:
    from gaudi3_scale.health.config import HealthConfig

__all__ = ["HealthConfig"]

_LAZY = {"HealthConfig": "gaudi3_scale.health.config"}

__getattr__ = lazy_exports(__name__, _LAZY)
