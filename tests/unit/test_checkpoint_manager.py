"""Checkpoint commit (manifest written last), verification (a manifest's step against its directory, the files its
layout needs), the `latest` pointer, retention, failing writes, and which checkpoint a rollback restores."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from gaudi3_scale.checkpoint.async_save import AsyncVerifiedCheckpointIO
from gaudi3_scale.checkpoint.contents import DATAMODULE_KEY
from gaudi3_scale.checkpoint.inspect import checkpoint_rows
from gaudi3_scale.checkpoint.manager import (
    META_KEY,
    STATE_NAME,
    CheckpointManager,
    CheckpointSaveError,
    RetentionPolicy,
    resolve_checkpoint,
)
from gaudi3_scale.checkpoint.manifest import MANIFEST_NAME, read_manifest, verify_checkpoint, write_manifest
from gaudi3_scale.checkpoint.reader import read_checkpoint
from gaudi3_scale.checkpoint.sharded import is_sharded
from gaudi3_scale.checkpoint.verified_io import VerifiedCheckpointIO
from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.data.skips import BatchSkips
from gaudi3_scale.train.rollback import plan_rollback


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


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("older", ["intact", "damaged"])
def test_retention_keeps_the_pointer_target_and_never_counts_checkpoints_past_it(
    tmp_path: Path, older: str
) -> None:
    """A run that resumed from step 2 while step 4 exists (named explicitly, or step 4 skipped as damaged) commits
    step 3 under keep_last 1: step 3 (`latest`) and step 4 stay, step 2 goes; nothing `latest` names is deleted."""
    io = VerifiedCheckpointIO()
    first = CheckpointManager(tmp_path, RetentionPolicy(keep_last=5))
    for step in (2, 4):
        _save(io, first, step)
    if older == "damaged":
        _flip(first.path_for(4) / STATE_NAME)
    resumed = CheckpointManager(tmp_path, RetentionPolicy(keep_last=1))
    _save(io, resumed, 3)
    assert [step for step, _ in resumed.steps()] == [3, 4]
    assert resumed.pointed() == resumed.path_for(3) and verify_checkpoint(resumed.path_for(3)) == []
    assert resumed.latest_valid(warn=lambda message: None) == resumed.path_for(3)


def test_a_copied_checkpoint_is_damage_never_taken_as_the_newest_nor_deleted(tmp_path: Path) -> None:
    io = VerifiedCheckpointIO()
    manager = CheckpointManager(tmp_path, RetentionPolicy(keep_last=1))
    _save(io, manager, 2)
    shutil.copytree(manager.path_for(2), manager.path_for(8))  # its manifest still says step 2
    assert verify_checkpoint(manager.path_for(8)) == [
        "step-00000008: its manifest is of step 2 (copied or renamed)"
    ]
    (tmp_path / "latest").unlink()  # ranked by their names alone, the copy would come first
    skipped: list[str] = []
    assert manager.latest_valid(warn=skipped.append) == manager.path_for(2)
    assert len(skipped) == 1 and "step-00000008" in skipped[0]
    _save(io, manager, 4)  # retention ranks by the manifests' steps: the copy neither counts nor goes
    assert [step for step, _ in manager.steps()] == [4, 8]


def test_a_latest_pointer_that_is_not_text_is_ignored_and_named_explicitly_is_one_line(
    tmp_path: Path,
) -> None:
    io = VerifiedCheckpointIO()
    manager = CheckpointManager(tmp_path)
    for step in (2, 4):
        _save(io, manager, step)
    (tmp_path / "latest").write_bytes(b"\xff\xfe\x00step")
    assert manager.pointed() is None and manager.latest_valid() == manager.path_for(4)
    assert resolve_checkpoint(tmp_path) == manager.path_for(4)
    assert [row["latest"] for row in checkpoint_rows(tmp_path, verify=False)] == [False, False]
    with pytest.raises(UserInputError, match="names no checkpoint directory"):
        resolve_checkpoint(tmp_path / "latest")


def test_files_the_manifest_does_not_list_decide_nothing(tmp_path: Path) -> None:
    """A DCP index and `meta.pt` dropped into a verified single-file checkpoint: it still loads its `state.ckpt`."""
    io = VerifiedCheckpointIO()
    path = _save(io, CheckpointManager(tmp_path), 2)
    (path / ".metadata").write_bytes(b"")
    (path / "meta.pt").write_bytes(b"")
    assert verify_checkpoint(path) == [] and not is_sharded(path)
    assert torch.equal(read_checkpoint(path)["w"], torch.full((256,), 2.0))


def _sharded(directory: Path) -> Path:
    """A sharded checkpoint as FSDP writes one (DCP shards and index, rank 0's meta.pt), committed."""
    import torch.distributed.checkpoint as dcp

    directory.mkdir(parents=True)
    state = {"state_dict": {"w": torch.arange(8.0)}}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(directory), no_dist=True)
    torch.save({"global_step": 3}, directory / "meta.pt")
    write_manifest(directory, {"step": 3, "layout": "sharded"})
    return directory


@pytest.mark.parametrize("lost", ["shard", ".metadata", "state.ckpt"])
def test_a_manifest_that_omits_a_file_its_layout_needs_is_damage(tmp_path: Path, lost: str) -> None:
    path = _sharded(tmp_path / "step-00000003")
    assert verify_checkpoint(path) == [] and is_sharded(path)
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    if lost == "state.ckpt":  # a single-file checkpoint's manifest that lists no state
        manifest["layout"] = "single-file"
        for name in (".metadata", "meta.pt"):
            del manifest["files"][name]
        want = "step-00000003: the manifest lists no state.ckpt"
    else:
        name = next(n for n in manifest["files"] if n.endswith(".distcp")) if lost == "shard" else lost
        (path / name).unlink()
        del manifest["files"][name]
        want = (f"step-00000003/{name}: named by the shard index but not by the manifest" if lost == "shard"
                else "step-00000003: a sharded checkpoint whose manifest lists no .metadata")  # fmt: skip
    (path / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert verify_checkpoint(path) == [want]
    with pytest.raises(UserInputError, match="is not usable"):
        read_checkpoint(path)


def test_a_rollback_passes_over_a_damaged_checkpoint_to_the_newest_that_verifies(tmp_path: Path) -> None:
    io = VerifiedCheckpointIO()
    manager = CheckpointManager(tmp_path, RetentionPolicy(keep_last=5))
    for step in (4, 5, 6):
        path = manager.path_for(step)
        state = {"global_step": step, "epoch": 0, DATAMODULE_KEY: {"samples_consumed": 4 * step}}
        io.save_checkpoint(state, path / STATE_NAME)
        manager.mark_latest(path)
    _flip(manager.path_for(6) / STATE_NAME)
    skipped: list[str] = []
    rollback = plan_rollback(manager, spike_step=7, skips=BatchSkips([]), global_batch_size=4, skip_batches=3,
                             lr_scale=1.0, warn=skipped.append)  # fmt: skip
    assert (rollback.to_step, rollback.checkpoint) == (5, manager.path_for(5) / STATE_NAME)
    assert rollback.skipped == range(5, 8)
    assert len(skipped) == 1 and "step-00000006" in skipped[0] and "SHA-256" in skipped[0]
