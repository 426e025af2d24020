"""Cost and capacity planning (a tool): time/cost/energy estimates per platform and reports.

The live side a training run uses (instance catalog, live cost accrual with budgets, spot prices, the `cost` config
section) lives below the trainer in `gaudi3_scale.metering`. The package's names load lazily."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gaudi3_scale.lazy import lazy_exports

if TYPE_CHECKING:
    from gaudi3_scale.cost.analyzer import CostAnalyzer
    from gaudi3_scale.cost.estimate import CostComparison, PlatformEstimate, compare_training_cost

__all__ = ["CostAnalyzer", "CostComparison", "PlatformEstimate", "compare_training_cost"]

_LAZY = {
    "CostAnalyzer": "gaudi3_scale.cost.analyzer",
    "CostComparison": "gaudi3_scale.cost.estimate",
    "PlatformEstimate": "gaudi3_scale.cost.estimate",
    "compare_training_cost": "gaudi3_scale.cost.estimate",
}

__getattr__ = lazy_exports(__name__, _LAZY)
