"""Cost and capacity planning: the instance price catalog, time/cost/energy estimates per platform, reports, and
(in `cost.live` / `cost.spot`) live cost tracking with budgets and spot prices.

The package's names load lazily: `cost.catalog` and `cost.spot` stay importable without torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gaudi3_scale.cost.analyzer import CostAnalyzer
    from gaudi3_scale.cost.estimate import CostComparison, PlatformEstimate, compare_training_cost

__all__ = ["CostAnalyzer", "CostComparison", "PlatformEstimate", "compare_training_cost"]


def __getattr__(name: str) -> Any:
    if name == "CostAnalyzer":
        from gaudi3_scale.cost.analyzer import CostAnalyzer

        return CostAnalyzer
    if name in ("CostComparison", "PlatformEstimate", "compare_training_cost"):
        from gaudi3_scale.cost import estimate

        return getattr(estimate, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
