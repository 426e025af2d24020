"""`CostAnalyzer`: the Python face of `gaudi3 cost compare`.

from gaudi3_scale.cost import CostAnalyzer
result = CostAnalyzer().compare_training_cost(
    model_size="70B", dataset_tokens="1T", platforms=["gaudi3", "h100", "a100"], include_energy=True
)
result.plot_tco_breakdown("tco.png")
result.generate_report("cost_analysis.pdf")  # or .html / .md
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from gaudi3_scale.cost.estimate import DEFAULT_PUE, Assumptions, CostComparison, compare_training_cost

if TYPE_CHECKING:
    from gaudi3_scale.models.config import ModelConfig

__all__ = ["CostAnalyzer"]


class CostAnalyzer:
    """Planning defaults held once (catalog override, MFU, energy assumptions), comparisons asked many times.

    `mfu` None (the default) is `gaudi3 cost compare`'s default: per accelerator our measured MFU where we have one,
    else a labelled assumption, so the Python call and the CLI give the same table; a number assumes it everywhere.
    """

    def __init__(
        self,
        *,
        catalog_file: str | Path | None = None,
        mfu: float | None = None,
        pue: float = DEFAULT_PUE,
        power_fraction_of_tdp: float = 1.0,
        usd_per_kwh: float | None = None,
    ) -> None:
        self.catalog_file = Path(catalog_file) if catalog_file is not None else None
        self.mfu = mfu
        self.assumptions = Assumptions(
            pue=pue, power_fraction_of_tdp=power_fraction_of_tdp, usd_per_kwh=usd_per_kwh
        )

    def compare_training_cost(
        self,
        model_size: str | ModelConfig = "70B",
        dataset_tokens: str | float = "1T",
        platforms: Sequence[str] = ("gaudi3", "h100", "a100"),
        *,
        include_energy: bool = True,
        mfu: float | None = None,
        from_benchmarks: str | Path | None = None,
        nodes: int | None = None,
        context_length: int | None = None,
    ) -> CostComparison:
        """One row per platform: devices to fit, time, $ (on-demand, spot, capacity block), energy, $/1M tokens.

        model_size: a preset ("llama3-70b"), a size naming one ("70B", "8B", "124M") or a ModelConfig.
        dataset_tokens: "1T", "300B", 2e12 …; mfu: overrides the analyzer's (None: the analyzer's, else the
        CLI's per-accelerator default); from_benchmarks: a directory of
        benchmark results whose measured MFU replaces the assumed one per accelerator.
        """
        comparison = compare_training_cost(
            model_size,
            dataset_tokens,
            platforms,
            mfu=mfu if mfu is not None else self.mfu,
            from_benchmarks=Path(from_benchmarks) if from_benchmarks is not None else None,
            nodes=nodes,
            context_length=context_length,
            catalog_file=self.catalog_file,
            assumptions=self.assumptions,
        )
        if include_energy:
            return comparison
        rows = [dataclasses.replace(r, energy_kwh=None, energy_usd=None) for r in comparison.rows]
        return dataclasses.replace(comparison, rows=rows)
