"""Live cost of a training run: accrued from wall time × price × nodes, projected to the end, held to a budget.

This module does the accounting and never imports torch; `train.cost_callback.LiveCost` drives it at every optimizer
step boundary and turns its decisions into a clean stop.

**Billable time** is wall time from the start of training (Lightning's `on_train_start`) to the last optimizer
step, validation and periodic checkpoint saves included: the instances are paid for while they run. Data
preparation, model building and loading a checkpoint before training, and the save and validation after the last
step, are not counted, so the figure is a slight lower bound of the bill. The accrued cost is stored in every
checkpoint (`checkpoint.contents.COST_KEY` in its `gaudi3_meta`, hence also in its manifest), and in every record of
the run's metrics.jsonl: a resumed run continues from the larger of the two (`resumed_cost_usd`), so the spend
since the last checkpoint of a process that died without a stop (SIGKILL, a lost node) is not forgotten.

**Spot pricing**: until a live quote arrives the rate is `cost.price_usd_per_hour` or else the HIGH end of the
catalog's spot range (a budget must not be undercounted); the quote read at each step boundary (the poller refreshes
it in the background, `cost.spot_ttl_s`) sets the rate.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.metering.catalog import Instance, load_instances
from gaudi3_scale.metering.config import CostConfig

if TYPE_CHECKING:
    from gaudi3_scale.metering.spot import CachedSpotPrices, SpotDecision, SpotPolicy, SpotPriceProvider

__all__ = [
    "BUDGET_EXIT_CODE",
    "SPOT_PAUSE_EXIT_CODE",
    "STOP_HINTS",
    "BudgetExhaustedError",
    "CostMeter",
    "ResolvedPrice",
    "SpotCheck",
    "SpotPausedError",
    "budget_message",
    "build_spot_check",
    "check_budget_left",
    "check_cost_config",
    "check_resume_spot_price",
    "find_instance",
    "recorded_cost_usd",
    "resolve_price",
    "resumed_cost_usd",
    "stop_line",
    "uses_spot_quotes",
]

# Exit codes of a run that stopped itself over money. Deliberately not 128 + a signal: Kubeflow's ExitCode restart
# policy retries 130, 137 and 143 (training-operator, pkg/util/train IsRetryableExitCode), and restarting a run
# that is out of budget or priced out would only spend more. 2 is taken by bad input. (torchrun's --max-restarts,
# parallel.max_restarts, restarts on any non-zero exit: a restarted group resumes and is refused at once, before it
# trains: exit 3 while the checkpoint's cost is at the budget, exit 4 while the spot price is above the pause
# threshold; `check_budget_left`, `check_resume_spot_price`.)
BUDGET_EXIT_CODE = 3
SPOT_PAUSE_EXIT_CODE = 4
STOP_HINTS = {
    BUDGET_EXIT_CODE: "raise cost.budget_usd to continue",
    SPOT_PAUSE_EXIT_CODE: "run the same command to resume once the spot price is lower "
    "(or raise cost.spot_pause_above_usd_per_hour)",
}


class BudgetExhaustedError(Exception):
    """A resumed run whose checkpoint already spent the budget: one line, exit code 3, nothing trained."""

    exit_code = BUDGET_EXIT_CODE


class SpotPausedError(BudgetExhaustedError):
    """A resumed run whose spot price is still above the pause threshold: one line, exit code 4, nothing trained.

    A BudgetExhaustedError so that every place that refuses a resume over money (one line from rank 0, every rank
    exits with `exit_code`) handles it too."""

    exit_code = SPOT_PAUSE_EXIT_CODE


@dataclass(frozen=True, kw_only=True)
class ResolvedPrice:
    usd_per_hour: float  # per node
    source: str  # where the number comes from, for the log


def find_instance(cfg: CostConfig) -> Instance:
    """`cost.instance`'s catalog entry (`cost.catalog_file` or the shipped catalog); one line when it is not there."""
    key = cfg.instance_key
    assert key is not None
    instances = load_instances(Path(cfg.catalog_file) if cfg.catalog_file else None)
    if key not in instances:
        known = ", ".join(sorted("/".join(k) for k in instances))
        raise ConfigError(
            "cost.instance",
            f"{cfg.instance!r} is not in the instance catalog; known: {known} (or add it with cost.catalog_file)",
        )
    return instances[key]


def resolve_price(cfg: CostConfig) -> ResolvedPrice | None:
    """The price per node that cost tracking starts with, or None when tracking is off (no price, no instance).

    An explicit `price_usd_per_hour` wins and the catalog is not read. Otherwise the instance's catalog price for
    `pricing`; a price the catalog does not know is an error, never a guess.
    """
    if not cfg.tracking:
        return None
    if cfg.price_usd_per_hour is not None:
        return ResolvedPrice(usd_per_hour=cfg.price_usd_per_hour, source="cost.price_usd_per_hour")
    instance = find_instance(cfg)
    spot = instance.spot_usd_per_hour_range
    price = {
        "on_demand": instance.on_demand_usd_per_hour,
        "capacity_block": instance.capacity_block_usd_per_hour,
        "spot": spot[1] if spot is not None else None,  # the range's high end: never undercount
    }[cfg.pricing]
    if price is None:
        raise ConfigError(
            "cost.price_usd_per_hour",
            f"the catalog does not know the {cfg.pricing} price of {cfg.instance} (unknown prices are never "
            "guessed); set cost.price_usd_per_hour to the price per node",
        )
    where = "high end of the spot range" if cfg.pricing == "spot" else cfg.pricing
    return ResolvedPrice(
        usd_per_hour=price, source=f"catalog {cfg.instance} {where} ({instance.prices_date})"
    )


def _usd_pair(a: float, b: float) -> tuple[str, str]:
    """Both amounts with as many decimals (2 to 6) as it takes to tell them apart."""
    for decimals in range(2, 7):
        left, right = f"${a:,.{decimals}f}", f"${b:,.{decimals}f}"
        if left != right:
            return left, right
    return f"${a:,.2f}", f"${b:,.2f}"


def budget_message(cost_usd: float, budget_usd: float, where: str) -> str:
    cost, budget = _usd_pair(cost_usd, budget_usd)
    return f"budget reached: {cost} accrued of the {budget} budget (cost.budget_usd) {where}"


def stop_line(reason: str, exit_code: int, *, checkpoint: bool) -> str:
    """The one line `gaudi3 train` ends with after a cost stop. Without a checkpoint there is nothing to resume:
    raising the budget or waiting for a lower price would not continue the run, a rerun trains it from the start."""
    if checkpoint:
        return f"{reason}; checkpoint committed; exit {exit_code} — {STOP_HINTS[exit_code]}"
    return (
        f"{reason}; no checkpoint saved (checkpoint.enabled is false); exit {exit_code} — nothing to resume: "
        "a rerun starts again from step 0"
    )


def check_budget_left(budget_usd: float, stored_cost_usd: float, checkpoint_name: str) -> None:
    """Refuse to resume a checkpoint whose accrued cost already reached the budget (BudgetExhaustedError)."""
    if stored_cost_usd >= budget_usd:
        reason = budget_message(stored_cost_usd, budget_usd, f"by checkpoint {checkpoint_name}")
        raise BudgetExhaustedError(
            f"{reason}; nothing trained; exit {BUDGET_EXIT_CODE} — {STOP_HINTS[BUDGET_EXIT_CODE]}"
        )


def recorded_cost_usd(metrics_path: Path | None) -> float | None:
    """The `cost_usd` of the last record that has one in a run's metrics.jsonl (None: no file, no such record).

    Read from the end, a block at a time: a long run's file is large and its last cost record is near the end. A
    torn last line (the writer killed mid-write) is passed over."""
    if metrics_path is None or not metrics_path.is_file():
        return None
    with metrics_path.open("rb") as f:
        end, partial = f.seek(0, os.SEEK_END), b""
        while end > 0:
            start = max(0, end - (1 << 16))
            f.seek(start)
            lines = (f.read(end - start) + partial).split(b"\n")
            partial, end = (lines.pop(0) if start > 0 else b""), start  # its start is in the block before
            for line in reversed(lines):
                if (cost := _cost_of(line)) is not None:
                    return cost
    return None


def _cost_of(line: bytes) -> float | None:
    try:
        record = json.loads(line)
    except ValueError:  # empty, or torn
        return None
    cost = record.get("cost_usd") if isinstance(record, dict) else None
    if isinstance(cost, bool) or not isinstance(cost, int | float) or not math.isfinite(cost):
        return None
    return float(cost)


def resumed_cost_usd(checkpoint_usd: float | None, metrics_path: Path | None) -> float | None:
    """What a resumed run has spent: the larger of its checkpoint's accrued cost and the last one the run recorded
    in its own metrics.jsonl (`metrics_path`), None when neither knows. Money spent is never un-spent: a process
    killed without a stop recorded spend after its last checkpoint, up to its last logging window.

    metrics.jsonl rather than a file of its own: every record (each `train.log_every_steps`, written as it comes)
    already holds the figure, so the steady state costs nothing more per step. Only the resuming run's own --out is
    read: a run that resumes another directory's checkpoint (a remote mirror's on a fresh machine, a fork) did not
    pay for what that run spent after it."""
    figures = [cost for cost in (checkpoint_usd, recorded_cost_usd(metrics_path)) if cost is not None]
    return max(figures) if figures else None


class CostMeter:
    """Accrued cost, projections and budget state of one run; call `start`, then `accrue` at each step boundary.

    `clock` measures elapsed wall time (monotonic); `wall_clock` dates the projected finish (Unix time).
    Projections use the wall time per step over the last `window_steps` steps, validation and checkpoints
    included: with a constant batch that is remaining tokens ÷ measured tokens/s, and it is the time that will
    be paid for (RunMetrics' tokens_per_s leaves validation and checkpoint time out).
    """

    def __init__(
        self,
        *,
        usd_per_hour_per_node: float,
        nodes: int,
        max_steps: int,
        budget_usd: float | None = None,
        warn_at_fraction: float = 0.8,
        window_steps: int = 20,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.usd_per_hour_per_node = usd_per_hour_per_node
        self.nodes = nodes
        self.max_steps = max_steps
        self.budget_usd = budget_usd
        self.warn_at_fraction = warn_at_fraction
        self.clock = clock
        self.wall_clock = wall_clock
        self.cost_usd = 0.0
        self.warned = False
        self._last: float | None = None
        self._window: deque[tuple[float, int]] = deque(maxlen=window_steps + 1)

    @property
    def usd_per_hour(self) -> float:
        """The current rate for all nodes."""
        return self.usd_per_hour_per_node * self.nodes

    def start(self, step: int) -> None:
        """Billing starts now; `step` is the optimizer step training starts from (non-zero when resumed)."""
        now = self.clock()
        self._last = now
        self._window.clear()
        self._window.append((now, step))

    def accrue(self, step: int) -> float:
        """Add the wall time since the previous call at the current rate; `step` is the step just finished."""
        assert self._last is not None, "CostMeter.start() before accrue()"
        now = self.clock()
        self.cost_usd += (now - self._last) * self.usd_per_hour / 3600.0
        self._last = now
        self._window.append((now, step))
        return self.cost_usd

    def remaining_s(self) -> float | None:
        """Wall seconds to `max_steps` at the recent pace; None before a step was measured."""
        if len(self._window) < 2:
            return None
        (t0, s0), (t1, s1) = self._window[0], self._window[-1]
        if s1 <= s0 or t1 <= t0:
            return None
        return max(0, self.max_steps - s1) * (t1 - t0) / (s1 - s0)

    def projected_usd(self) -> float | None:
        remaining = self.remaining_s()
        return None if remaining is None else self.cost_usd + remaining * self.usd_per_hour / 3600.0

    def passed_warning(self) -> bool:
        """True once: the first time the accrued cost is at `warn_at_fraction` of the budget or more."""
        if self.warned or self.budget_usd is None or self.cost_usd < self.warn_at_fraction * self.budget_usd:
            return False
        self.warned = True
        return True

    def warning_message(self, step: int) -> str:
        assert self.budget_usd is not None
        cost, budget = _usd_pair(self.cost_usd, self.budget_usd)
        projected = self.projected_usd()
        total = f"; projected total ${projected:,.2f}" if projected is not None else ""
        return (
            f"cost: {cost} accrued after step {step}, {self.cost_usd / self.budget_usd:.0%} of the {budget} "
            f"budget (cost.budget_usd; warning at cost.warn_at_fraction {self.warn_at_fraction:g}){total}; "
            "the run checkpoints and stops when the budget is reached"
        )

    @property
    def over_budget(self) -> bool:
        return self.budget_usd is not None and self.cost_usd >= self.budget_usd

    def as_metrics(self) -> dict[str, Any]:
        remaining = self.remaining_s()
        budget = self.budget_usd
        return {
            "cost_usd": self.cost_usd,
            "cost_usd_per_hour": self.usd_per_hour,
            "cost_projected_usd": self.projected_usd(),
            "cost_budget_usd": budget,
            "cost_budget_remaining_usd": max(0.0, budget - self.cost_usd) if budget is not None else None,
            "cost_budget_warning": self.warned,
            "projected_finish_unix": None if remaining is None else self.wall_clock() + remaining,
        }


class SpotCheck:
    """The spot policy at a step boundary: the cached quote (never waits on the network) → a decision."""

    def __init__(
        self, prices: CachedSpotPrices, policy: SpotPolicy, *, instance_type: str, region: str
    ) -> None:
        self.prices = prices
        self.policy = policy
        self.instance_type = instance_type
        self.region = region
        self.last: SpotDecision | None = None

    def warm(self) -> None:
        """Start fetching the first quote, so one is likely cached by the first step boundaries."""
        self.prices.price(self.instance_type, self.region)

    def consult(self) -> tuple[SpotDecision, bool]:
        """(decision, whether its action differs from the previous decision's)."""
        decision = self.policy.decide(self.prices.price(self.instance_type, self.region))
        changed = self.last is None or self.last.action != decision.action
        self.last = decision
        return decision, changed

    def as_metrics(self) -> dict[str, Any]:
        if self.last is None:
            return {"spot_price_usd_per_hour": None, "spot_decision": None}
        return dict(self.last.as_metrics())


def uses_spot_quotes(cfg: CostConfig) -> bool:
    """Live spot quotes need spot pricing and an instance (quotes are per type and region)."""
    return cfg.pricing == "spot" and cfg.instance is not None


def _spot_provider(cfg: CostConfig) -> SpotPriceProvider:
    """The provider `cost.spot_provider` names; a refusal names the field at fault (the zone is checked apart)."""
    from gaudi3_scale.metering.spot import spot_provider

    try:
        provider = spot_provider(cfg.spot_provider, endpoint_url=cfg.spot_endpoint_url)
    except UserInputError as exc:
        raise ConfigError("cost.spot_provider", str(exc)) from None
    if cfg.spot_availability_zone is None:
        return provider
    try:
        return spot_provider(
            cfg.spot_provider,
            endpoint_url=cfg.spot_endpoint_url,
            availability_zone=cfg.spot_availability_zone,
        )
    except UserInputError as exc:
        raise ConfigError("cost.spot_availability_zone", str(exc)) from None


def check_cost_config(cfg: CostConfig) -> ResolvedPrice | None:
    """Everything about `cfg` that needs the catalog or the spot registry, checked before any work is done.

    Returns the starting price (None: tracking is off). Nothing is fetched: providers only talk to the network
    when asked for a price.
    """
    price = resolve_price(cfg)
    if uses_spot_quotes(cfg):
        provider, key = _spot_provider(cfg), cfg.instance_key
        check = getattr(provider, "check_instance", None)  # azure, gcp: names the provider can tell are wrong
        if check is not None and key is not None:
            try:
                check(key[1], key[2])
            except UserInputError as exc:
                raise ConfigError("cost.instance", str(exc)) from None
    return price


def build_spot_check(cfg: CostConfig, warn: Callable[[str], None]) -> SpotCheck:
    """The provider named by `cost.spot_provider` behind a cache, and the policy (`uses_spot_quotes` only)."""
    from gaudi3_scale.metering.spot import CachedSpotPrices, SpotPolicy

    key = cfg.instance_key
    assert uses_spot_quotes(cfg) and key is not None
    prices = CachedSpotPrices(_spot_provider(cfg), ttl_s=cfg.spot_ttl_s, warn=warn)
    policy = SpotPolicy(
        pause_above_usd_per_hour=cfg.spot_pause_above_usd_per_hour,
        scale_up_below_usd_per_hour=cfg.spot_scale_up_below_usd_per_hour,
    )
    return SpotCheck(prices, policy, instance_type=key[1], region=key[2])


def check_resume_spot_price(
    cfg: CostConfig, checkpoint_name: str, *, warn: Callable[[str], None] | None = None
) -> None:
    """Refuse to resume while the spot price is still above `cost.spot_pause_above_usd_per_hour` (SpotPausedError).

    The policy otherwise reads the cached quote, which the first steps may not have yet, so a run restarted after
    a pause (torchrun's --max-restarts restarts on any non-zero exit, exit 4 included) would start training at the
    price it paused for, again at every restart. One fetch, each request bounded by the provider's timeout; when it
    gives no price the run resumes (`warn` says why) and the policy decides at each step boundary as usual.
    """
    if not uses_spot_quotes(cfg) or cfg.spot_pause_above_usd_per_hour is None:
        return
    from gaudi3_scale.metering.spot import SpotPolicy

    key = cfg.instance_key
    assert key is not None
    provider = _spot_provider(cfg)
    try:
        quote = provider.fetch(key[1], key[2])
    except Exception as exc:  # a failing or broken price API must not stop a run (as in CachedSpotPrices)
        if warn is not None:
            detail = " ".join(str(exc).split()) or type(exc).__name__
            warn(f"spot price unknown before resuming from checkpoint {checkpoint_name} ({detail}); resuming")
        return
    decision = SpotPolicy(pause_above_usd_per_hour=cfg.spot_pause_above_usd_per_hour).decide(quote)
    if decision.action == "pause":
        raise SpotPausedError(
            f"spot pause: {decision.reason} (cost.spot_pause_above_usd_per_hour) before resuming from checkpoint "
            f"{checkpoint_name}; nothing trained; exit {SPOT_PAUSE_EXIT_CODE} — {STOP_HINTS[SPOT_PAUSE_EXIT_CODE]}"
        )
