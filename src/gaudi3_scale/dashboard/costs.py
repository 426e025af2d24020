"""The cost view: what a run has spent (from its metrics) and what training it would cost elsewhere (TCO).

Accrued, rate, projected total and budget are the `cost_*` fields `metering.live.CostMeter` writes into every
metrics record when cost tracking is on. The comparison is `cost.estimate.compare_training_cost` for the run's
model on its planned tokens (train.max_steps × train.global_batch_size × model.context_length), at an assumed MFU,
formatted with `cost.report.usd` as `gaudi3 cost compare` prints it; unknown stays "unknown".
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.dashboard.formatting import MISSING, UNKNOWN, hours, usd, when
from gaudi3_scale.dashboard.runs import config_section

if TYPE_CHECKING:
    from gaudi3_scale.cost.comparison import PlatformEstimate

__all__ = ["ASSUMED_MFU", "PLATFORMS", "CostStore", "live_cost", "planned_tokens"]

PLATFORMS = ("gaudi3", "h100", "a100")
ASSUMED_MFU = 0.40  # the default of `gaudi3 cost compare`


def planned_tokens(config: dict[str, Any]) -> int | None:
    """train.max_steps × train.global_batch_size × model.context_length, or None when one is missing."""
    train, model = config_section(config, "train"), config_section(config, "model")
    factors = [train.get("max_steps"), train.get("global_batch_size"), model.get("context_length")]
    tokens = 1
    for value in factors:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return None
        tokens *= value
    return tokens


def live_cost(record: dict[str, Any] | None, config: dict[str, Any]) -> dict[str, Any]:
    """The run's money so far, from its newest metrics record with cost fields (None: tracking was off)."""
    budget = config_section(config, "cost").get("budget_usd")
    if record is None:
        return {"tracked": False, "budget": usd(budget) if isinstance(budget, int | float) else "none"}
    budget = record.get("cost_budget_usd")
    return {
        "tracked": True,
        "step": record.get("step"),
        "accrued_usd": record.get("cost_usd"),
        "accrued": usd(record.get("cost_usd")),
        "rate": f"{usd(record.get('cost_usd_per_hour'))}/h",
        "projected_usd": record.get("cost_projected_usd"),
        "projected": usd(record.get("cost_projected_usd")),
        "budget_usd": budget,
        "budget": "none" if budget is None else usd(budget),
        "remaining": MISSING if budget is None else usd(record.get("cost_budget_remaining_usd")),
        "finish": when(record.get("projected_finish_unix")),
    }


def _spot(row: PlatformEstimate) -> str:
    if row.spot_usd_low is None or row.spot_usd_high is None:
        return UNKNOWN
    return f"{usd(row.spot_usd_low)}–{usd(row.spot_usd_high)}"


def _row(row: PlatformEstimate) -> dict[str, Any]:
    return {
        "platform": row.platform,
        "accelerator": row.accelerator,
        "fits": row.fits,
        "nodes": MISSING if row.nodes is None else f"{row.nodes:,} × {row.per_node}",
        "mfu": UNKNOWN if row.mfu is None else f"{row.mfu:.0%}",
        "train_hours": row.train_hours,
        "train_time": hours(row.train_hours),
        "on_demand_usd": row.on_demand_usd,
        "on_demand": usd(row.on_demand_usd),
        "spot": _spot(row),
        "usd_per_million_tokens": row.usd_per_million_tokens,
        # as `gaudi3 cost compare` prints its $/1M tok column: usd() would round most runs to "$0.00"
        "per_million_tokens": UNKNOWN if (v := row.usd_per_million_tokens) is None else f"{v:,.4f}",
        "instance": row.instance,
        "note": row.note,
    }


def _compare(config: dict[str, Any]) -> dict[str, Any]:
    from gaudi3_scale.config.core import from_dict
    from gaudi3_scale.cost.estimate import compare_training_cost
    from gaudi3_scale.cost.report import count
    from gaudi3_scale.models.config import ModelConfig

    tokens = planned_tokens(config)
    base = {"platforms": list(PLATFORMS), "mfu": ASSUMED_MFU, "tokens": tokens, "rows": [], "error": None}
    if tokens is None:
        return {**base, "error": "config.yaml lacks train.max_steps, train.global_batch_size or "
                "model.context_length: the planned tokens are unknown"}  # fmt: skip
    try:
        # config.yaml is the resolved config: the model section is the full shape, preset and overrides applied.
        model = from_dict(ModelConfig, config_section(config, "model"), "model")
        comparison = compare_training_cost(model, tokens, list(PLATFORMS), mfu=ASSUMED_MFU)
    except UserInputError as exc:
        return {**base, "model": config_section(config, "model").get("name"), "error": str(exc)}
    return {
        **base,
        "model": comparison.model,
        "parameters": comparison.parameters,
        "tokens_text": count(comparison.tokens),
        "rows": [_row(r) for r in comparison.rows],
        "assumptions": comparison.assumptions.lines(),
    }


class CostStore:
    """TCO comparisons per run, computed once per version of its config (the estimator takes a second)."""

    def __init__(self) -> None:
        self._cache: dict[Path, tuple[str, dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def comparison(self, run_dir: Path, config: dict[str, Any]) -> dict[str, Any]:
        """`config`: the run's parsed config.yaml (`RunStore.config`); the cache key is its content."""
        key = repr(config)  # not JSON: a hand-edited YAML may have keys that do not sort or serialize
        with self._lock:
            cached = self._cache.get(run_dir)
        if cached is not None and cached[0] == key:
            return cached[1]
        result = _compare(config)
        with self._lock:
            self._cache[run_dir] = (key, result)
        return result
