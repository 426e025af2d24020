"""The tuner's winner: its config (best.yaml) at another global batch, and which trial the search declares it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gaudi3_scale.config.core import parse_overrides
from gaudi3_scale.train.config import RunConfig, build_run_config
from gaudi3_scale.tune.config import TuneConfig
from gaudi3_scale.tune.search import SearchOutcome, TrialCache, search
from gaudi3_scale.tune.space import Candidate, build_space
from gaudi3_scale.tune.trial import TrialResult


def _candidate(global_batch: int, micro_batch: int) -> Candidate:
    return Candidate(strategy="auto", precision="32-true", global_batch_size=global_batch,
                     micro_batch_size=micro_batch, activation_checkpointing=False, compile=False,
                     threads=1)  # fmt: skip


def test_every_step_count_keeps_its_tokens_when_the_global_batch_grows() -> None:
    """At 8× the global batch a 2000-step run is 250 steps: its checkpoints, validations, logs, spike windows and
    profile move to 1/8 of their steps too (rounded, at least 1, 0 stays off), so a checkpoint every 500 steps
    does not become none before the end; the note names each one."""
    from gaudi3_scale.tune.tuner import winner_config

    base = build_run_config(None, parse_overrides([
        "--model.name", "llama-tiny", "--train.global_batch_size", "12", "--checkpoint.keep_every_steps", "1000",
        "--checkpoint.light_every_steps", "0", "--train.throughput_warmup_steps", "16",
        "--train.profile_start_step", "100", "--benchmark.warmup_steps", "3",
    ]))  # fmt: skip
    best, note = winner_config(base, _candidate(96, 12), 1, "sqrt")
    assert best.train.max_steps == 250
    assert (best.checkpoint.every_steps, best.checkpoint.keep_every_steps) == (63, 126)  # still a multiple
    assert best.checkpoint.light_every_steps == 0  # off stays off
    assert (best.train.val_every_steps, best.train.log_every_steps) == (31, 1)
    assert (best.train.throughput_warmup_steps, best.train.profile_start_step, best.train.profile_num_steps) == (
        2, 13, 1)  # fmt: skip
    assert (best.health.spike_window_steps, best.health.spike_warmup_steps) == (13, 3)
    assert best.benchmark.warmup_steps == 1  # 3 / 8 rounds to 0, but 0 would mean none
    assert "checkpoint.every_steps 500 → 63" in note and "health.spike_window_steps 100 → 13" in note
    assert "keep their token counts too" in note
    # at the config's own global batch nothing moves
    same, note = winner_config(base, _candidate(12, 12), 1, "sqrt")
    assert same.checkpoint == base.checkpoint and same.health == base.health and same.train.max_steps == 2000
    assert "→" not in note


def _step_fields(section: object, prefix: str) -> set[str]:
    return {
        f"{prefix}.{f.name}"
        for f in dataclasses.fields(section)  # type: ignore[arg-type]
        if f.name.endswith(("_steps", "_step")) and f.type in ("int", "int | None")
    }


def test_every_field_counted_in_steps_is_rescaled() -> None:
    """A field in optimizer steps added to any section of the run config must join `STEP_FIELDS` (or the
    schedule's own rescale): otherwise a tuned config keeps it in steps and stretches it in tokens."""
    from gaudi3_scale.tune.lr import STEP_FIELDS

    config = RunConfig()
    in_steps = {
        name
        for f in dataclasses.fields(RunConfig)
        if dataclasses.is_dataclass(section := getattr(config, f.name))
        for name in _step_fields(section, f.name)
    }
    rescaled = {f"{sec}.{name}" for sec, names in STEP_FIELDS.items() for name in names}
    # rollback_skip_batches counts data steps (batches of the global batch), not optimizer steps: rescaled too
    assert in_steps | {"health.rollback_skip_batches"} == rescaled | {"optim.warmup_steps", "train.max_steps"}


def _fake_search(tmp_path: Path, speed: dict[tuple[int, int], float]) -> SearchOutcome:
    """A search over micro-batches 8/4/2/1 of global batch 8 and 2 or 1 threads, whose trials take their tokens/s
    from `speed` (micro-batch, threads): only how the search ranks fixed numbers is under test."""
    base = build_run_config(None, [("model.name", "llama-tiny"), ("train.global_batch_size", "8")])
    space = build_space(base, world_size=1, precisions=("32-true",), activation_checkpointing=False, compile=False,
                        threads=(2, 1), pipeline=False)  # fmt: skip

    def run(c: Candidate, estimate: int | None) -> TrialResult:
        tps = speed[c.micro_batch_size, c.threads or 0]
        return TrialResult(candidate=c, status="ok", tokens_per_s=tps, step_time_s=8 * 64 / tps)

    cache = TrialCache(tmp_path / "trials.jsonl", "fake")
    return search(space, TuneConfig(memory_budget_bytes=2**40), run=run, estimate=lambda c: 1, cache=cache)


def test_gains_below_min_gain_do_not_pick_the_winner(tmp_path: Path) -> None:
    """Micro-batch 4 measures 1 % faster than 8 and one thread another 1 %: each is under min_gain (2 %), noise
    the walk itself stops at, so the incumbent (the largest micro-batch) stays the winner and a note says why
    the table ranks another trial first."""
    speed = {(8, 2): 100_000.0, (4, 2): 101_000.0, (2, 2): 90_000.0, (1, 2): 80_000.0, (8, 1): 101_000.0}
    outcome = _fake_search(tmp_path, speed)
    assert outcome.best is not None
    assert (outcome.best.candidate.micro_batch_size, outcome.best.candidate.threads) == (8, 2)
    assert outcome.ranked()[0].tokens_per_s == 101_000.0  # the table's first, not the winner
    assert any("1.0% faster than the winner, under min_gain 2%" in note for note in outcome.notes)
    ok = [r.tokens_per_s or 0.0 for r in outcome.results if r.status == "ok"]
    assert max(ok) < outcome.best.tokens_per_s * 1.02  # no trial is min_gain faster than the winner


@pytest.mark.parametrize("faster", [(4, 2), (8, 1)])
def test_a_trial_min_gain_faster_than_the_incumbent_wins(tmp_path: Path, faster: tuple[int, int]) -> None:
    speed = {(8, 2): 100_000.0, (4, 2): 101_000.0, (2, 2): 90_000.0, (1, 2): 80_000.0, (8, 1): 100_500.0,
             (4, 1): 100_000.0}  # fmt: skip
    speed[faster] = 103_000.0
    outcome = _fake_search(tmp_path, speed)
    assert outcome.best is not None and outcome.best.tokens_per_s == 103_000.0
    assert (outcome.best.candidate.micro_batch_size, outcome.best.candidate.threads) == faster
    assert not any("faster than the winner" in note for note in outcome.notes)


@pytest.mark.parametrize("refined", ["threads", "compile"])
def test_memory_is_the_limit_when_the_winner_s_threads_or_compile_were_refined(
    tmp_path: Path, refined: str
) -> None:
    """Micro-batch 8 runs out of memory, so the group stops at 4; the refinement then moves the winner to one
    thread (or compile on). The next micro-batch up ran at the group's own settings (2 threads, compile off):
    the limit is memory, not a throughput plateau."""
    base = build_run_config(None, [("model.name", "llama-tiny"), ("train.global_batch_size", "8")])
    space = build_space(base, world_size=1, precisions=("32-true",), activation_checkpointing=False,
                        compile=(False, True), threads=(2, 1), pipeline=False)  # fmt: skip

    def run(c: Candidate, estimate: int | None) -> TrialResult:
        if c.micro_batch_size == 8:
            return TrialResult(candidate=c, status="oom", reason="out of memory")
        tps = {4: 100_000.0, 2: 90_000.0, 1: 80_000.0}[c.micro_batch_size]
        if (refined == "threads" and c.threads == 1) or (refined == "compile" and c.compile):
            tps *= 1.05
        return TrialResult(candidate=c, status="ok", tokens_per_s=tps, step_time_s=8 * 64 / tps)

    cache = TrialCache(tmp_path / "trials.jsonl", "fake")
    outcome = search(space, TuneConfig(memory_budget_bytes=2**40), run=run, estimate=lambda c: 1, cache=cache)
    assert outcome.best is not None
    winner = outcome.best.candidate
    assert winner.micro_batch_size == 4 and (winner.threads == 1 if refined == "threads" else winner.compile)
    assert outcome.limit == "memory: micro-batch 8 does not fit (out of memory)"


@pytest.mark.parametrize(
    ("overrides", "global_batch", "expect"),
    [
        # a profile window at the end of the run (5 steps, 3 at 2×): still at its end after rounding
        (["--train.profile_start_step", "1995", "--train.profile_num_steps", "5"], 16,
         {"train.profile_start_step": 997, "train.profile_num_steps": 3}),
        # light every 4 and full every 10 both round to 1 at 8×: light ones would all fall on full ones
        (["--checkpoint.every_steps", "10", "--checkpoint.light_every_steps", "4"], 64,
         {"checkpoint.every_steps": 1, "checkpoint.light_every_steps": 0}),
        # a warm-up of 2 of 3 steps at 4×: one step is left, and it is measured
        (["--train.max_steps", "3", "--train.throughput_warmup_steps", "2"], 32,
         {"train.max_steps": 1, "train.throughput_warmup_steps": 0}),
        # a rollback skips as many tokens as before
        (["--health.rollback_skip_batches", "200"], 32, {"health.rollback_skip_batches": 50}),
    ],
)  # fmt: skip
def test_rounding_each_field_leaves_a_config_the_trainer_takes(
    overrides: list[str], global_batch: int, expect: dict[str, int]
) -> None:
    """Each field rounds on its own and max_steps rounds up: what that pushes past the run or onto another field is
    put back where the config takes it, instead of the whole global batch being refused before the search."""
    from gaudi3_scale.tune.tuner import winner_config

    base = build_run_config(None, parse_overrides(["--model.name", "llama-tiny", "--train.global_batch_size", "8",
                                                   *overrides]))  # fmt: skip
    best, _ = winner_config(base, _candidate(global_batch, 1), 1, "sqrt")
    for dotted, value in expect.items():
        section, name = dotted.split(".")
        assert getattr(getattr(best, section), name) == value, dotted
