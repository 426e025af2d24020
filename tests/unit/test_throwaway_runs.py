"""A throwaway run (a plan probe, a tuning trial) of a config whose spike policy is `rollback` is a run the trainer
takes: it writes no checkpoint to roll back to, so it warns on spikes instead. Before, `gaudi3 plan --probe` of such
a config always fell back to the catalog ("rollback restores a checkpoint, but checkpoint.enabled is false"), and
every tuning trial of it crashed. Checked with `gaudi3 train --dry-run`, which refuses what the run would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gaudi3_scale.forecast.probe import probe_command
from gaudi3_scale.train.config import build_run_config
from gaudi3_scale.tune.space import Candidate
from gaudi3_scale.tune.trial import TrialSettings, _command


def _dry_run(command: list[str]) -> subprocess.CompletedProcess[str]:
    assert command[:4] == [sys.executable, "-m", "gaudi3_scale.cli", "train"], command
    return subprocess.run([*command, "--dry-run"], capture_output=True, text=True)


@pytest.mark.parametrize("policy", ["rollback", "skip"])
def test_a_probe_of_a_rollback_config_is_a_run_the_trainer_takes(tmp_path: Path, policy: str) -> None:
    overrides = ("--model.name=llama-tiny", f"--health.spike_policy={policy}")
    command = probe_command(None, overrides, tmp_path / "run", warmup_steps=2, measured_steps=3,
                            spike_policy=policy)  # fmt: skip
    done = _dry_run(command)
    assert done.returncode == 0, done.stderr
    # only rollback is changed: skip drops spiking steps without a checkpoint, and the probe measures that
    assert ("--health.spike_policy=warn" in command) == (policy == "rollback")


def test_a_trial_of_a_rollback_config_is_a_run_the_trainer_takes(tmp_path: Path) -> None:
    base = tmp_path / "base.yaml"
    base.write_text("model:\n  name: llama-tiny\nhealth:\n  spike_policy: rollback\n")
    cfg = build_run_config(str(base), [])
    candidate = Candidate(strategy="auto", precision="32-true", global_batch_size=cfg.train.global_batch_size,
                          micro_batch_size=cfg.train.global_batch_size, activation_checkpointing=False,
                          compile=False, threads=1)  # fmt: skip
    settings = TrialSettings(world_size=1, device="cpu", spike_policy=cfg.health.spike_policy)
    done = _dry_run(_command(base, candidate, settings, tmp_path / "run"))
    assert done.returncode == 0, done.stderr


def test_trials_and_probes_open_no_tracker_run_port_or_budget(tmp_path: Path) -> None:
    """A trial of a config that logs to a tracker, serves metrics on a port and has a budget: no tracker run per
    trial, no port the real run may hold (every trial crashed on it), no budget (as a plan probe already did)."""
    import yaml

    base = tmp_path / "base.yaml"
    base.write_text("model:\n  name: llama-tiny\nmonitor:\n  loggers: wandb\n  metrics_port: 9100\n"
                    "cost:\n  budget_usd: 5.0\n  price_usd_per_hour: 1.0\n")  # fmt: skip
    cfg = build_run_config(str(base), [])
    candidate = Candidate(strategy="auto", precision="32-true", global_batch_size=cfg.train.global_batch_size,
                          micro_batch_size=cfg.train.global_batch_size, activation_checkpointing=False,
                          compile=False, threads=1)  # fmt: skip
    commands = {
        "trial": _command(base, candidate, TrialSettings(world_size=1, device="cpu"), tmp_path / "run"),
        "probe": probe_command(str(base), (), tmp_path / "probe", warmup_steps=2, measured_steps=3),
    }
    for name, command in commands.items():
        done = subprocess.run([*command, "--print-config"], capture_output=True, text=True)
        assert done.returncode == 0, (name, done.stderr)
        printed = yaml.safe_load(done.stdout)
        assert not printed["monitor"]["loggers"], name
        assert printed["monitor"]["metrics_port"] is None and printed["cost"]["budget_usd"] is None, name
