"""Disk full (ENOSPC) during a save, in a real training run: nothing partial is committed, earlier checkpoints stay
intact; a periodic save failing warns and training goes on, the final save failing stops with one clear error."""

from __future__ import annotations

import errno
import io
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from gaudi3_scale.checkpoint.manager import CheckpointManager, CheckpointSaveError
from gaudi3_scale.checkpoint.manifest import verify_checkpoint
from gaudi3_scale.config.core import parse_overrides
from gaudi3_scale.train import GaudiTrainer, build_run_config

pytestmark = pytest.mark.integration


def _fill_disk_at(monkeypatch: pytest.MonkeyPatch, step_dir: str) -> None:
    """torch.save fails as a full disk does when it writes into `step_dir` (and only there)."""
    real_save = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if step_dir in str(getattr(f, "name", f)):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


def _trainer(out: Path, async_save: bool) -> tuple[GaudiTrainer, io.StringIO]:
    cfg = build_run_config(None, parse_overrides([
        "--out_dir", str(out), "--train.threads", "2", "--train.max_steps", "6", "--train.val_every_steps", "0",
        "--checkpoint.every_steps", "2", "--checkpoint.keep_last", "5",
        "--checkpoint.async_save", str(async_save).lower(),
    ]))  # fmt: skip
    console_out = io.StringIO()
    return GaudiTrainer(cfg, progress=False, console=Console(file=console_out, width=400)), console_out


def _intact_checkpoints(out: Path, steps: list[int]) -> CheckpointManager:
    manager = CheckpointManager(out / "checkpoints")
    assert [step for step, _ in manager.steps()] == steps
    assert all(verify_checkpoint(path) == [] for _, path in manager.steps())
    return manager


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_disk_full_during_a_periodic_save_warns_and_training_continues(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    _fill_disk_at(monkeypatch, "step-00000004")
    trainer, console = _trainer(tmp_path, async_save)
    summary = trainer.fit()
    assert summary["steps"] == 6
    warning = " ".join(console.getvalue().split())
    assert "step-00000004 was not saved ([Errno 28] No space left on device)" in warning
    assert "training continues (newest committed checkpoint: step-00000002)" in warning
    _intact_checkpoints(tmp_path, [2, 6])  # the partial step-4 was removed, never committed
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-00000006"


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_disk_full_on_the_final_save_stops_with_one_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    _fill_disk_at(monkeypatch, "step-00000006")
    trainer, _ = _trainer(tmp_path, async_save)
    with pytest.raises(
        CheckpointSaveError, match=r"step-00000006 was not saved .*earlier checkpoints are intact"
    ):
        trainer.fit()
    manager = _intact_checkpoints(tmp_path, [2, 4])
    assert manager.latest_valid() == manager.path_for(4)
