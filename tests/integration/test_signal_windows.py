"""Stop signals at the two moments a run's own handlers used not to cover, each sent by the process to itself at
that moment (a patch in the child, so the timing is exact): Ctrl-C at the start of the final save (the handlers
were restored before it, and the KeyboardInterrupt abandoned the writer thread: exit 134, nothing committed);
SIGTERM after Lightning installed its signal handlers but before the fit's first step (Lightning's handler ended
the fit as a SystemExit without a code: exit 0, nothing trained or saved); SIGTERM during a step whose loss spike
ends the fit for a rollback (the signal was forgotten and the run trained on to the end, exit 0)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gaudi3_scale.checkpoint.manifest import verify_checkpoint

pytestmark = pytest.mark.integration

TINY = ["--model.num_layers=1", "--model.dim=32", "--model.context_length=32", "--train.global_batch_size=4",
        "--train.val_every_steps=0", "--train.threads=1", "--sample-tokens=0", "--no-progress"]  # fmt: skip

AT_FINAL_SAVE = """
import os, signal
from gaudi3_scale.train import callbacks
end = callbacks.StepCheckpoint.end
def signalled_end(self, trainer):
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C as the final save starts
    return end(self, trainer)
callbacks.StepCheckpoint.end = signalled_end
"""
BEFORE_THE_FIRST_STEP = """
import os, signal
import lightning.pytorch as pl
run_stage = pl.Trainer._run_stage
def signalled_run_stage(self):
    os.kill(os.getpid(), signal.SIGTERM)  # after Lightning's signal registration, before on_train_start
    return run_stage(self)
pl.Trainer._run_stage = signalled_run_stage
"""
DURING_A_SPIKE = """
import os, signal
from gaudi3_scale.train import module
inject = module.inject_into_loss
def signalled(faults, loss, *, step, rank, rerun=False):
    if step == 7:
        os.kill(os.getpid(), signal.SIGTERM)  # preempted during the step whose loss spikes
    return inject(faults, loss, step=step, rank=rank, rerun=rerun)
module.inject_into_loss = signalled
"""
MAIN = "\nfrom gaudi3_scale.cli.main import main\nmain()\n"


def _train(out: Path, patch: str, *args: str, faults: str = "") -> subprocess.CompletedProcess[str]:
    argv = ["gaudi3", "train", "--out", str(out), *TINY, *args]
    code = f"import sys\nsys.argv = {argv!r}\n{patch}{MAIN}"
    env = {**os.environ, "GAUDI3_INJECT_FAULTS": faults}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)


def test_ctrl_c_during_the_final_save_lets_it_commit_and_exits_0(tmp_path: Path) -> None:
    done = _train(tmp_path, AT_FINAL_SAVE, "--train.max_steps=3", "--checkpoint.every_steps=100")
    assert done.returncode == 0, done.stderr[-3000:]
    final = tmp_path / "checkpoints" / "step-00000003"
    assert (
        verify_checkpoint(final) == []
        and (tmp_path / "checkpoints" / "latest").read_text() == final.name + "\n"
    )
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 3


def test_sigterm_before_the_first_step_stops_after_it_with_a_checkpoint_and_143(tmp_path: Path) -> None:
    done = _train(tmp_path, BEFORE_THE_FIRST_STEP, "--train.max_steps=20", "--checkpoint.every_steps=100")
    assert done.returncode == 143, done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["stop_signal"] == "SIGTERM", summary
    assert verify_checkpoint(tmp_path / "checkpoints" / "step-00000001") == []


def test_sigterm_during_a_step_that_spikes_stops_the_run_instead_of_rolling_back(tmp_path: Path) -> None:
    """The spike ends the fit for a rollback at the same step the signal arrives: the stop wins (exit 143), and the
    run does not train on to the end as if it had never been asked to stop."""
    done = _train(tmp_path, DURING_A_SPIKE, "--train.max_steps=10", "--train.log_every_steps=1",
                  "--checkpoint.every_steps=2", "--health.spike_window_steps=5", "--health.spike_warmup_steps=4",
                  "--health.spike_policy=rollback", "--health.rollback_skip_batches=3",
                  faults="spike:step=7:scale=20")  # fmt: skip
    assert done.returncode == 143, done.stderr[-3000:]
    assert "rolled back" not in done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stop_signal"] == "SIGTERM" and summary["steps"] < 10, summary
    assert verify_checkpoint(tmp_path / "checkpoints" / "step-00000006") == []
