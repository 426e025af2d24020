"""The planner under pipeline parallel: the schedules' micro-batches in flight (held against torch's own schedule
order), the bubble formulas, the Llama 3 split, and the memory estimator's per-stage numbers."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from torch.distributed.pipelining import schedules

from gaudi3_scale.distributed.plan import BatchPlan, ParallelPlan
from gaudi3_scale.distributed.schedule_math import (
    balanced_split,
    bubble_fraction,
    in_flight_micro_batches,
    p2p_bytes_per_micro_batch,
    simulate_step,
    simulated_bubble,
    single_stage_order,
)
from gaudi3_scale.models import get_model_config
from gaudi3_scale.models.config import ModelConfig
from gaudi3_scale.tune.activations import activation_bytes, element_bytes, model_shape
from gaudi3_scale.tune.memory import estimate_memory


def _torch_order(schedule: str, pp_size: int, micro_batches: int, rank: int) -> list[Any]:
    """torch 2.13's own action list of one rank (`_calculate_single_rank_operations`, which needs no stages: it
    reads the sizes only)."""
    cls = {"interleaved_1f1b": schedules.ScheduleInterleaved1F1B, "zbv": schedules.ScheduleZBVZeroBubble}[
        schedule
    ]
    order = object.__new__(cls)
    order.pp_group_size, order._n_microbatches = pp_size, micro_batches
    order.n_local_stages, order.num_stages = 2, 2 * pp_size
    order.number_of_rounds = max(1, micro_batches // pp_size)
    order.microbatches_per_round = micro_batches // order.number_of_rounds
    order.rank = rank
    return [a for a in order._calculate_single_rank_operations(rank) if a is not None]


def _peak_in_flight(actions: list[Any]) -> dict[int, int]:
    """Per stage, the forwards not yet followed by their backward, at the moment their sum is largest."""
    live: dict[int, int] = {}
    best: dict[int, int] = {}
    for action in actions:
        kind = action.computation_type.value
        if kind == "F":
            live[action.stage_index] = live.get(action.stage_index, 0) + 1
        elif kind in ("B", "I"):  # a full backward, or ZBV's input-gradient pass (its W follows)
            live[action.stage_index] -= 1
        if sum(live.values()) > sum(best.values()):
            best = dict(live)
    return best


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zbv"])
@pytest.mark.parametrize(("pp_size", "micro_batches"), [(2, 4), (4, 8), (4, 16), (2, 2), (4, 4)])
def test_in_flight_matches_torchs_schedule_order(schedule: str, pp_size: int, micro_batches: int) -> None:
    if schedule == "zbv" and micro_batches < 2 * pp_size - 1:
        pytest.skip("torch's ZBV order fills the pipeline with 2p - 1 micro-batches")
    for rank in range(pp_size):
        expected = _peak_in_flight(_torch_order(schedule, pp_size, micro_batches, rank))
        assert in_flight_micro_batches(schedule, pp_size, rank, micro_batches) == expected


def test_one_stage_schedules_in_flight() -> None:
    assert [in_flight_micro_batches("gpipe", 4, r, 8) for r in range(4)] == [{r: 8} for r in range(4)]
    assert [in_flight_micro_batches("1f1b", 4, r, 8) for r in range(4)] == [{0: 4}, {1: 3}, {2: 2}, {3: 1}]
    assert in_flight_micro_batches("1f1b", 4, 0, 2) == {0: 2}  # never more than the step has


def _orders(schedule: str, pp_size: int, micro_batches: int) -> dict[int, list[str]]:
    if schedule in ("gpipe", "1f1b"):
        return {r: single_stage_order(schedule, pp_size, r, micro_batches) for r in range(pp_size)}
    return {r: [str(a) for a in _torch_order(schedule, pp_size, micro_batches, r)] for r in range(pp_size)}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "zbv"])
@pytest.mark.parametrize(("pp_size", "micro_batches"), [(2, 4), (2, 8), (4, 8), (4, 16), (8, 16), (8, 64)])
def test_bubble_formulas_are_the_schedules_bubble_under_equal_passes(
    schedule: str, pp_size: int, micro_batches: int
) -> None:
    """Each closed form equals the idle share of the schedule's own order (torch's, for two stages per rank) laid
    out on balanced stages; a full backward may take any multiple of its forward, ZB-V's three passes are equal."""
    orders = _orders(schedule, pp_size, micro_batches)
    for backward_over_forward in (1.0, 2.0, 3.0) if schedule != "zbv" else (1.0,):
        seconds = {"F": 1.0, "B": backward_over_forward, "I": 1.0, "W": 1.0}
        durations = {a: seconds[a.lstrip("0123456789")[0]] for order in orders.values() for a in order}
        idle = simulated_bubble(orders, durations)
        assert idle == {r: pytest.approx(bubble_fraction(schedule, pp_size, micro_batches)) for r in orders}


def test_the_simulation_waits_for_what_an_action_needs() -> None:
    """Unequal passes: a last stage twice as slow holds the first rank's backwards back; ZB-V's longer input
    gradients (the CPU's: attention's backward has no weights) leave a bubble its formula does not have; and
    orders that wait on each other are refused."""
    orders = _orders("gpipe", 2, 2)  # 0F0 0F1 0B0 0B1 | 1F0 1F1 1B0 1B1
    slow_last = {"0F0": 1, "0F1": 1, "0B0": 2, "0B1": 2, "1F0": 2, "1F1": 2, "1B0": 4, "1B1": 4}
    # rank 1: F0 at 1–3, F1 3–5, B0 5–9, B1 9–13; rank 0: F 0–2, B0 waits for 1B0 (9–11), B1 for 1B1 (13–15)
    assert simulate_step(orders, slow_last) == {0: (15.0, 6.0), 1: (13.0, 12.0)}
    zbv = _orders("zbv", 2, 8)
    equal = {a: 1.0 for order in zbv.values() for a in order}
    long_input = {a: 2.0 if "I" in a else 1.0 for a in equal}
    assert max(simulated_bubble(zbv, long_input).values()) > bubble_fraction("zbv", 2, 8)
    assert simulated_bubble(zbv, equal)[0] == pytest.approx(bubble_fraction("zbv", 2, 8))
    with pytest.raises(ValueError, match="wait on each other"):
        simulate_step(
            {0: ["0B0", "0F0"], 1: ["1F0", "1B0"]}, dict.fromkeys(["0B0", "0F0", "1F0", "1B0"], 1.0)
        )


def test_bubble_formulas() -> None:
    assert bubble_fraction("1f1b", 1, 8) == 0.0
    assert bubble_fraction("gpipe", 4, 8) == pytest.approx(3 / 11)  # (p − 1)/(m + p − 1)
    assert bubble_fraction("1f1b", 8, 128) == pytest.approx(7 / 135)
    assert bubble_fraction("interleaved_1f1b", 4, 8) == pytest.approx(3 / 19)  # (p − 1)/(v·m + p − 1), v = 2
    assert bubble_fraction("zbv", 4, 8) == pytest.approx(3 / 51)  # (p − 1)/(6m + p − 1)
    # b × s × h × bytes, forward and backward, at each of a rank's stage boundaries
    assert p2p_bytes_per_micro_batch("1f1b", 2, 1024, 512, 2) == 2 * 2 * 1024 * 512 * 2
    assert p2p_bytes_per_micro_batch("zbv", 2, 1024, 512, 2, tp_size=2) == 2 * 2 * 1024 * 512 * 2


def test_llama3_split() -> None:
    assert balanced_split(126, 2) == ()
    assert balanced_split(126, 8) == (15, 31, 47, 63, 79, 95, 111)  # 15, 16 × 6, 15 layers
    assert balanced_split(126, 16) == tuple(range(7, 120, 8))
    assert balanced_split(80, 3) is None


def _llama8() -> ModelConfig:
    return replace(get_model_config("llama-tiny"), dim=384, num_layers=8, num_heads=6, num_kv_heads=2,
                   ffn_dim=1024, context_length=256, vocab_size=65)  # fmt: skip


def _estimate(schedule: str, rank: int | None, micro: int = 8, accumulation: int = 4) -> Any:
    plan = ParallelPlan.build(strategy="fsdp", world_size=2, pp_size=2, pp_schedule=schedule)
    batch = BatchPlan.from_micro_batch(micro, accumulation=accumulation, context_length=256)
    return estimate_memory(_llama8(), plan, batch, pp_rank=rank)


def test_each_stage_holds_its_layers_and_its_micro_batches() -> None:
    model = _llama8()
    sh = model_shape(model)
    e = element_bytes("32-true", "fsdp")
    first, last = _estimate("gpipe", 0), _estimate("gpipe", 1)
    # parameters: stage 0 the embeddings and 4 blocks, stage 1 4 blocks, the final norm and the head (fp32 shards
    # over one rank, and the gathered copy FSDP keeps under a pipeline)
    assert first.params_bytes == round(2 * 4 * (sh.embedding + 4 * sh.block))
    assert last.params_bytes == round(2 * 4 * (sh.root - sh.embedding + 4 * sh.block))
    assert first.pp_stages == (0,) and last.pp_stages == (1,)
    # GPipe: all 4 micro-batches on both stages; the whole model's activations of one micro-batch are the two
    # stages' of one (the receive buffers and the last stage's logits come on top)
    assert first.in_flight_micro_batches == last.in_flight_micro_batches == 4
    one = activation_bytes(sh, 8, 256, e, False, "cpu")
    assert 4 * one < first.activations_bytes + last.activations_bytes < 4 * one * 1.5
    # 1F1B: the first stage holds pp_size = 2 micro-batches, the last one: at most GPipe's
    f1b = [_estimate("1f1b", r) for r in (0, 1)]
    assert [e.in_flight_micro_batches for e in f1b] == [2, 1]
    assert f1b[0].activations_bytes < first.activations_bytes and f1b[0].total_bytes <= first.total_bytes
    # the default is the rank with the largest peak
    assert _estimate("1f1b", None).pp_rank == max((0, 1), key=lambda r: f1b[r].total_bytes)
    # two stages per rank (ZBV: rank 0 holds the first and the last stage)
    zbv = _estimate("zbv", 0)
    assert zbv.pp_stages == (0, 3) and zbv.in_flight_micro_batches == 4


def test_a_pipeline_rank_outside_the_pipeline_is_refused() -> None:
    from gaudi3_scale.config.errors import UserInputError

    with pytest.raises(UserInputError, match="pp_rank must be between 0 and 1"):
        _estimate("1f1b", 2)
