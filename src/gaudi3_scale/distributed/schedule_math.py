"""What the pipeline schedules cost, as arithmetic (no torch): the micro-batches each rank keeps in flight (the
activations it holds at its peak), the bubble (the share of a step a rank idles), and the bytes a stage boundary
carries. The memory estimator (`tune.memory`), the step-time model (`forecast.model`) and
`benchmarks/bench_pipeline.py` read them from here; `distributed.stages` says which stages a rank holds.

Notation: p = pp_size, m = micro-batches per step (the train accumulation), v = stages per rank
(`STAGES_PER_RANK`), r = the rank's index in the pipeline.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from gaudi3_scale.distributed.config import STAGES_PER_RANK
from gaudi3_scale.distributed.stages import local_stages

__all__ = [
    "balanced_split",
    "bubble_fraction",
    "bubble_source",
    "in_flight_micro_batches",
    "p2p_bytes_per_micro_batch",
    "simulate_step",
    "simulated_bubble",
    "single_stage_order",
]

# torch's action strings (torch/distributed/pipelining/schedules.py `_Action`): stage, kind, micro-batch; F forward,
# B full backward, I input-gradient backward, W weight-gradient backward (the last two: zero-bubble schedules)
_COMPUTE_ACTION = re.compile(r"^(\d+)([FBIW])(\d+)$")


def in_flight_micro_batches(schedule: str, pp_size: int, pp_rank: int, micro_batches: int) -> dict[int, int]:
    """Stage index → micro-batches whose forward has run and whose backward has not, at the rank's peak.

    Read from torch 2.13's schedules (torch/distributed/pipelining/schedules.py), which follow the papers:
    * gpipe (`ScheduleGPipe`): every forward before any backward: m on every stage;
    * 1f1b (`Schedule1F1B`): `warmup_chunks = min(m, num_stages - stage_index)` forwards, then one forward and
      one backward at a time: min(m, p − r), so the first stage holds the most (PipeDream-Flush, Narayanan et
      al. 2021, arXiv:2104.04473 §2.2.1: "at most p micro-batches");
    * interleaved_1f1b (`ScheduleInterleaved1F1B._calculate_single_rank_operations`, `_get_warmup_ops` with
      multiply_factor 2; Megatron-LM's `get_num_warmup_microbatches` is the same count): warm-up
      (v − 1)·m_round + 2(p − 1 − r) forwards (m_round = m / max(1, m // p)), capped at v·m, then one forward more
      before the first backward; forwards run m_round micro-batches on one local stage, then on the next;
    * zbv (`ScheduleZBVZeroBubble`; Qi et al. 2024, arXiv:2401.10241 §6, "the same peak memory as 1F1B"): the
      warm-up runs 2p − r − 1 forwards on the rank's first stage (r) and r on its second (2p − 1 − r); in the steady
      state one more forward on either before its backward: 2p stage-micro-batches, either (2p − r, r) or
      (2p − r − 1, r + 1): the one returned is the second, which is the peak when the second stage is the last
      (rank 0: it holds the head's logits).
    """
    stages = local_stages(schedule, pp_size, pp_rank)
    m = micro_batches
    if schedule == "gpipe":
        return {stages[0]: m}
    if schedule == "1f1b":
        return {stages[0]: min(m, pp_size - pp_rank)}
    if schedule == "zbv":
        return {stages[0]: min(m, 2 * pp_size - pp_rank - 1), stages[1]: min(m, pp_rank + 1)}
    per_rank = STAGES_PER_RANK[schedule]
    per_round = m // max(1, m // pp_size)
    warmup = min((per_rank - 1) * per_round + 2 * (pp_size - 1 - pp_rank), per_rank * m)
    counts = dict.fromkeys(stages, 0)
    for forward in range(min(warmup + 1, per_rank * m)):
        counts[stages[(forward // per_round) % per_rank]] += 1
    return counts


def bubble_fraction(schedule: str, pp_size: int, micro_batches: int) -> float:
    """The share of a step's wall time a pipeline rank idles, under equal forward and backward times per stage
    (`bubble_source` says whose formula); 0 without a pipeline."""
    p, m = pp_size, micro_batches
    if p == 1:
        return 0.0
    if schedule == "zbv":
        return (p - 1) / (6 * m + p - 1)
    v = STAGES_PER_RANK[schedule]
    return (p - 1) / (v * m + p - 1)


def bubble_source(schedule: str) -> str:
    """Where `bubble_fraction`'s formula comes from, in words."""
    if schedule == "zbv":
        return (
            "(p − 1)/(6m + p − 1): torch's ZB-V order (ScheduleZBVZeroBubble, Qi et al. 2024, arXiv:2401.10241 "
            "§6) idles p − 1 passes of one stage in 6m (2 stages × m micro-batches × forward, input-gradient and "
            "weight-gradient passes) when the three passes take equal time (`simulated_bubble` over torch's order; "
            "the paper's zero is its steady state); longer input-gradient passes leave more"
        )
    if STAGES_PER_RANK[schedule] > 1:
        return (
            "(p − 1)/(v·m + p − 1), v = 2 stages per rank: interleaving divides the bubble time by v (Narayanan et "
            "al. 2021, arXiv:2104.04473 §2.2.2: bubble time fraction (p − 1)/(v·m) of the ideal step)"
        )
    return (
        "(p − 1)/(m + p − 1): p − 1 of the m + p − 1 forward-backward slots idle (GPipe, Huang et al. 2019; "
        "1F1B, Narayanan et al. 2021 §2.2.1: bubble time fraction (p − 1)/m of the ideal step)"
    )


def p2p_bytes_per_micro_batch(
    schedule: str, micro_batch_size: int, context_length: int, dim: int, element_bytes: int, tp_size: int = 1
) -> float:
    """Bytes one rank sends over the pipeline per micro-batch: the forward activation (b × s × h) to the next stage
    and the gradient of its input (the same size) to the previous one, at every stage boundary it owns. The
    schedules with two stages per rank cross ranks twice as often (ZB-V: "2× the pipeline communication of
    1F1B", Qi et al. 2024; interleaved likewise, Narayanan et al. 2021 §2.2.2). Under tensor parallel with sequence
    parallel each rank sends its 1/tp slice of the sequence (torchtitan)."""
    return 2 * STAGES_PER_RANK[schedule] * micro_batch_size * context_length * dim * element_bytes / tp_size


def balanced_split(num_layers: int, stages: int) -> tuple[int, ...] | None:
    """A `parallel.pp_split` for `stages` stages: () when the layers divide evenly; else, when num_layers + 2 does,
    the Llama 3 split, one layer fewer on the first and the last stage, which also hold the embeddings and the head
    (Dubey et al. 2024, arXiv:2407.21783 §3.3.2: 405B's 126 layers in 16 stages); None when neither fits."""
    if stages < 2 or num_layers % stages == 0:
        return ()
    if (num_layers + 2) % stages or (num_layers + 2) // stages < 2:
        return None
    per_stage = (num_layers + 2) // stages
    return tuple(stage * per_stage - 1 for stage in range(1, stages))


def single_stage_order(schedule: str, pp_size: int, pp_rank: int, micro_batches: int) -> list[str]:
    """The compute actions of a one-stage-per-rank schedule in the order torch 2.13 runs them, as action strings
    (`ScheduleGPipe._step_microbatches`: every forward, then every backward; `Schedule1F1B._step_microbatches`:
    min(m, p − r) forwards, then a backward and a forward in turn, then the backwards left). Torch's own
    `pipeline_order` for these two classes is a drawing, not what runs (its 1F1B lists forward 1 before 0 on the
    last stage): `simulated_bubble` reads this instead."""
    m, stage = micro_batches, pp_rank
    if schedule == "gpipe":
        return [f"{stage}F{i}" for i in range(m)] + [f"{stage}B{i}" for i in range(m)]
    if schedule != "1f1b":
        raise ValueError(
            f"{schedule} runs {STAGES_PER_RANK[schedule]} stages per rank: read torch's pipeline_order"
        )
    warmup = min(m, pp_size - stage)
    order = [f"{stage}F{i}" for i in range(warmup)]
    forward = warmup
    for backward in range(m):
        order.append(f"{stage}B{backward}")
        if forward < m:
            order.append(f"{stage}F{forward}")
            forward += 1
    return order


def simulated_bubble(orders: Mapping[int, Sequence[str]], seconds: Mapping[str, float]) -> dict[int, float]:
    """Each rank's idle share of the step `simulate_step` lays out."""
    timeline = simulate_step(orders, seconds)
    step = max(finish for finish, _ in timeline.values())
    return {rank: 1 - busy / step for rank, (_, busy) in timeline.items()}


def simulate_step(
    orders: Mapping[int, Sequence[str]], seconds: Mapping[str, float]
) -> dict[int, tuple[float, float]]:
    """Rank → (when it finishes, seconds it computed) for a step in which each rank runs its compute actions in
    `orders`' order (torch's action strings "{stage}{F|B|I|W}{micro-batch}" as a schedule's `pipeline_order` lists
    them; any other entry, such as a send or an unshard, is skipped), each taking `seconds[action]`, and waits only
    for the actions whose output it needs: a forward for the previous stage's forward of that micro-batch, a
    backward (B or I) for its own forward and the next stage's backward, a weight gradient (W) for its input
    gradient. Transfers are free.

    The closed forms of `bubble_fraction` are this with balanced stages and equal pass times; with the pass times a
    run measured it is the schedule's bubble on that run's compute alone (stage imbalance, a backward longer than
    its forward, ZB-V's unequal I and W), what `benchmarks/bench_pipeline.py` holds its measured bubble against.
    `simulated_bubble` gives each rank's idle share of it.
    """
    actions: dict[int, list[tuple[int, str, int]]] = {}
    for rank, order in orders.items():
        parsed = [_COMPUTE_ACTION.match(str(entry)) for entry in order if entry]
        actions[rank] = [(int(m[1]), m[2], int(m[3])) for m in parsed if m]
    last_stage = max(stage for listed in actions.values() for stage, _, _ in listed)
    label = {action: f"{action[0]}{action[1]}{action[2]}" for listed in actions.values() for action in listed}
    done: dict[tuple[int, str, int], float] = {}
    free = dict.fromkeys(actions, 0.0)
    busy = dict.fromkeys(actions, 0.0)
    position = dict.fromkeys(actions, 0)

    def needs(stage: int, kind: str, micro: int) -> list[tuple[int, str, int]] | None:
        """The finish times the action waits for, or None while one of them has not run."""
        wanted: list[tuple[int, tuple[str, ...], int]]
        if kind == "F":
            wanted = [(stage - 1, ("F",), micro)] if stage else []
        elif kind == "W":
            wanted = [(stage, ("I",), micro)]
        else:
            wanted = [(stage, ("F",), micro)] + (
                [(stage + 1, ("B", "I"), micro)] if stage < last_stage else []
            )
        found = []
        for s, kinds, m in wanted:
            key = next(((s, k, m) for k in kinds if (s, k, m) in done), None)
            if key is None:
                return None
            found.append(key)
        return found

    remaining = sum(len(listed) for listed in actions.values())
    while remaining:
        progressed = False
        for rank, listed in actions.items():
            while position[rank] < len(listed):
                action = listed[position[rank]]
                waits = needs(*action)
                if waits is None:
                    break
                took = seconds[label[action]]
                start = max([free[rank], *(done[w] for w in waits)])
                done[action] = free[rank] = start + took
                busy[rank] += took
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {
                rank: listed[position[rank]]
                for rank, listed in actions.items()
                if position[rank] < len(listed)
            }
            raise ValueError(f"the orders wait on each other: {stuck}")
    return {rank: (free[rank], busy[rank]) for rank in actions}
