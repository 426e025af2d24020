"""Live cost accounting: accrual with an injected clock, projections, the budget warning, price resolution from the
catalog and the `cost` section's one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gaudi3_scale.config.core import parse_overrides
from gaudi3_scale.config.errors import ConfigError
from gaudi3_scale.metering.config import CostConfig
from gaudi3_scale.metering.live import (
    BUDGET_EXIT_CODE,
    BudgetExhaustedError,
    CostMeter,
    SpotCheck,
    budget_message,
    check_budget_left,
    check_cost_config,
    recorded_cost_usd,
    resolve_price,
    resumed_cost_usd,
)
from gaudi3_scale.metering.spot import CachedSpotPrices, SpotPolicy, SpotQuote
from gaudi3_scale.train.config import build_run_config


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _meter(clock: FakeClock, **kwargs: object) -> CostMeter:
    args: dict[str, object] = {"usd_per_hour_per_node": 3600.0, "nodes": 1, "max_steps": 10}  # $1/s per node
    args.update(kwargs)
    return CostMeter(clock=clock, wall_clock=lambda: 1_700_000_000.0, **args)  # type: ignore[arg-type]


def test_accrual_is_wall_time_times_price_times_nodes() -> None:
    clock = FakeClock()
    meter = _meter(clock, nodes=2)
    assert meter.usd_per_hour == 7200.0
    meter.start(0)
    clock.now += 1.5
    assert meter.accrue(1) == pytest.approx(3.0)  # 1.5 s × $1/s × 2 nodes
    clock.now += 0.25
    meter.usd_per_hour_per_node = 1800.0  # a live quote: the time from now on is cheaper
    clock.now += 0.5
    assert meter.accrue(2) == pytest.approx(3.0 + 0.75 * 1.0)  # the whole interval at the rate of its end
    assert meter.as_metrics()["cost_usd_per_hour"] == 3600.0


def test_restored_cost_continues_the_sum_and_time_before_start_is_free() -> None:
    clock = FakeClock()
    meter = _meter(clock)
    meter.cost_usd = 4.0  # from the checkpoint
    clock.now += 100.0  # data preparation, checkpoint load: not billed
    meter.start(40)
    clock.now += 2.0
    assert meter.accrue(41) == pytest.approx(6.0)


def test_projection_from_the_measured_pace() -> None:
    clock = FakeClock()
    meter = _meter(clock, budget_usd=20.0)
    meter.start(0)
    assert meter.remaining_s() is None and meter.as_metrics()["cost_projected_usd"] is None
    for step in range(1, 5):  # 2 s per step
        clock.now += 2.0
        meter.accrue(step)
    assert meter.remaining_s() == pytest.approx(6 * 2.0)  # 6 steps left of 10
    metrics = meter.as_metrics()
    assert metrics["cost_usd"] == pytest.approx(8.0)
    assert metrics["cost_projected_usd"] == pytest.approx(8.0 + 12.0)
    assert metrics["projected_finish_unix"] == pytest.approx(1_700_000_000.0 + 12.0)
    assert metrics["cost_budget_remaining_usd"] == pytest.approx(12.0)


def test_projection_follows_a_slower_recent_window() -> None:
    clock = FakeClock()
    meter = _meter(clock, max_steps=100, window_steps=2)
    meter.start(0)
    for step, seconds in enumerate([1.0, 1.0, 1.0, 5.0, 5.0], start=1):
        clock.now += seconds
        meter.accrue(step)
    assert meter.remaining_s() == pytest.approx(95 * 5.0)  # only the last 2 steps count


def test_warning_once_at_the_threshold_then_over_budget() -> None:
    clock = FakeClock()
    meter = _meter(clock, budget_usd=10.0, warn_at_fraction=0.8)
    meter.start(0)
    seen, messages = [], []
    for step in range(1, 12):
        clock.now += 1.0
        meter.accrue(step)
        warned = meter.passed_warning()
        seen.append((step, warned, meter.over_budget))
        if warned:
            messages.append(meter.warning_message(step))
    assert [s for s, warned, _ in seen if warned] == [8]  # $8 = 80 % of $10, once
    assert next(s for s, _, over in seen if over) == 10
    assert meter.as_metrics()["cost_budget_warning"] is True
    assert messages[0].startswith("cost: $8.00 accrued after step 8, 80% of the $10.00 budget")


def test_no_budget_never_warns_or_stops() -> None:
    clock = FakeClock()
    meter = _meter(clock)
    meter.start(0)
    clock.now += 1e6
    meter.accrue(1)
    assert not meter.passed_warning() and not meter.over_budget
    assert meter.as_metrics()["cost_budget_remaining_usd"] is None


def test_budget_message_shows_enough_decimals_to_differ() -> None:
    assert budget_message(1.0213, 1.0, "after step 40") == (
        "budget reached: $1.02 accrued of the $1.00 budget (cost.budget_usd) after step 40"
    )
    assert "$1.0004 accrued of the $1.0000 budget" in budget_message(1.0004, 1.0, "after step 3")


def test_resume_with_the_budget_spent_is_refused_with_exit_3() -> None:
    check_budget_left(2.0, 1.99, "step-00000010")  # budget left: fine
    with pytest.raises(BudgetExhaustedError, match=r"^budget reached: \$2\.00 accrued of the \$2\.00") as err:
        check_budget_left(2.0, 2.0, "step-00000010")
    assert err.value.exit_code == BUDGET_EXIT_CODE == 3
    assert "step-00000010" in str(err.value) and "raise cost.budget_usd" in str(err.value)


def test_the_spend_a_resume_continues_from_is_the_larger_of_checkpoint_and_metrics(tmp_path: Path) -> None:
    """The last cost record of metrics.jsonl, read from the end across blocks: records without a cost (a health
    event) and a torn last line (the writer killed) are passed over; no file or no cost record: the checkpoint's."""
    path = tmp_path / "metrics.jsonl"
    assert recorded_cost_usd(path) is None and resumed_cost_usd(1.5, path) == 1.5
    assert resumed_cost_usd(None, None) is None
    pad = "x" * 900  # ~1 KiB records: the file spans several 64 KiB blocks
    lines = [json.dumps({"step": step, "cost_usd": step / 100, "pad": pad}) for step in range(1, 300)]
    lines += [json.dumps({"step": 299, "health_event": "spike", "pad": pad * 80}), '{"step": 300, "cost_u']
    path.write_text("\n".join(lines))
    assert recorded_cost_usd(path) == 2.99
    assert resumed_cost_usd(1.5, path) == 2.99 and resumed_cost_usd(3.5, path) == 3.5
    path.write_text(json.dumps({"step": 1, "train_loss": 2.0}) + "\n")
    assert recorded_cost_usd(path) is None and resumed_cost_usd(1.5, path) == 1.5


def _cost(*overrides: str) -> CostConfig:
    return build_run_config(None, parse_overrides(list(overrides))).cost


def test_price_from_the_catalog_times_nodes() -> None:
    nodes = ["--parallel.nnodes", "2", "--parallel.rdzv_endpoint", "10.0.0.1:29500"]
    cfg = build_run_config(None, parse_overrides(["--cost.instance", "aws/p5.48xlarge/us-east-1", *nodes]))
    price = resolve_price(cfg.cost)
    assert price is not None and price.usd_per_hour == 55.04
    assert "catalog aws/p5.48xlarge/us-east-1 on_demand" in price.source
    meter = CostMeter(usd_per_hour_per_node=price.usd_per_hour, nodes=cfg.parallel.nnodes, max_steps=1)
    assert meter.usd_per_hour == pytest.approx(110.08)


def test_pricing_picks_the_catalog_column_and_spot_is_the_high_end() -> None:
    instance = ("--cost.instance", "aws/p5.48xlarge/us-east-1")
    capacity = resolve_price(_cost(*instance, "--cost.pricing", "capacity_block"))
    spot = resolve_price(_cost(*instance, "--cost.pricing", "spot"))
    assert capacity is not None and capacity.usd_per_hour == 39.33
    assert spot is not None and spot.usd_per_hour == 55.04 and "high end" in spot.source  # range 10.24-55.04


def test_explicit_price_wins_and_no_price_means_no_tracking() -> None:
    price = resolve_price(_cost("--cost.instance", "aws/p5.4xlarge/us-east-1", "--cost.pricing", "spot",
                                "--cost.price_usd_per_hour", "2.5"))  # fmt: skip
    assert price is not None and price.usd_per_hour == 2.5 and price.source == "cost.price_usd_per_hour"
    assert resolve_price(CostConfig()) is None and check_cost_config(CostConfig()) is None


def test_unknown_catalog_price_is_never_guessed() -> None:
    cfg = _cost("--cost.instance", "aws/p5.4xlarge/us-east-1", "--cost.pricing", "spot")  # spot range: null
    with pytest.raises(ConfigError) as err:
        resolve_price(cfg)
    message = str(err.value)
    assert "\n" not in message and message.startswith("cost.price_usd_per_hour: the catalog does not know")
    assert "spot price of aws/p5.4xlarge/us-east-1" in message and "set cost.price_usd_per_hour" in message


def test_instance_missing_from_the_catalog_lists_the_known_ones() -> None:
    with pytest.raises(
        ConfigError, match=r"^cost\.instance: 'aws/p9\.huge/us-east-1' is not in the instance"
    ) as err:
        resolve_price(_cost("--cost.instance", "aws/p9.huge/us-east-1"))
    assert "aws/p5.48xlarge/us-east-1" in str(err.value) and "\n" not in str(err.value)


def test_user_catalog_file_adds_an_instance(tmp_path: Path) -> None:
    catalog = tmp_path / "mine.yaml"
    catalog.write_text(
        "sources: {quote: 'our contract, 2026-01'}\n"
        "instances:\n"
        "  - {provider: acme, type: g3.8x, accelerator: gaudi3, accelerators_per_node: 8, region: eu-1,\n"
        "     on_demand_usd_per_hour: 40.0, spot_usd_per_hour_range: null, capacity_block_usd_per_hour: null,\n"
        "     prices_date: 2026-01, sources: [quote]}\n"
    )
    price = resolve_price(_cost("--cost.instance", "acme/g3.8x/eu-1", "--cost.catalog_file", str(catalog)))
    assert price is not None and price.usd_per_hour == 40.0


def test_unknown_spot_provider_names_the_field() -> None:
    cfg = _cost("--cost.instance", "aws/p5.48xlarge/us-east-1", "--cost.pricing", "spot",
                "--cost.spot_provider", "nope")  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"^cost\.spot_provider: unknown spot price provider 'nope'; known: .*aws"
    ):
        check_cost_config(cfg)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["--cost.budget_usd", "10"], "cost.budget_usd: needs a price to count against: set cost.instance"),
        (["--cost.instance", "p5.48xlarge"], "cost.instance: expected provider/type/region"),
        (["--cost.pricing", "reserved"], "cost.pricing:"),
        (["--cost.price_usd_per_hour", "-1"], "cost.price_usd_per_hour: must be > 0"),
        (["--cost.price_usd_per_hour", "1", "--cost.budget_usd", "0"], "cost.budget_usd: must be > 0"),
        (["--cost.warn_at_fraction", "1"], "cost.warn_at_fraction: must be between 0 and 1"),
        (["--cost.spot_ttl_s", "0"], "cost.spot_ttl_s: must be > 0"),
        (["--cost.price_usd_per_hour", "1", "--cost.spot_pause_above_usd_per_hour", "5"],
         "cost.spot_pause_above_usd_per_hour: applies only with cost.pricing spot"),
        (["--cost.pricing", "spot", "--cost.price_usd_per_hour", "1", "--cost.spot_pause_above_usd_per_hour", "5"],
         "cost.instance: the spot policy needs an instance"),
        (["--cost.instance", "aws/p5.48xlarge/us-east-1", "--cost.pricing", "spot",
          "--cost.spot_pause_above_usd_per_hour", "5", "--cost.spot_scale_up_below_usd_per_hour", "6"],
         "cost.spot_scale_up_below_usd_per_hour: must be below spot_pause_above_usd_per_hour (5.0)"),
    ],
)  # fmt: skip
def test_cost_section_errors_are_one_line(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_run_config(None, parse_overrides(overrides))
    assert needle in str(err.value) and "\n" not in str(err.value)


class _SettablePrice:
    """A spot price source the test sets."""

    name = "settable"

    def __init__(self, usd_per_hour: float) -> None:
        self.usd_per_hour = usd_per_hour

    def fetch(self, instance_type: str, region: str) -> SpotQuote:
        return SpotQuote(usd_per_hour=self.usd_per_hour, instance_type=instance_type, region=region,
                         availability_zone=None, provider=self.name, fetched_at_unix=0.0)  # fmt: skip


def test_spot_policy_scale_up_is_noted_once_per_change_and_pause_stops(tmp_path: Path) -> None:
    from gaudi3_scale.checkpoint.checkpointer import Checkpointer
    from gaudi3_scale.checkpoint.config import CheckpointConfig
    from gaudi3_scale.train.callbacks import GracefulInterrupt, StepCheckpoint
    from gaudi3_scale.train.cost_callback import LiveCost

    source = _SettablePrice(30.0)
    prices = CachedSpotPrices(source, ttl_s=3600.0)  # refreshed by the test alone (refresh_now)
    check = SpotCheck(prices, SpotPolicy(pause_above_usd_per_hour=50.0, scale_up_below_usd_per_hour=35.0),
                      instance_type="p5.48xlarge", region="us-east-1")  # fmt: skip
    checkpoint = StepCheckpoint(Checkpointer(CheckpointConfig(), tmp_path), every_steps=2)
    interrupt = GracefulInterrupt(checkpoint)
    meter = _meter(FakeClock(), usd_per_hour_per_node=55.04)
    notes: list[str] = []
    live = LiveCost(meter, interrupt, checkpoint, warn=notes.append, note=notes.append, spot=check)

    def boundary(step: int, usd_per_hour: float) -> None:
        source.usd_per_hour = usd_per_hour
        prices.refresh_now("p5.48xlarge", "us-east-1", timeout_s=10)
        live._consult_spot(step)

    boundary(2, 30.0)
    boundary(4, 31.0)
    assert len(notes) == 1 and notes[0].startswith("spot policy at step 2: scale up — spot price $30.00/h")
    assert meter.usd_per_hour_per_node == 31.0 and interrupt.reason is None
    assert live.metrics()["spot_decision"] == 2.0 and live.metrics()["spot_price_usd_per_hour"] == 31.0
    boundary(6, 40.0)  # continue: nothing to say
    boundary(8, 32.0)  # scale up again after a change: said again
    assert len(notes) == 2 and notes[1].startswith("spot policy at step 8: scale up")
    boundary(10, 60.0)
    assert interrupt.reason == (
        "spot pause: spot price $60.00/h (p5.48xlarge, us-east-1) is above the pause threshold $50.00/h "
        "(cost.spot_pause_above_usd_per_hour) after step 10"
    )
    assert notes[-1].startswith("spot policy at step 10: pause") and live.metrics()["spot_decision"] == 1.0
    prices.close()


def test_the_launcher_passes_the_cost_exit_codes_on_quietly() -> None:
    from gaudi3_scale.distributed.launch import EXPLAINED_EXIT_CODES, RESTARTABLE_EXIT_CODES
    from gaudi3_scale.metering.live import STOP_HINTS

    assert set(STOP_HINTS) <= EXPLAINED_EXIT_CODES and not set(STOP_HINTS) & RESTARTABLE_EXIT_CODES
