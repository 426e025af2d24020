"""Fitting again a run whose checkpoint is at or past `train.max_steps`: at it, nothing trains and the run's
config.yaml stays the one its checkpoint was trained with (it used to be rewritten with the new config's lr and
max_steps), and so do its summary.json, loss.png and plan.json (they were rewritten with the figures of a fit of no
step: measured_steps 0, the process's wall time, a new forecast); past it, one line, and nothing in the run
changes."""

from __future__ import annotations

from pathlib import Path

import pytest

from gaudi3_scale.config.core import parse_overrides
from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.train import GaudiTrainer, build_run_config

pytestmark = pytest.mark.integration

TINY = ["--model.name", "llama-tiny", "--model.num_layers", "1", "--train.threads", "2", "--train.val_every_steps",
        "0", "--train.global_batch_size", "2", "--train.micro_batch_size", "2", "--optim.warmup_steps", "1"]  # fmt: skip


def _fit(out: Path, *extra: str) -> dict:
    cfg = build_run_config(None, parse_overrides(["--out_dir", str(out), *TINY, *extra]))
    return GaudiTrainer(cfg, progress=False).fit()


def test_a_finished_run_fitted_again_keeps_its_config_and_one_past_it_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = _fit(out, "--train.max_steps", "3")
    kept = {name: (out / name).read_bytes() for name in ("config.yaml", "summary.json", "loss.png")}
    again = _fit(out, "--train.max_steps", "3", "--optim.lr", "0.5")  # nothing left to train
    assert again["steps"] == first["steps"] == 3
    assert {name: (out / name).read_bytes() for name in kept} == kept
    assert again["measured_steps"] == first["measured_steps"] > 0 and again["wall_s"] == first["wall_s"]
    assert again["interrupted"] is False and again["stop_exit_code"] is None
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    refused = r"^train\.max_steps: 2, but the checkpoint step-00000003 is at step 3"
    with pytest.raises(UserInputError, match=refused):
        _fit(out, "--train.max_steps", "2")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files


def test_a_summary_of_fewer_steps_than_the_finished_checkpoint_is_not_kept(tmp_path: Path) -> None:
    """Killed after its last checkpoint and before its summary, a run's summary.json is an earlier fit's (here: one
    of 2 steps, stopped early); fitting again writes the summary of the finished run, not that one as its own."""
    import json

    out = tmp_path / "run"
    _fit(out, "--train.max_steps", "3")
    earlier = {**json.loads((out / "summary.json").read_text()), "steps": 2, "interrupted": True}
    (out / "summary.json").write_text(json.dumps(earlier))
    again = _fit(out, "--train.max_steps", "3")
    assert again["steps"] == 3 and json.loads((out / "summary.json").read_text())["steps"] == 3
