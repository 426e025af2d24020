"""Checkpoint commit (manifest written last), verification, the `latest` pointer, retention, failing writes."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from gaudi3_scale.checkpoint.async_save import AsyncVerifiedCheckpointIO
from gaudi3_scale.checkpoint.manager import (
    META_KEY,
    STATE_NAME,
    CheckpointManager,
    CheckpointSaveError,
    RetentionPolicy,
)
from gaudi3_scale.checkpoint.manifest import MANIFEST_NAME, read_manifest, verify_checkpoint
from gaudi3_scale.checkpoint.verified_io import VerifiedCheckpointIO
from gaudi3_scale.config.errors import UserInputError


def _save(
    io: VerifiedCheckpointIO, manager: CheckpointManager, step: int, val_loss: float | None = None
) -> Path:
    path = manager.path_for(step)
    state = {
        "global_step": step,
        "epoch": 0,
        "w": torch.full((256,), float(step)),
        META_KEY: {"val_loss": val_loss},
    }
    io.save_checkpoint(state, path / STATE_NAME)
    manager.mark_latest(path)
    return path


def test_commit_writes_manifest_last_and_loads_verified(tmp_path: Path) -> None:
    io, manager = VerifiedCheckpointIO(), CheckpointManager(tmp_path)
    path = _save(io, manager, 10)
    manifest = read_manifest(path)
    assert manifest is not None and manifest["step"] == 10 and manifest["hash"] == "sha256"
    assert set(manifest["files"]) == {STATE_NAME}
    assert manifest["files"][STATE_NAME]["size_bytes"] == (path / STATE_NAME).stat().st_size
    assert "torch" in manifest["versions"]
    assert (tmp_path / "latest").read_text().strip() == "step-00000010"
    assert verify_checkpoint(path) == []
    assert torch.equal(io.load_checkpoint(path)["w"], torch.full((256,), 10.0))


# Valid JSON, wrong shape: each is damage like a flipped byte (skipped, refused, set aside), never a KeyError.
MALFORMED = {
    "entry_without_fields": ({"files": {STATE_NAME: {}}}, "files['state.ckpt'].size_bytes is None"),
    "files_as_a_list": ({"files": [STATE_NAME]}, "'files' is a list, not a mapping"),
    "no_files": ({"files": {}}, "the manifest lists no files"),
    "escaping_path": (
        {"files": {"../state.ckpt": {"size_bytes": 1, "sha256": "0" * 64}}},
        "unsafe file name",
    ),
    "text_loss": ({"val_loss": "low"}, "val_loss is 'low', not a number"),
    "top_level_list": ([1, 2], "not a gaudi3-checkpoint manifest"),
}


def _malform(directory: Path, change: object) -> None:
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    json.dump(
        {**manifest, **change} if isinstance(change, dict) else change, (directory / MANIFEST_NAME).open("w")
    )


@pytest.mark.parametrize("damage", ["flip", "truncate", "no_manifest", *MALFORMED])
def test_damaged_latest_is_skipped_with_a_warning_naming_it(tmp_path: Path, damage: str) -> None:
    io, manager = VerifiedCheckpointIO(), CheckpointManager(tmp_path)
    good = _save(io, manager, 10)
    bad = _save(io, manager, 20)
    state = bad / STATE_NAME
    data = bytearray(state.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
        state.write_bytes(bytes(data))
    elif damage == "truncate":
        state.write_bytes(bytes(data[:-7]))
    elif damage == "no_manifest":
        (bad / MANIFEST_NAME).unlink()
    else:
        _malform(bad, MALFORMED[damage][0])
    warnings: list[str] = []
    assert manager.latest_valid(warn=warnings.append) == good
    assert len(warnings) == 1 and "step-00000020" in warnings[0]
    expected = {
        "flip": "SHA-256 does not match",
        "truncate": "bytes, the manifest says",
        "no_manifest": "no commit",
        **{name: message for name, (_, message) in MALFORMED.items()},
    }
    assert expected[damage] in warnings[0]
    with pytest.raises(UserInputError, match="step-00000020"):
        io.load_checkpoint(bad / STATE_NAME)


def test_malformed_manifest_is_listed_as_damaged_and_set_aside_not_deleted(tmp_path: Path) -> None:
    from gaudi3_scale.checkpoint.inspect import checkpoint_rows

    io, manager = (
        VerifiedCheckpointIO(),
        CheckpointManager(tmp_path, RetentionPolicy(keep_last=2, keep_best=1)),
    )
    _save(io, manager, 10, val_loss=2.0)
    bad = _save(io, manager, 20, val_loss=1.0)
    _malform(bad, {"files": [STATE_NAME]})
    rows = {row["step"]: row for row in checkpoint_rows(tmp_path, verify=False)}
    assert (
        rows[20]["committed"] and "'files' is a list" in rows[20]["status"] and rows[20]["size_bytes"] is None
    )
    assert rows[10]["status"] == "-" and [step for step, _ in manager.committed()] == [10]
    before = (bad / STATE_NAME).read_bytes()
    _save(io, manager, 20, val_loss=0.5)  # training passes step 20 again: a new commit, the damaged one kept
    assert (tmp_path / "step-00000020.damaged-1" / STATE_NAME).read_bytes() == before
    assert verify_checkpoint(bad) == [] and manager.latest_valid() == bad


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (
            b'{"files": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            "manifest.json: nested deeper than 64 levels",
        ),
        (b'{"format": "caf\xe9"}', "manifest.json is not UTF-8 text: byte 0xe9 at offset 15"),
        (b'{"format": ', "manifest.json: not valid JSON at line 1, column 12"),
    ],
)
def test_unparseable_manifest_is_one_line_of_damage(tmp_path: Path, content: bytes, problem: str) -> None:
    io, manager = VerifiedCheckpointIO(), CheckpointManager(tmp_path)
    _save(io, manager, 10)
    bad = _save(io, manager, 20)
    (bad / "manifest.json").write_bytes(content)
    [found] = verify_checkpoint(bad)
    assert problem in found and "\n" not in found and len(found) < 300
    assert manager.latest_valid() == manager.path_for(10)


def test_committed_checkpoint_is_never_overwritten_but_a_leftover_is_replaced(tmp_path: Path) -> None:
    io, manager = VerifiedCheckpointIO(), CheckpointManager(tmp_path)
    path = _save(io, manager, 10)
    before = (path / STATE_NAME).read_bytes()
    with pytest.raises(FileExistsError):
        io.save_checkpoint({"global_step": 10, "w": torch.zeros(3)}, path)
    assert (path / STATE_NAME).read_bytes() == before
    leftover = manager.path_for(20)
    leftover.mkdir()
    (leftover / STATE_NAME).write_bytes(b"half a checkpoint")
    io.save_checkpoint({"global_step": 20, "w": torch.ones(3)}, leftover)
    assert verify_checkpoint(leftover) == []


class _DiskFull:
    """Pickling it fails as a full disk does; copying it (async staging) works."""

    def __deepcopy__(self, memo: dict) -> _DiskFull:
        return self

    def __reduce__(self) -> tuple:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_failing_write_leaves_no_partial_checkpoint_and_keeps_earlier_ones(tmp_path: Path) -> None:
    io, manager = VerifiedCheckpointIO(), CheckpointManager(tmp_path)
    good = _save(io, manager, 10)
    with pytest.raises(CheckpointSaveError, match=r"step-00000020 was not saved .*No space left"):
        io.save_checkpoint(
            {"global_step": 20, "w": torch.zeros(4096), "x": _DiskFull()}, manager.path_for(20)
        )
    assert not manager.path_for(20).exists()
    assert [p for _, p in manager.committed()] == [good] and verify_checkpoint(good) == []
    assert manager.latest_valid() == good


def test_retention_keeps_last_every_kth_and_best(tmp_path: Path) -> None:
    io = VerifiedCheckpointIO()
    manager = CheckpointManager(tmp_path, RetentionPolicy(keep_last=2, keep_every_steps=30, keep_best=1))
    losses = {10: 3.0, 20: 1.5, 30: 2.9, 40: 2.8, 50: 2.7, 60: 2.6, 70: 2.5}
    leftover = manager.path_for(15)
    leftover.mkdir(parents=True)  # a crashed save: uncommitted, superseded by step 20
    for step, loss in losses.items():
        _save(io, manager, step, val_loss=loss)
    kept = [step for step, _ in manager.steps()]
    assert kept == [20, 30, 60, 70]  # best (20), every 30th (30, 60), last two (60, 70)
    assert json.loads(json.dumps(read_manifest(manager.path_for(20))))["val_loss"] == 1.5


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        data = torch.utils.data.TensorDataset(torch.randn(16, 4, generator=torch.Generator().manual_seed(0)))
        return torch.utils.data.DataLoader(data, batch_size=4)


def test_plain_lightning_trainer_gets_committed_verified_checkpoints(tmp_path: Path) -> None:
    def trainer(max_steps: int) -> pl.Trainer:
        return pl.Trainer(max_steps=max_steps, plugins=[VerifiedCheckpointIO()], default_root_dir=tmp_path,
                          logger=False, enable_progress_bar=False, enable_model_summary=False,
                          callbacks=[pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2)])  # fmt: skip

    trainer(4).fit(_Tiny())
    saved = sorted((tmp_path / "ckpt").iterdir())
    assert saved and all(p.is_dir() and verify_checkpoint(p) == [] for p in saved)
    resumed = trainer(6)
    resumed.fit(_Tiny(), ckpt_path=str(saved[-1]))
    assert resumed.global_step == 6
    state = saved[-1] / STATE_NAME
    state.write_bytes(state.read_bytes()[:-1])
    with pytest.raises(UserInputError, match="not usable"):
        trainer(8).fit(_Tiny(), ckpt_path=str(saved[-1]))


def test_async_save_snapshots_then_commits_in_the_background(tmp_path: Path) -> None:
    io, manager = AsyncVerifiedCheckpointIO(), CheckpointManager(tmp_path)
    committed: list[Path] = []
    io.on_commit = lambda directory: (committed.append(directory), manager.mark_latest(directory))
    weight = torch.zeros(1 << 20)
    tied = {"a": weight, "b": weight.view(-1)}  # one storage, as tied embeddings are
    io.save_checkpoint({"global_step": 1, "w": weight, "tied": tied}, manager.path_for(1))
    weight += 1  # training goes on while the write is in flight: the snapshot must not see this
    io.save_checkpoint({"global_step": 2, "w": weight}, manager.path_for(2))  # waits for the first one
    io.wait()
    assert committed == [manager.path_for(1), manager.path_for(2)]
    assert (tmp_path / "latest").read_text().strip() == "step-00000002"
    first = io.load_checkpoint(manager.path_for(1))
    assert torch.equal(first["w"], torch.zeros(1 << 20))
    assert first["tied"]["a"].untyped_storage().data_ptr() == first["tied"]["b"].untyped_storage().data_ptr()
    assert torch.equal(io.load_checkpoint(manager.path_for(2))["w"], torch.ones(1 << 20))


def test_async_save_failure_is_raised_by_the_next_wait_and_commits_nothing(tmp_path: Path) -> None:
    io, manager = AsyncVerifiedCheckpointIO(), CheckpointManager(tmp_path)
    io.save_checkpoint({"global_step": 10, "w": torch.ones(8)}, manager.path_for(10))
    io.wait()
    good = manager.path_for(10)
    manager.mark_latest(good)
    io.save_checkpoint({"global_step": 20, "x": _DiskFull()}, manager.path_for(20))  # returns at once
    with pytest.raises(CheckpointSaveError, match=r"step-00000020 was not saved .*No space left"):
        io.wait()
    io.wait()  # the error is raised once, not again
    assert not manager.path_for(20).exists()
    assert manager.latest_valid() == good and verify_checkpoint(good) == []
