"""LiveCost: what `metering.live` does after each optimizer step (accrual, projections, budget, spot policy), called
first by `train.after_step.AfterStep`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from gaudi3_scale.checkpoint.contents import COST_KEY
from gaudi3_scale.distributed.env import launched_rank
from gaudi3_scale.metering.config import CostConfig
from gaudi3_scale.metering.live import (
    BUDGET_EXIT_CODE,
    SPOT_PAUSE_EXIT_CODE,
    STOP_HINTS,
    CostMeter,
    SpotCheck,
    budget_message,
    build_spot_check,
    check_cost_config,
    resumed_cost_usd,
    uses_spot_quotes,
)
from gaudi3_scale.train.callbacks import GracefulInterrupt, StepCheckpoint
from gaudi3_scale.train.step_metrics import RunMetrics

__all__ = ["LiveCost", "build_live_cost"]


class LiveCost:
    """Live cost at every optimizer step (accounting in `metering.live.CostMeter`): metrics, budget, spot policy.

    AfterStep calls it before RunMetrics, GracefulInterrupt and StepCheckpoint: a metrics record then shows the cost
    up to its own step, and a stop asked for at a step boundary happens after that very step.
    Every rank keeps a meter, but only rank 0's clock decides: its stop request reaches the other ranks through
    GracefulInterrupt's all-reduce. The accrued cost is written into every checkpoint's `gaudi3_meta` (so also its
    manifest) and read back from it on resume, on the single-file and the sharded path alike, or from the run's
    metrics.jsonl (`metrics_path`) when that recorded more (`metering.live.resumed_cost_usd`).
    """

    def __init__(
        self,
        meter: CostMeter,
        interrupt: GracefulInterrupt,
        checkpoint: StepCheckpoint,
        *,
        warn: Callable[[str], None],
        note: Callable[[str], None],
        spot: SpotCheck | None = None,
        metrics_path: Path | None = None,
    ) -> None:
        self.meter = meter
        self.metrics_path = metrics_path  # the run's metrics.jsonl: its records carry the cost too
        self.interrupt = interrupt
        self.checkpoint = checkpoint
        self.warn = warn
        self.note = note  # a line for the user (not `log`: Lightning sets `callback.log` to the module's)
        self.spot = spot  # rank 0 only: one price poller per run
        # Our stop request, as its reason at a given step: the line names the step the ranks stop at (`stop_agreed`)
        self._stop_reason: Callable[[int], str] | None = None
        self._stop_named = False
        self._carried: LiveCost | None = None  # the fit before a health rollback (`carry_from`)

    def metrics(self) -> dict[str, Any]:
        """Fields for RunMetrics' records (append this to `RunMetrics.sources`)."""
        return {**self.meter.as_metrics(), **(self.spot.as_metrics() if self.spot is not None else {})}

    def state_dict(self) -> dict[str, Any]:
        """The accrued cost, a manifest field of every checkpoint (a `Stateful` merged into META_KEY)."""
        return {COST_KEY: self.meter.cost_usd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The cost accrued before this run resumes: the checkpoint's, or what the run recorded after it when that
        is more (a process killed without a stop: `resumed_cost_usd`)."""
        stored = state_dict.get(COST_KEY)  # None: written before cost tracking was on
        spent = resumed_cost_usd(float(stored) if stored is not None else None, self.metrics_path)
        if spent is not None:  # None: nothing known; the sum starts here
            self.meter.cost_usd = spent

    def carry_from(self, previous: LiveCost) -> None:
        """This fit follows a health rollback (`GaudiTrainer._fit`): the restored checkpoint brings back the training
        state, not the spend. Money spent is never un-spent: at `start` the meter goes on from `previous`'s total,
        the time since its last step (the rollback itself) billed at its rate, with its rate and its warning."""
        self._carried = previous

    def start(self, trainer: pl.Trainer) -> None:
        carried, self._carried = self._carried, None
        if carried is not None:
            before = carried.meter
            # up to now; `before` (and its window, which gets this step again) is dropped after this
            before.accrue(trainer.global_step)
            self.meter.cost_usd = max(self.meter.cost_usd, before.cost_usd)
            self.meter.usd_per_hour_per_node = before.usd_per_hour_per_node  # the last live quote's rate
            self.meter.warned = before.warned
        self.meter.start(trainer.global_step)
        if self.spot is not None:
            self.spot.warm()

    def after_step(self, trainer: pl.Trainer) -> None:
        """Accrue this step's cost; rank 0 warns, or asks for a stop (budget spent, spot price too high)."""
        step = trainer.global_step
        meter = self.meter
        meter.accrue(step)
        if not trainer.is_global_zero or self._stop_reason is not None:  # our stop is on its way
            return
        if meter.passed_warning() and not meter.over_budget:  # both at once: the stop message says it all
            self.warn(meter.warning_message(step))
        # A stop asked for now lands after this step, with several ranks after the next (GracefulInterrupt's
        # all-reduce is read a boundary later). One that would land on the run's last step, which ends it anyway,
        # would only turn a finished run into an interrupted one (exit 3 or 4, no sample) whose rerun is refused;
        # the summary still shows the cost past the budget.
        if step + (1 if trainer.world_size > 1 else 0) >= meter.max_steps:
            return
        if meter.over_budget:
            budget = meter.budget_usd
            assert budget is not None
            self._request(
                lambda at: budget_message(meter.cost_usd, budget, f"after step {at}"), BUDGET_EXIT_CODE, step
            )
        elif self.spot is not None:
            # At every step boundary, on the quote the poller refreshes in the background (`cost.spot_ttl_s`):
            # reading it is a lock and a dict lookup, never a network call, so a new quote applies at the next step.
            self._consult_spot(step)

    def stop_agreed(self, trainer: pl.Trainer) -> None:
        """The ranks agreed on a stop and its checkpoint is saved at this step (AfterStep calls this right after
        GracefulInterrupt, before StepCheckpoint). With more than one rank that is a step after rank 0 asked
        (`GracefulInterrupt._agree`): our reason then names this step and the cost now accrued, which is what the
        checkpoint records and the summary reports."""
        if self._stop_reason is None or self._stop_named or self.interrupt.exit_code not in STOP_HINTS:
            return
        self._stop_named = True
        self.interrupt.reason = self._stop_reason(trainer.global_step)

    def _request(self, reason_at: Callable[[int], str], exit_code: int, step: int) -> None:
        reason = reason_at(step)
        self.interrupt.request(reason, exit_code=exit_code)
        if self.interrupt.reason == reason:  # ours; a signal that came first keeps its own reason
            self._stop_reason = reason_at

    def _consult_spot(self, step: int) -> None:
        assert self.spot is not None
        decision, changed = self.spot.consult()
        if decision.usd_per_hour is not None:
            self.meter.usd_per_hour_per_node = decision.usd_per_hour  # what the time from now on costs
        if decision.action == "pause":
            self.note(f"spot policy at step {step}: pause — {decision.reason}")
            why = f"spot pause: {decision.reason} (cost.spot_pause_above_usd_per_hour)"
            self._request(lambda at: f"{why} after step {at}", SPOT_PAUSE_EXIT_CODE, step)
        elif decision.action == "scale_up" and changed:
            self.note(
                f"spot policy at step {step}: scale up — {decision.reason}; capacity is cheap now: consider "
                "more nodes (parallel.nnodes) at the next restart"
            )


def build_live_cost(
    cfg: CostConfig,
    metrics: RunMetrics,
    interrupt: GracefulInterrupt,
    checkpoint: StepCheckpoint,
    *,
    nodes: int,
    max_steps: int,
    warn: Callable[[str], None],
    note: Callable[[str], None],
    announce: bool = True,
) -> LiveCost | None:
    """Live cost tracking when the `cost` section resolves a price (else None) for a run of `nodes` nodes and
    `max_steps` steps; its fields join every metrics record of rank 0.

    `note` prints lines for the user (spot decisions; with `announce`, also the price in use)."""
    price = check_cost_config(cfg)
    if price is None:
        return None
    meter = CostMeter(
        usd_per_hour_per_node=price.usd_per_hour,
        nodes=nodes,
        max_steps=max_steps,
        budget_usd=cfg.budget_usd,
        warn_at_fraction=cfg.warn_at_fraction,
    )
    spot: SpotCheck | None = None
    rank_zero = launched_rank() == 0
    if uses_spot_quotes(cfg) and rank_zero:  # one price poller per run
        spot = build_spot_check(cfg, warn=warn)
    live = LiveCost(meter, interrupt, checkpoint, warn=warn, note=note, spot=spot, metrics_path=metrics.path)
    if rank_zero:
        # The run's cost is rank 0's meter: it takes the live spot quotes, decides the stops, and is what the
        # checkpoint and the summary record. The other ranks' meters bill the starting rate and would export a
        # different figure for the same run to Prometheus (as the checkpoint upload series, rank 0's only).
        metrics.sources.append(live.metrics)
    if announce:
        note(f"cost: ${meter.usd_per_hour:,.2f}/h for {meter.nodes} node(s), from {price.source}")
    return live
