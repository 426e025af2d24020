"""What the pipeline schedules cost, as arithmetic (no torch): the micro-batches each rank keeps in flight (the
activations it holds at its peak), the bubble (the share of a step a rank idles), and the bytes a stage boundary
carries. The memory estimator (`tune.memory`), the step-time model (`forecast.model`) and
`benchmarks/bench_pipeline.py` read them from here; `distributed.stages` says which stages a rank holds.

Notation: p = pp_size, m = micro-batches per step (the train accumulation), v = stages per rank
(`STAGES_PER_RANK`), r = the rank's index in the pipeline.
"""

from __future__ import annotations

from gaudi3_scale.distributed.config import STAGES_PER_RANK
from gaudi3_scale.distributed.stages import local_stages

__all__ = [
    "balanced_split",
    "bubble_fraction",
    "bubble_source",
    "in_flight_micro_batches",
    "p2p_bytes_per_micro_batch",
]


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
        return 0.0
    v = STAGES_PER_RANK[schedule]
    return (p - 1) / (v * m + p - 1)


def bubble_source(schedule: str) -> str:
    """Where `bubble_fraction`'s formula comes from, in words."""
    if schedule == "zbv":
        return (
            "ZB-V's bubble is 0 when forward, input-gradient and weight-gradient passes take equal time (Qi et al. "
            "2024, arXiv:2401.10241 §6; sail-sg/zero-bubble-pipeline-parallelism's table)"
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
