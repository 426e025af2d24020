"""`gaudi3 tune` again over the same `--out`, and over configs whose own settings its trials override: real trials
of a 1-layer llama-tiny, one measured step or two."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from gaudi3_scale.config.core import parse_overrides
from gaudi3_scale.train.config import build_run_config
from gaudi3_scale.tune.config import TuneConfig
from gaudi3_scale.tune.space import build_space

pytestmark = pytest.mark.integration


def test_a_re_tune_measures_only_its_own_steps_and_runs_a_cached_crash_again(tmp_path: Path) -> None:
    """The second search (other measurement settings, so its trial is not the first's) runs in the directory of
    the first one's trial: it starts empty, so the steps measured are its own, not both runs' appended in
    metrics.jsonl. A crash cached for it is run again (a crash may have been the host's), and a note says so."""
    from gaudi3_scale.tune.search import TrialCache
    from gaudi3_scale.tune.trial import TrialResult
    from gaudi3_scale.tune.tuner import open_trial_cache, run_tuner

    base = build_run_config(None, parse_overrides(["--model.name", "llama-tiny", "--model.num_layers", "1",
                                                   "--train.global_batch_size", "1"]))  # fmt: skip
    space = build_space(base, world_size=1, compile=(False,), threads=(1,), precisions=("32-true",),
                        activation_checkpointing=(False,), pipeline=(False,))  # fmt: skip
    (candidate,) = space.candidates()
    out = tmp_path / "tune"
    first = TuneConfig(memory_budget_bytes=2**40, warmup_steps=1, measure_steps=2)
    result = run_tuner(base, space, first, out, console=Console(file=io.StringIO()), estimate=lambda c: None)
    assert result.best is not None and result.best.measured_steps == [2, 3]

    second = TuneConfig(memory_budget_bytes=2**40, warmup_steps=1, measure_steps=1)
    cache: TrialCache = open_trial_cache(base, space, second, out)
    cache.add(TrialResult(candidate=candidate, status="crash", reason="exit code 1: Address already in use"))
    console = Console(file=io.StringIO(), width=200)
    result = run_tuner(base, space, second, out, console=console, estimate=lambda c: None, cache=cache)
    assert result.outcome.trials_run == 1 and result.best is not None
    assert result.best.measured_steps == [2] and result.best.reason == "median of 1 steps after 1 warm-up"
    records = (out / "trials" / candidate.key / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r).get("step") for r in records if '"train_loss"' in r] == [1, 2]
    assert result.outcome.notes[0] == "re-running 1 trials that crashed or timed out last time"


def test_a_config_whose_settings_the_trials_override_is_tuned_and_its_winner_keeps_them(
    tmp_path: Path,
) -> None:
    """A two-node config whose batch is given in tokens, with spike rollback (its trials write no checkpoint), a
    profile window past a trial's last step and a compile mode (its compile-off trials): each trial runs on this
    node, the global batch asked for, and what a trial cannot run reset; best.yaml is one node's layout, keeps the
    user's settings that stay valid, and trains."""
    out = tmp_path / "tune"
    args = [
        "tune", "--model.name", "llama-tiny", "--model.num_layers", "1", "--model.context_length", "64",
        "--train.global_batch_tokens", "256", "--global-batch", "2",  # the config's batch is 4 sequences
        "--parallel.nnodes", "2", "--parallel.rdzv_endpoint", "127.0.0.1:29555",
        "--health.spike_policy", "rollback", "--train.max_steps", "50", "--train.profile_start_step", "10",
        "--train.compile", "true", "--train.compile_mode", "max-autotune-no-cudagraphs",
        "--precisions", "32-true", "--activation-checkpointing", "off", "--compile", "off", "--threads", "1",
        "--warmup-steps", "1", "--measure-steps", "1", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "gaudi3_scale.cli", *args], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 rank(s) on cpu" in proc.stdout  # one node's ranks (nproc_per_node), not nnodes × them
    report = json.loads((out / "tune.json").read_text())
    ran = [t for t in report["trials"] if t["status"] != "pruned"]
    assert ran and all(t["status"] == "ok" for t in ran), ran
    assert any("the winner is the layout of one node" in note for note in report["notes"])
    trial = yaml.safe_load((out / "trials" / ran[0]["key"] / "run" / "config.yaml").read_text())
    assert (trial["parallel"]["nnodes"], trial["parallel"]["nproc_per_node"]) == (1, 1)
    assert trial["health"]["spike_policy"] == "warn" and trial["train"]["profile_start_step"] is None
    assert (trial["train"]["compile"], trial["train"]["compile_mode"]) == (False, "default")
    assert trial["train"]["global_batch_size"] == 2

    best = yaml.safe_load((out / "best.yaml").read_text())
    parallel, train = best["parallel"], best["train"]
    assert (parallel["nnodes"], parallel["node_rank"], parallel["nproc_per_node"]) == (1, 0, 1)
    assert parallel["rdzv_endpoint"] is None
    assert (train["global_batch_size"], train["global_batch_tokens"]) == (2, None)
    assert best["health"]["spike_policy"] == "rollback"  # valid again: best.yaml checkpoints
    # half the batch: twice the steps for the same tokens, the profile window too
    assert (train["max_steps"], train["profile_start_step"], train["profile_num_steps"]) == (100, 20, 10)
    assert (train["compile"], train["compile_mode"]) == (False, "default")
    run = subprocess.run(
        [sys.executable, "-m", "gaudi3_scale.cli", "train", "--config", str(out / "best.yaml"), "--print-config"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
