"""The tuner's pure parts: LR rescaling rules, sizes, the search space, failure classification."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from gaudi3_scale.config.core import parse_overrides
from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.distributed.jobs import classify_failure
from gaudi3_scale.train.config import RunConfig, build_run_config
from gaudi3_scale.tune.config import TuneConfig, parse_bytes
from gaudi3_scale.tune.lr import rescale_schedule
from gaudi3_scale.tune.memory import process_peak_bytes
from gaudi3_scale.tune.space import Candidate, SearchSpace, build_space, divisors

if TYPE_CHECKING:
    from gaudi3_scale.tune.api import AdaptiveBatchFinder


def _rescale(rule: str, to_batch: int) -> tuple[float, float, int, int]:
    s = rescale_schedule(
        lr=1e-3,
        min_lr=1e-4,
        warmup_steps=100,
        max_steps=2000,
        from_batch=12,
        to_batch=to_batch,
        rule=rule,  # type: ignore[arg-type]
    )
    return s.lr, s.min_lr, s.warmup_steps, s.max_steps


def test_linear_rule_scales_lr_by_the_batch_ratio_and_keeps_token_counts() -> None:
    lr, min_lr, warmup, steps = _rescale("linear", 48)
    assert lr == pytest.approx(4e-3) and min_lr == pytest.approx(4e-4)
    assert warmup == 25 and steps == 500  # 100 × 12/48 and 2000 × 12/48: same tokens


def test_sqrt_rule_scales_lr_by_the_square_root() -> None:
    lr, min_lr, warmup, steps = _rescale("sqrt", 48)
    assert lr == pytest.approx(2e-3) and min_lr == pytest.approx(2e-4)
    assert (warmup, steps) == (25, 500)
    lr, _, warmup, steps = _rescale("sqrt", 6)  # a smaller batch: smaller lr, more steps
    assert lr == pytest.approx(1e-3 / math.sqrt(2)) and (warmup, steps) == (200, 4000)


def test_rounding_keeps_at_least_the_tokens_and_none_keeps_lr() -> None:
    lr, _, warmup, steps = _rescale("none", 36)
    assert lr == 1e-3 and warmup == 34 and steps == 667  # ceil(100/3), ceil(2000/3)
    same = rescale_schedule(
        lr=1e-3, min_lr=0, warmup_steps=7, max_steps=9, from_batch=8, to_batch=8, rule="sqrt"
    )
    assert (same.lr, same.warmup_steps, same.max_steps, same.factor) == (1e-3, 7, 9, 1.0)
    assert same.describe("sqrt").startswith("global batch unchanged")


def test_unknown_rule_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown learning-rate rule 'cubic'"):
        rescale_schedule(lr=1, min_lr=0, warmup_steps=1, max_steps=1, from_batch=1, to_batch=2, rule="cubic")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("16GiB", 16 * 2**30),
        ("512MiB", 512 * 2**20),
        ("80GB", 80 * 10**9),
        ("1e9", 10**9),
        ("1.5 gib", 3 * 2**29),
    ],
)
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["lots", "16 GiBs", "-3GB", "0"])
def test_parse_bytes_refuses_what_it_cannot_read(text: str) -> None:
    with pytest.raises(UserInputError, match="--memory-budget"):
        parse_bytes(text)


def test_tune_config_refuses_bad_values() -> None:
    with pytest.raises(UserInputError, match="world_size: must be >= 1, got 0"):
        TuneConfig(world_size=0)
    with pytest.raises(UserInputError, match="target_utilization"):
        TuneConfig(target_utilization=1.5)
    with pytest.raises(UserInputError, match="time_budget_s: must be > 0"):
        TuneConfig(time_budget_s=0)
    with pytest.raises(UserInputError, match="trial_timeout_s: must be a finite number, got nan"):
        TuneConfig(trial_timeout_s=float("nan"))


def test_divisors_and_candidates_keep_the_global_batch() -> None:
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    base = build_run_config(None, [("train.global_batch_size", "24")])
    space = build_space(base, world_size=2, strategies=("ddp", "fsdp"), compile=(False,), threads=(1,))
    assert space.micro_batches(24) == [1, 2, 3, 4, 6, 12]
    cands = space.candidates()
    assert len(cands) == 2 * len(space.precisions) * 6 * 2  # strategies × precisions × micro × ckpt
    for c in cands:
        assert c.micro_batch_size * c.accumulation(2) * 2 == 24
    assert len({c.key for c in cands}) == len(cands)


def test_a_choice_given_twice_is_one_point_of_the_grid() -> None:
    """`--threads 1,1` was "tuning 8 configurations … threads 1/1" (and grid_size 8 in tune.json) for 4 points;
    a strategy, precision or on/off value given twice counted double the same way."""
    base = build_run_config(None, [("train.global_batch_size", "8")])
    once = build_space(base, world_size=2, strategies=("ddp", "fsdp"), precisions=("32-true",),
                       compile=(False,), threads=(1,))  # fmt: skip
    twice = build_space(base, world_size=2, strategies=("ddp", "fsdp", "ddp"), precisions=("32-true", "32-true"),
                        compile=(False, False), threads=(1, 1))  # fmt: skip
    assert twice == once
    assert len(twice.candidates()) == len({c.key for c in twice.candidates()})
    assert "threads 1," in twice.describe() and "1/1" not in twice.describe()
    # the order first given is kept: the first thread count is the one the micro-batch search runs at
    assert build_space(base, world_size=2, threads=(2, 1, 2)).threads == (2, 1)


def test_candidate_overrides_build_a_valid_run_config() -> None:
    c = Candidate(
        strategy="fsdp",
        precision="32-true",
        global_batch_size=24,
        micro_batch_size=3,
        activation_checkpointing=True,
        compile=False,
        threads=1,
    )
    pairs = [tuple(o[2:].split("=", 1)) for o in c.overrides()]
    cfg = build_run_config(None, [*pairs, ("parallel.nproc_per_node", "2")])  # type: ignore[list-item]
    assert cfg.parallel.strategy == "fsdp" and cfg.parallel.activation_checkpointing
    assert cfg.batch_plan(2).accumulation == 4 == c.accumulation(2)
    assert c.label(2) == "fsdp 32-true gb 24 mb 3×4 ckpt 1 thr"


def test_space_refuses_a_global_batch_the_ranks_cannot_split_and_unknown_choices() -> None:
    base = build_run_config(None, [("train.global_batch_size", "12")])
    with pytest.raises(UserInputError, match="global batch 12 sequences cannot be split over 5 ranks"):
        build_space(base, world_size=5)
    with pytest.raises(UserInputError, match=r"--strategies: zero9 not available.*allowed: ddp"):
        build_space(base, world_size=2, strategies=("zero9",))
    with pytest.raises(UserInputError, match="--precisions: 16-mixed not supported on cpu"):
        build_space(base, world_size=1, precisions=("16-mixed",))
    assert build_space(base, world_size=1).strategies == ("auto",)


@pytest.mark.parametrize(
    ("output", "status", "fragment"),
    [
        (
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total)",
            "oom",
            "out of memory (cuda)",
        ),
        (
            "RuntimeError: [enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: "
            "you tried to allocate 6576668672 bytes",
            "oom",
            "out of memory (cpu)",
        ),
        (
            "RuntimeError: [Rank:1] FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed for size::939524096 (896)MB",
            "oom",
            "out of memory (hpu)",
        ),
        ("Traceback (most recent call last):\nImportError: deepspeed is broken\n", "crash", "ImportError"),
    ],
)
def test_failures_are_classified_from_any_rank_output(output: str, status: str, fragment: str) -> None:
    got, reason = classify_failure("[rank0] starting\n" + output + "\n[rank0] exiting", 1)
    assert got == status and fragment in reason


def test_a_sigkill_nobody_sent_counts_as_out_of_memory() -> None:
    assert classify_failure("", -9)[0] == "oom"
    assert classify_failure("", 137)[0] == "oom"
    status, reason = classify_failure("", 3)
    assert status == "crash" and reason == "exit code 3: exit code 3, no output"


def test_a_rank_s_own_error_beats_the_launcher_s_report_of_it() -> None:
    """The elastic agent ends a failed distributed trial with its own traceback and a report; the cause is the
    rank's line above them (output as `gaudi3 train --nproc-per-node 2` prints it when a rank exits 2)."""
    output = "\n".join(
        [
            "gaudi3: error: parallel.strategy deepspeed_zero2 needs DeepSpeed: pip install 'gaudi3-scale[deepspeed]'",
            "Traceback (most recent call last):",
            '  File ".../torch/distributed/launcher/api.py", line 383, in launch_agent',
            "    raise ChildFailedError(",
            "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
            "  exitcode  : 2 (pid: 3119) ",
            "  error_file: <N/A>",
            "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
        ]
    )
    status, reason = classify_failure(output, 1)
    assert status == "crash"
    assert reason == (
        "exit code 1: gaudi3: error: parallel.strategy deepspeed_zero2 needs DeepSpeed: "
        "pip install 'gaudi3-scale[deepspeed]'"
    )
    status, reason = classify_failure(output.replace("gaudi3: error: ", "ValueError: "), 1)
    assert reason.startswith("exit code 1: ValueError: parallel.strategy deepspeed_zero2")


# The end of a real 2-rank trial's output (`gaudi3 tune --world-size 2 --strategies ddp`, captured once): rank 1 was
# SIGKILLed in its first step, as the kernel's OOM killer does; rank 0 then lost its peer; the launcher exited 143.
RANK_SIGKILLED_OUTPUT = """\
W1201 05:00:06.149000 9068 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 9074 closing signal SIGTERM

SIGTERM: stopping after this step (checkpoint.enabled is false: nothing is
saved) (Ctrl-C again aborts)
gaudi3: error: lost another rank (Connection closed by peer [127.0.0.1]:25766): a rank or a node stopped; exit 143 (restartable): run the same command on every node to resume from the last committed checkpoint (none in this node's --out yet)
E1201 05:00:06.572000 9068 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 9075) of binary: /tmp/ci-A/.venv/bin/python
"""

# The same trial where rank 1 raised in its first step instead (its traceback's last lines, then the rest as printed).
RANK_RAISED_OUTPUT = """\
[rank1]:   File "/tmp/ci-A/.venv/lib/python3.11/site-packages/torch/optim/optimizer.py", line 520, in wrapper
[rank1]:     result = pre_hook(self, args, kwargs)
[rank1]:              ^^^^^^^^^^^^^^^^^^^^^^^^^^^^
[rank1]: ValueError: injected crash in step
gaudi3: error: lost another rank (Connection closed by peer [127.0.0.1]:49372): a rank or a node stopped; exit 143 (restartable): run the same command on every node to resume from the last committed checkpoint (none in this node's --out yet)
W1201 05:07:37.832000 14685 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 14696 closing signal SIGTERM
E1201 05:07:37.865000 14685 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 1 (pid: 14697) of binary: /tmp/ci-A/.venv/bin/python
Traceback (most recent call last):
  File "/tmp/ci-A/.venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
gaudi3_scale.train FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-01_05:07:37
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 14696)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 14696
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_05:07:37
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 14697)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def test_a_rank_sigkilled_by_someone_else_counts_as_out_of_memory_with_several_ranks() -> None:
    """With several ranks the launcher does not die of the SIGKILL: only the elastic agent's line for the first
    failed rank shows it. A SIGKILL the agent sends while closing the others is no cause (not its first failure)."""
    status, reason = classify_failure(RANK_SIGKILLED_OUTPUT, 143)
    assert status == "oom", reason
    assert reason == (
        "local rank 1 killed by a SIGKILL its supervisor did not send (the kernel's OOM killer, most likely)"
    )
    closed = RANK_RAISED_OUTPUT.replace(
        "exitcode  : -15 (pid: 14696)  (SIGTERM)", "exitcode  : -9 (pid: 14696)"
    )
    assert classify_failure(closed, 1)[0] == "crash"


def test_the_failed_rank_s_exception_beats_a_surviving_rank_s_lost_peer_line() -> None:
    status, reason = classify_failure(RANK_RAISED_OUTPUT, 1)
    assert (status, reason) == ("crash", "exit code 1: ValueError: injected crash in step")
    # with nothing better, the lost peer is still the reason
    alone = "\n".join(ln for ln in RANK_RAISED_OUTPUT.splitlines() if "ValueError" not in ln)
    assert classify_failure(alone, 1)[1].startswith(
        "exit code 1: gaudi3: error: lost another rank (Connection"
    )


def _modelled_search(cuda_graphs: bool, tmp_path: Path) -> list:
    """The search over a 1-rank space with trials whose tokens/s is a function of the candidate (a stand-in for
    measured trials: here only the order of the search is under test): compile wins, CUDA graphs win more."""
    from dataclasses import replace

    from gaudi3_scale.tune.config import TuneConfig
    from gaudi3_scale.tune.search import TrialCache, search
    from gaudi3_scale.tune.trial import TrialResult

    base = build_run_config(None, parse_overrides(["--train.global_batch_size", "4"]))
    cache = TrialCache(tmp_path / "trials.jsonl", "fingerprint")
    space = replace(build_space(base, world_size=1, compile=(False, True), threads=(1,),
                                activation_checkpointing=(False,), precisions=("32-true",)), cuda_graphs=cuda_graphs)  # fmt: skip

    def run(c, estimate):
        speed = 1000.0 * c.micro_batch_size * (1.5 if c.compile else 1.0)
        speed *= 1.3 if c.compile_mode == "reduce-overhead" else 1.0
        return TrialResult(candidate=c, status="ok", tokens_per_s=speed, step_time_s=1 / speed)

    outcome = search(space, TuneConfig(), run=run, estimate=lambda c: None, cache=cache)
    return [outcome.best, outcome.results]


def test_cuda_graphs_are_tried_once_compile_wins_and_only_where_the_space_allows(tmp_path: Path) -> None:
    best, results = _modelled_search(cuda_graphs=True, tmp_path=tmp_path / "a")
    assert best.candidate.compile and best.candidate.compile_mode == "reduce-overhead"
    assert "--train.compile_mode=reduce-overhead" in best.candidate.overrides()
    assert "compile reduce-overhead" in best.candidate.label(1)
    best, results = _modelled_search(cuda_graphs=False, tmp_path=tmp_path / "b")
    assert best.candidate.compile and all(r.candidate.compile_mode == "default" for r in results)


def test_adaptive_batch_finder_refuses_a_module_with_one_line() -> None:
    """Trials train in fresh processes from a config: an nn.Module cannot be one (it failed on AttributeError 'read')."""
    import torch

    from gaudi3_scale.batch import AdaptiveBatchFinder

    with pytest.raises(UserInputError, match=r"^model: AdaptiveBatchFinder takes a registry name \(.*gpt2-124m.*\), "
                       r"a ModelConfig or a RunConfig, not a Linear") as refused:  # fmt: skip
        AdaptiveBatchFinder(model=torch.nn.Linear(2, 2))  # type: ignore[arg-type]
    assert "\n" not in str(refused.value)


_FINDER_ARGS = {
    "model": "shakespeare-char",
    "precision": "32-true",
    "global_batch_size": 4,
    "measure_steps": 1,
}


def _finder(tmp_path: Path, **kwargs: object) -> AdaptiveBatchFinder:
    from gaudi3_scale.batch import AdaptiveBatchFinder

    args: dict[str, Any] = {**_FINDER_ARGS, "out_dir": tmp_path / "tune", **kwargs}
    return AdaptiveBatchFinder(**args)


def test_adaptive_batch_finder_refuses_utilization_as_text_before_multiplying_the_ram_by_it(
    tmp_path: Path,
) -> None:
    """The default budget is RAM × utilization: "0.9" × RAM in bytes was a MemoryError (one rank) or a string of
    hundreds of MiB (256 ranks) before the range check ran. Run in a child whose heap is capped at 2 GiB, so that
    a regression fails fast instead of filling this machine's memory."""
    import gaudi3_scale

    script = textwrap.dedent(
        f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_DATA, (2 * 2**30, 2 * 2**30))
        from gaudi3_scale.batch import AdaptiveBatchFinder
        from gaudi3_scale.config.errors import ConfigError
        for world_size in (1, 256):
            try:
                args = {{**{_FINDER_ARGS!r}, "global_batch_size": 4 * world_size}}
                AdaptiveBatchFinder(**args, world_size=world_size, target_hpu_utilization="0.9",
                                    out_dir={str(tmp_path / "tune")!r})
            except ConfigError as error:
                print(error)
            except BaseException as error:
                print("UNEXPECTED", type(error).__name__, str(error)[:200])
        """
    )
    src = str(Path(gaudi3_scale.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "target_hpu_utilization: expected a number, got '0.9'",
        "target_hpu_utilization: expected a number, got '0.9'",
    ]
    assert not (tmp_path / "tune").exists()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"target_hpu_utilization": float("nan")},
            "target_hpu_utilization: must be a finite number, got nan",
        ),
        ({"target_hpu_utilization": True}, "target_hpu_utilization: expected a number, got True"),
        ({"target_hpu_utilization": 1.5}, "target_hpu_utilization: must be between 0.05 and 1.0, got 1.5"),
        ({"world_size": 2.5}, "world_size: must be an integer >= 1, got 2.5"),
        ({"world_size": "2"}, "world_size: must be an integer >= 1, got '2'"),
        ({"world_size": 0}, "world_size: must be >= 1, got 0"),
        ({"memory_budget_bytes": 0}, "memory_budget_bytes: must be > 0, got 0"),
        ({"memory_budget_bytes": -1}, "memory_budget_bytes: must be > 0, got -1"),
        ({"memory_budget_bytes": 1.5e9}, "memory_budget_bytes: must be an integer >= 1, got 1500000000.0"),
        ({"measure_steps": 2.5}, "measure_steps: must be an integer >= 1, got 2.5"),
    ],
)
def test_adaptive_batch_finder_refuses_bad_numbers_in_one_line_naming_the_argument(
    tmp_path: Path, kwargs: dict[str, object], message: str
) -> None:
    """NaN was a bare "cannot convert float NaN to integer", 2.5 ranks "must be a multiple of the world size (e.g.
    2.5 or 5.0)", and a budget of 0 bytes was silently replaced by the default."""
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        _finder(tmp_path, **kwargs)


def test_adaptive_batch_finder_keeps_a_given_budget_and_defaults_only_none(tmp_path: Path) -> None:
    from gaudi3_scale.tune.tuner import default_memory_budget

    assert _finder(tmp_path, memory_budget_bytes=2**30).config.memory_budget_bytes == 2**30
    finder = _finder(tmp_path, target_hpu_utilization=0.5)
    assert finder.config.memory_budget_bytes == default_memory_budget("cpu", 1, 0.5)
    assert finder.config.target_utilization == 0.5


def test_grid_options_given_one_value_are_a_grid_of_that_value(tmp_path: Path) -> None:
    """`compile=False`, `activation_checkpointing=True`, `threads=1` were "'bool' object is not iterable"."""
    finder = _finder(tmp_path, compile=False, activation_checkpointing=True, threads=1, pipeline=False)
    space = finder.space
    assert (space.compile, space.activation_checkpointing, space.threads, space.pipeline) == (
        (False,), (True,), (1,), (False,)
    )  # fmt: skip
    candidates = space.candidates()
    assert candidates and {(c.compile, c.activation_checkpointing, c.threads) for c in candidates} == {
        (False, True, 1)
    }
    as_tuples = _finder(
        tmp_path, compile=(False,), activation_checkpointing=(True,), threads=(1,), pipeline=(False,)
    )
    assert as_tuples.space == space


def test_one_strategy_named_as_text_is_a_choice_of_one(tmp_path: Path) -> None:
    """`strategies="ddp"` was read letter by letter: "--strategies: d, d, p not available"."""
    space = _finder(tmp_path, strategies="ddp", world_size=2).space
    assert (space.strategies, space.precisions) == (("ddp",), ("32-true",))
    assert {(c.strategy, c.precision) for c in space.candidates()} == {("ddp", "32-true")}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"compile": "on"},
            "compile: expected True, False or a tuple of them such as (False, True), got 'on'",
        ),
        (
            {"activation_checkpointing": ()},
            "activation_checkpointing: expected True, False or a tuple of them",
        ),
        ({"pipeline": (0, 1)}, "pipeline: expected True, False or a tuple of them"),
        ({"threads": 0}, "threads: expected a thread count, None or a tuple of them such as (8, 4), got 0"),
        ({"threads": (4, 2.5)}, "threads: expected a thread count, None or a tuple of them"),
        ({"threads": True}, "threads: expected a thread count, None or a tuple of them"),
    ],
)
def test_grid_options_that_are_not_values_of_the_grid_are_one_line(
    tmp_path: Path, kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(UserInputError, match=f"^{re.escape(message)}"):
        _finder(tmp_path, **kwargs)


def test_tensor_and_pipeline_parallel_join_the_space_for_mesh_strategies_on_a_llama() -> None:
    import hashlib
    import json
    from dataclasses import asdict

    base = build_run_config(
        None, parse_overrides(["--model.name", "llama-tiny", "--train.global_batch_size", "8"])
    )
    space = build_space(base, world_size=4, strategies=("ddp", "fsdp"), compile=(False,), threads=(1,),
                        precisions=("32-true",), activation_checkpointing=(False,))  # fmt: skip
    assert space.tp_sizes == (1, 2)  # divisors of 4 ranks that divide 4 heads and 2 kv heads
    assert space.pp_sizes == (1, 2)  # PP 4 would leave llama-tiny's 2 layers without a stage each
    layouts = {(c.strategy, c.tp_size, c.pp_size) for c in space.candidates()}
    assert layouts == {("ddp", 1, 1), ("fsdp", 1, 1), ("fsdp", 2, 1), ("fsdp", 1, 2), ("fsdp", 2, 2)}
    tp = next(c for c in space.candidates() if (c.tp_size, c.pp_size, c.micro_batch_size) == (2, 1, 2))
    assert space.micro_batches(8, 2) == [1, 2, 4]  # 8 sequences over 2 tensor-parallel groups
    pairs = [tuple(o[2:].split("=", 1)) for o in tp.overrides()]
    cfg = build_run_config(None, [*pairs, ("model.name", "llama-tiny"), ("parallel.nproc_per_node", "4")])  # type: ignore[list-item]
    assert (cfg.parallel.tp_size, cfg.batch_plan().accumulation) == (2, tp.accumulation(4)) == (2, 2)
    assert tp.label(4).startswith("fsdp tp 2 32-true")
    assert "× tensor parallel 1/2 × pipeline (1F1B) 1/2" in space.describe()
    # keys of layouts at their defaults are those of the trial caches written before layouts existed
    plain = next(c for c in space.candidates() if c.tp_size == 1 and c.pp_size == 1)
    layout = ("tp_size", "dp_replicate", "offload", "pp_size", "pp_split")
    old = {k: v for k, v in asdict(plain).items() if k not in layout}
    assert plain.key == hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()[:16]


def test_a_pipeline_group_keeps_its_micro_batches_and_its_trials_run_the_pipeline() -> None:
    """A pipeline candidate is a run with `parallel.pp_size` (1F1B, the split `balanced_split` gives), its
    micro-batches leave the pipeline at least pp_size of them a step, its memory is estimated as a pipeline's, and
    the winner's config keeps the layout; a candidate without a pipeline turns the base config's off, and one read
    back from a trial cache's JSON is the same point."""
    from dataclasses import asdict

    from gaudi3_scale.tune.estimate_table import resolved_model
    from gaudi3_scale.tune.layouts import Layout, check_layouts
    from gaudi3_scale.tune.trial import TrialResult
    from gaudi3_scale.tune.tuner import _estimator, winner_config

    # 6 layers in 4 stages: the Llama 3 split (one layer fewer on the first and last stage)
    args = ["--model.name", "llama-tiny", "--model.num_layers", "6", "--train.global_batch_size", "8",
            "--train.micro_batch_size", "1", "--parallel.pp_size", "2", "--parallel.nproc_per_node", "4"]  # fmt: skip
    base = build_run_config(None, parse_overrides(args))
    space = build_space(base, world_size=4, strategies=("fsdp",), compile=(False,), threads=(1,),
                        precisions=("32-true",), activation_checkpointing=(False,))  # fmt: skip
    assert (1, 4, (1, 3, 5)) in space.meshes and space.pp_sizes == (1, 2, 4)
    # 8 sequences in one pipeline of 4: micro-batches of 1 or 2 leave 8 or 4 a step; 4 and 8 too few for 1F1B
    assert space.micro_batches(8, 1, 4) == [1, 2]
    # tp 2 × pp 2 on 4 ranks is one pipeline too: micro-batch 4 leaves the 2 a pipeline of 2 needs, 8 only 1
    assert space.micro_batches(8, 2, 2) == [1, 2, 4]
    estimate = _estimator(base, space)
    for c in space.candidates():
        pairs = [tuple(o[2:].split("=", 1)) for o in c.overrides()]
        cfg = build_run_config(None, [*pairs, ("model.name", "llama-tiny"), ("model.num_layers", "6"),
                                      ("parallel.nproc_per_node", "4")])  # type: ignore[list-item]  # fmt: skip
        assert (cfg.parallel.pp_size, tuple(cfg.parallel.pp_split)) == (c.pp_size, c.pp_split), c
        assert cfg.batch_plan().accumulation == c.accumulation(4) >= c.pp_size, c
        assert cfg.parallel.pp_schedule == "1f1b" or c.pp_size == 1
        assert estimate(c) is not None
    pp4 = next(c for c in space.candidates() if c.pp_size == 4 and c.micro_batch_size == 2)
    assert pp4.label(4) == "fsdp pp 4 32-true gb 8 mb 2×4 1 thr"
    # the tuner's estimate of a pipeline is the layout table's (`tune --estimate-only`) for the same layout
    table = check_layouts(resolved_model(base.model, base.data), world_size=4, per_node=4, device_kind="cpu",
                          device_bytes=2**40, micro_batch_size=2, precision="32-true")  # fmt: skip
    row = next(r for r in table if r.layout == Layout(strategy="fsdp", pp_size=4, pp_split=(1, 3, 5)))
    assert estimate(pp4) == row.need_bytes == process_peak_bytes(row.estimate)  # what a trial measures
    flat = replace(pp4, pp_size=1, pp_split=())
    assert estimate(flat) != estimate(pp4)
    config, _ = winner_config(base, pp4, 4, "sqrt")
    assert (config.parallel.pp_size, config.parallel.pp_split, config.parallel.pp_schedule) == (
        4,
        [1, 3, 5],
        "1f1b",
    )
    config, _ = winner_config(base, flat, 4, "sqrt")
    assert (config.parallel.pp_size, config.parallel.pp_split) == (
        1,
        [],
    )  # the base's pp 2 is not the winner's
    assert "--parallel.pp_size=1" in flat.overrides()
    cached = TrialResult.from_dict(json.loads(json.dumps(TrialResult(candidate=pp4, status="ok").to_dict())))
    assert cached.candidate == pp4 and cached.key == pp4.key and asdict(cached.candidate) == asdict(pp4)


def test_no_pipeline_where_the_model_cannot_have_one() -> None:
    """Tied embeddings (the default model), a mixture of experts and too few layers leave the pipeline out."""
    for model in (
        ["--model.name", "shakespeare-char"],
        ["--model.name", "llama-tiny", "--model.num_experts", "4"],
        ["--model.name", "llama-tiny", "--model.num_layers", "1"],
    ):
        space = build_space(build_run_config(None, parse_overrides([*model, "--train.global_batch_size", "8"])),
                            world_size=2, compile=(False,), threads=(1,), precisions=("32-true",))  # fmt: skip
        assert space.pp_sizes == (1,) and all(c.pp_size == 1 for c in space.candidates()), model


def test_pipeline_on_off_or_both_shapes_the_space() -> None:
    """`--pipeline off` leaves pipelines out, `on` searches only pipelines (so no strategy that cannot pipeline), and
    `on` where no pipeline can be is one line naming what is allowed."""
    base = build_run_config(
        None, parse_overrides(["--model.name", "llama-tiny", "--train.global_batch_size", "8"])
    )
    common = dict(
        world_size=2, strategies=("ddp", "fsdp"), compile=(False,), threads=(1,), precisions=("32-true",)
    )

    def layouts(pipeline: tuple[bool, ...]) -> set[tuple[str, int]]:
        space = build_space(base, pipeline=pipeline, **common)  # type: ignore[arg-type]
        return {(c.strategy, c.pp_size) for c in space.candidates()}

    assert layouts((False, True)) == {("ddp", 1), ("fsdp", 1), ("fsdp", 2)}
    assert layouts((False,)) == {("ddp", 1), ("fsdp", 1)}
    assert layouts((True,)) == {("fsdp", 2)}
    tied = build_run_config(None, parse_overrides(["--train.global_batch_size", "8"]))  # shakespeare-char
    with pytest.raises(UserInputError, match=r"^--pipeline on: no pipeline layout in this search; .* allowed here: "
                       r"--pipeline off or both$") as refused:  # fmt: skip
        build_space(tied, pipeline=(True,), **common)  # type: ignore[arg-type]
    assert "\n" not in str(refused.value)


def test_the_search_runs_the_pipeline_where_only_it_fits(tmp_path: Path) -> None:
    """With an estimate under which only the pipeline fits, its group is the one searched and it wins; the other
    layouts are pruned by the estimate without running."""
    from gaudi3_scale.tune.search import TrialCache, search
    from gaudi3_scale.tune.trial import TrialResult

    base = build_run_config(
        None, parse_overrides(["--model.name", "llama-tiny", "--train.global_batch_size", "8"])
    )
    space = build_space(base, world_size=2, strategies=("ddp", "fsdp"), compile=(False,), threads=(1,),
                        precisions=("32-true",), activation_checkpointing=(False,))  # fmt: skip
    ran: list[Candidate] = []

    def run(c: Candidate, estimate: int | None) -> TrialResult:
        ran.append(c)
        return TrialResult(candidate=c, status="ok", tokens_per_s=100.0 * c.micro_batch_size, step_time_s=1.0)

    only_the_pipeline_fits = lambda c: 5 if c.pp_size == 2 else 100  # noqa: E731
    outcome = search(space, TuneConfig(memory_budget_bytes=10), run=run, estimate=only_the_pipeline_fits,
                     cache=TrialCache(tmp_path / "t.jsonl", "f"))  # fmt: skip
    assert ran and all(c.pp_size == 2 for c in ran)
    assert outcome.best is not None and outcome.best.candidate.pp_size == 2
    # 8 sequences in one pipeline: micro-batches 1, 2, 4 (4 leaves the 2 micro-batches 1F1B needs); 8 is not one
    assert {c.micro_batch_size for c in ran} <= {1, 2, 4} and max(c.micro_batch_size for c in ran) == 4
    pruned = [r for r in outcome.results if r.status == "pruned"]
    assert pruned and all(r.candidate.pp_size == 1 for r in pruned)


def test_micro_batches_are_the_batch_plans_under_tensor_parallel() -> None:
    """A candidate's micro-batch divides its rank's share of the global batch over the data-parallel ranks
    (world / (tp_size × pp_size): a tensor-parallel pair or a pipeline reads one batch), as the run's `BatchPlan`
    splits it; the space's description lists every micro-batch its grid holds, and a batch that does not split is
    refused, not floored."""
    base = build_run_config(
        None, parse_overrides(["--model.name", "llama-tiny", "--train.global_batch_size", "8"])
    )
    space = build_space(base, world_size=4, strategies=("ddp", "fsdp"), compile=(False,), threads=(1,),
                        precisions=("32-true",), activation_checkpointing=(False,))  # fmt: skip
    for c in space.candidates():
        plan = c.batch_plan(4)
        assert plan.data_parallel_size == 4 // (c.tp_size * c.pp_size)
        assert plan.micro_batch_size * plan.accumulation * plan.data_parallel_size == 8
    grid = sorted({c.micro_batch_size for c in space.candidates()})
    assert grid == [1, 2, 4]  # 4: the whole share of a tensor-parallel pair (8 sequences over 2 pairs)
    assert "micro-batch 1/2/4 ×" in space.describe()
    with pytest.raises(
        ConfigError, match=r"^train.global_batch_size: 6 is not divisible by the 4 data-parallel"
    ):
        space.micro_batches(6)


def test_offload_is_searched_only_where_nothing_fits_without_it(tmp_path: Path) -> None:
    from gaudi3_scale.tune.search import TrialCache, search
    from gaudi3_scale.tune.space import available_strategies
    from gaudi3_scale.tune.trial import TrialResult

    pytest.importorskip("deepspeed")
    base = build_run_config(None, parse_overrides(["--train.global_batch_size", "4"]))
    space = build_space(base, world_size=2, strategies=("ddp", "deepspeed_zero2"), compile=(False,), threads=(1,),
                        precisions=("32-true",), activation_checkpointing=(False,))  # fmt: skip
    ran: list = []

    def run(c: Candidate, estimate: int | None) -> TrialResult:
        ran.append(c)
        return TrialResult(candidate=c, status="ok", tokens_per_s=100.0 * c.micro_batch_size, step_time_s=1.0)

    # a stand-in estimate: ddp fits at micro-batch 1, ZeRO-2 only with its optimizer on the host
    def estimate(c: Candidate) -> int:
        if c.strategy == "ddp":
            return 10 * c.micro_batch_size
        return 5 if c.offload == "optimizer" else 100

    outcome = search(space, TuneConfig(memory_budget_bytes=10), run=run, estimate=estimate,
                     cache=TrialCache(tmp_path / "t.jsonl", "f"))  # fmt: skip
    assert {(c.strategy, c.offload) for c in ran} == {("ddp", "none"), ("deepspeed_zero2", "optimizer")}
    assert any("searched with offload optimizer" in note for note in outcome.notes)
    assert "--parallel.offload=optimizer" in next(c for c in ran if c.offload != "none").overrides()
    assert available_strategies(8, "hpu") == (
        "ddp",
        "fsdp_grad_op",
        "fsdp",
    )  # what the trainer builds on Gaudi


@pytest.mark.timeout(60)  # a scan of 1..n ran past 60 s here for 2**31 - 1
def test_divisors_pair_up_below_the_square_root() -> None:
    for n in (1, 2, 16, 36, 97, 360, 720_720):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]
    assert divisors(2**31 - 1) == [1, 2**31 - 1]  # a prime
    assert divisors(2**40) == [2**k for k in range(41)]


def _one_point_space() -> tuple[RunConfig, SearchSpace, Candidate]:
    """A 1-rank space of one candidate: global batch 1, 32-true, nothing else searched."""
    base = build_run_config(
        None, parse_overrides(["--train.global_batch_size", "1", "--model.num_layers", "1"])
    )
    space = build_space(base, world_size=1, compile=(False,), threads=(1,), precisions=("32-true",),
                        activation_checkpointing=(False,), pipeline=(False,))  # fmt: skip
    (candidate,) = space.candidates()
    return base, space, candidate


def test_a_search_without_a_winner_removes_an_earlier_search_s_best_yaml(tmp_path: Path) -> None:
    """best.yaml is always the winner of the tune.json beside it: a search that ends without one (here its one
    trial ran out of memory, from the cache, so nothing runs) removes the winner an earlier search left, and says
    so."""
    import io

    from rich.console import Console

    from gaudi3_scale.tune.search import TrialCache
    from gaudi3_scale.tune.trial import TrialResult
    from gaudi3_scale.tune.tuner import print_report, run_tuner

    base, space, candidate = _one_point_space()
    out = tmp_path / "tune"
    out.mkdir()
    (out / "best.yaml").write_text("# the winner of an earlier search\n")
    cache = TrialCache(out / "trials.jsonl", "this search")
    cache.add(TrialResult(candidate=candidate, status="oom", reason="out of memory"))
    console = Console(file=io.StringIO(), width=200)
    result = run_tuner(base, space, TuneConfig(memory_budget_bytes=2**40), out, console=console,
                       estimate=lambda c: None, cache=cache)  # fmt: skip
    print_report(result, console)
    assert result.best is None and result.outcome.trials_run == 0
    assert not (out / "best.yaml").exists()
    report = json.loads((out / "tune.json").read_text())
    assert report["best"] is None and report["best_config"] is None
    note = f"removed {out / 'best.yaml'}: the winner of an earlier search here; this one has none"
    assert note in report["notes"]
    assert f"note: {note}" in console.file.getvalue()  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("result", "problem"),
    [
        ("5", "result: expected a mapping of fields, got 5"),
        ('{"candidate": {"strategy": "auto"}, "status": "ok"}', "result.candidate.precision: is required"),
        ("BAD_STATUS", "result.status: got 'bogus'; allowed: ok, oom"),
        ("NAN_SPEED", "result.tokens_per_s: must be a finite number, got nan"),
    ],
)
def test_a_record_of_this_search_that_does_not_read_back_is_one_line_naming_its_line(
    tmp_path: Path, result: str, problem: str
) -> None:
    from gaudi3_scale.tune.search import TrialCache
    from gaudi3_scale.tune.trial import TrialResult

    _, _, candidate = _one_point_space()
    good = TrialResult(candidate=candidate, status="ok", tokens_per_s=10.0, step_time_s=1.0).to_dict()
    if result == "BAD_STATUS":
        result = json.dumps({**good, "status": "bogus"})
    elif result == "NAN_SPEED":
        result = json.dumps({**good, "tokens_per_s": float("nan")})
    path = tmp_path / "trials.jsonl"
    path.write_text(json.dumps({"fingerprint": "f", "result": good}) + "\n"
                    + f'{{"fingerprint": "f", "result": {result}}}\n')  # fmt: skip
    with pytest.raises(UserInputError) as refused:
        TrialCache(path, "f")
    message = str(refused.value)
    assert message.startswith(f"{path}:2: not a trial record ({problem}"), message
    assert message.endswith("); delete the line or use a new --out") and "\n" not in message
    TrialCache(path, "another search")  # records of another search are not read back: no error


def test_a_line_cut_short_is_skipped_and_the_next_record_gets_a_line_of_its_own(tmp_path: Path) -> None:
    from gaudi3_scale.tune.search import TrialCache
    from gaudi3_scale.tune.trial import TrialResult

    _, _, candidate = _one_point_space()
    path = tmp_path / "trials.jsonl"
    path.write_text('{"fingerprint": "f", "result": {"candid')  # a tuner killed while it wrote
    cache = TrialCache(path, "f")
    assert cache.results == {}
    ok = TrialResult(candidate=candidate, status="ok", tokens_per_s=10.0, step_time_s=1.0)
    cache.add(ok)
    assert TrialCache(path, "f").get(candidate.key) == ok


def test_run_tuner_refuses_a_damaged_trial_file_before_it_writes_anything(tmp_path: Path) -> None:
    from gaudi3_scale.tune.tuner import run_tuner

    base, space, _ = _one_point_space()
    out = tmp_path / "tune"
    out.mkdir()
    (out / "trials.jsonl").write_text("[1, 2]\n")
    (out / "base.yaml").write_text("# the base of an earlier search\n")
    with pytest.raises(UserInputError, match=r"trials.jsonl:1: not a trial record"):
        run_tuner(base, space, TuneConfig(memory_budget_bytes=2**40), out, estimate=lambda c: None)
    assert sorted(p.name for p in out.iterdir()) == ["base.yaml", "trials.jsonl"]
    assert (out / "base.yaml").read_text() == "# the base of an earlier search\n"


def test_run_tuner_refuses_a_budget_nothing_fits_before_it_writes_anything(tmp_path: Path) -> None:
    from gaudi3_scale.tune.tuner import run_tuner

    base, space, _ = _one_point_space()
    out = tmp_path / "tune"
    with pytest.raises(UserInputError, match=r"--memory-budget .* cannot hold any configuration"):
        run_tuner(base, space, TuneConfig(memory_budget_bytes=2**20), out, estimate=lambda c: 2**30)
    assert not out.exists()


def test_the_winner_of_a_config_in_epochs_keeps_its_epochs_and_trains_as_written(
    tmp_path: Path, gaudi3_cli: Any
) -> None:
    """A length in epochs reads the same tokens at any batch: best.yaml keeps max_epochs (max_steps null) rather
    than a rescaled max_steps placeholder beside it, which `gaudi3 train --config best.yaml` would refuse."""
    from gaudi3_scale.config.core import save_yaml
    from gaudi3_scale.train.config import config_dict
    from gaudi3_scale.tune.tuner import winner_config

    base = build_run_config(None, parse_overrides(["--model.name=llama-tiny", "--train.max_epochs=2"]))
    c = Candidate(strategy="ddp", precision="32-true", global_batch_size=4 * base.train.global_batch_size,
                  micro_batch_size=base.train.global_batch_size, activation_checkpointing=False, compile=False,
                  threads=None)  # fmt: skip
    best, note = winner_config(base, c, 1, "sqrt")
    assert best.train.max_epochs == 2 and best.optim.warmup_steps == math.ceil(base.optim.warmup_steps / 4)
    assert "max_epochs 2 sets the length" in note and "max_steps" not in note
    save_yaml(config_dict(best), tmp_path / "best.yaml")
    code, out, err = gaudi3_cli("train", "--config", str(tmp_path / "best.yaml"), "--print-config")
    assert code == 0, err
    train = yaml.safe_load(out)["train"]
    assert (train["max_epochs"], train["max_steps"], train["global_batch_size"]) == (
        2,
        None,
        c.global_batch_size,
    )


def test_with_hpu_graphs_the_space_holds_no_compiled_trial() -> None:
    """The run config refuses train.compile with train.hpu_graphs (eager vs lazy mode on Gaudi): no trial of the
    default grid is one it would refuse, and asking for compile alone is one line."""
    base = build_run_config(None, [("train.global_batch_size", "4"), ("train.hpu_graphs", "true")])
    space = build_space(base, world_size=1, strategies=("auto",), threads=(1,))
    assert space.candidates() and not any(c.compile for c in space.candidates())
    with pytest.raises(UserInputError, match=r"^--compile: on cannot run with train.hpu_graphs"):
        build_space(base, world_size=1, strategies=("auto",), compile=True, threads=(1,))
