"""The Checkpointer's lifecycle (start, commit, wait, close; with and without a remote) and the single reader."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from gaudi3_scale.checkpoint.async_save import AsyncVerifiedCheckpointIO
from gaudi3_scale.checkpoint.checkpointer import Checkpointer
from gaudi3_scale.checkpoint.config import CheckpointConfig
from gaudi3_scale.checkpoint.contents import META_KEY
from gaudi3_scale.checkpoint.manager import STATE_NAME, CheckpointSaveError
from gaudi3_scale.checkpoint.reader import read_checkpoint
from gaudi3_scale.checkpoint.remote import open_remote
from gaudi3_scale.config.errors import UserInputError


def _save(checkpointer: Checkpointer, step: int) -> Path:
    """What Lightning does on rank 0: hand the checkpoint dict to the IO plugin."""
    path = checkpointer.manager.path_for(step)
    state = {
        "global_step": step,
        "epoch": 0,
        "w": torch.full((64,), float(step)),
        META_KEY: {"val_loss": 1.0},
    }
    checkpointer.io.save_checkpoint(state, path / STATE_NAME)
    return path


def _steps(checkpointer: Checkpointer) -> list[int]:
    return [step for step, _ in checkpointer.manager.steps()]


def test_without_a_remote_commits_move_latest_and_apply_retention(tmp_path: Path) -> None:
    config = CheckpointConfig(keep_last=2, async_save=False)
    with Checkpointer(config, tmp_path / "checkpoints") as checkpointer:
        assert checkpointer.mirror is None and not isinstance(checkpointer.io, AsyncVerifiedCheckpointIO)
        for step in (10, 20, 30):
            _save(checkpointer, step)
        assert _steps(checkpointer) == [20, 30]
        assert (tmp_path / "checkpoints" / "latest").read_text() == "step-00000030\n"
        assert checkpointer.wait() is True


def test_async_save_commits_in_the_background_and_wait_raises_its_failure(tmp_path: Path) -> None:
    checkpointer = Checkpointer(CheckpointConfig(keep_last=1), tmp_path).start()
    assert isinstance(checkpointer.io, AsyncVerifiedCheckpointIO)
    _save(checkpointer, 10)
    checkpointer.wait()
    assert (tmp_path / "latest").read_text() == "step-00000010\n"
    bad = checkpointer.manager.path_for(20)
    unpicklable = {"global_step": 20, "x": lambda: None}  # staged (copied) fine, fails in the writer thread
    checkpointer.io.save_checkpoint(unpicklable, bad / STATE_NAME)  # returns at once
    with pytest.raises(CheckpointSaveError, match=r"step-00000020 was not saved \(.*pickle"):
        checkpointer.wait()
    checkpointer.close()
    assert not bad.exists() and (tmp_path / "latest").read_text() == "step-00000010\n"


def test_other_ranks_neither_commit_nor_mirror(tmp_path: Path) -> None:
    config = CheckpointConfig(async_save=False, remote_url=(tmp_path / "remote").as_uri())
    with Checkpointer(config, tmp_path / "checkpoints", rank=1) as checkpointer:
        assert checkpointer.mirror is None and checkpointer.io.on_commit is None
        _save(checkpointer, 10)
    assert not (tmp_path / "checkpoints" / "latest").exists() and not (tmp_path / "remote").exists()


def test_close_waits_for_uploads_then_applies_the_retention_that_waited_on_them(tmp_path: Path) -> None:
    local, remote = tmp_path / "checkpoints", tmp_path / "remote"
    # A symlink to itself where the remote directory goes: every upload fails with ELOOP, an OSError retrying may get
    # past (unlike a file in the way, NotADirectoryError, which stops the mirror), until it is removed.
    remote.symlink_to(remote)
    config = CheckpointConfig(
        keep_last=1, async_save=False, remote_url=(remote / "run").as_uri(), remote_max_backoff_s=1.0
    )
    crashed = Checkpointer(CheckpointConfig(async_save=False), local).start()
    _save(crashed, 10)  # a run that committed step 10 and died before uploading it

    warnings: list[str] = []
    checkpointer = Checkpointer(config, local, warn=warnings.append).start()  # re-submits step 10
    _save(checkpointer, 20)
    _save(checkpointer, 30)
    assert _steps(checkpointer) == [
        10,
        20,
        30,
    ]  # none is verified remotely: all kept, whatever keep_last says
    assert checkpointer.mirror is not None and checkpointer.mirror.status().backlog == 3
    remote.unlink()  # the storage recovers
    checkpointer.close()
    assert _steps(checkpointer) == [30] and (local / "latest").read_text() == "step-00000030\n"
    fs, root = open_remote(config.remote_url)
    assert fs.cat_file(f"{root}/latest") == b"step-00000030\n"
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(root)) == ["latest", "step-00000030"]
    assert "is failing" in warnings[0] and "reachable again" in warnings[1]
    with pytest.raises(RuntimeError, match="closed"):
        checkpointer.mirror.submit(local / "step-00000030")


def test_the_reader_resolves_run_directories_and_latest_and_refuses_damage_in_one_line(
    tmp_path: Path,
) -> None:
    with Checkpointer(CheckpointConfig(async_save=False), tmp_path / "run" / "checkpoints") as checkpointer:
        good, bad = _save(checkpointer, 10), _save(checkpointer, 20)
    state = bad / STATE_NAME
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0x01
    state.write_bytes(bytes(data))
    expected = f"checkpoint {str(bad)!r} is not usable: {bad.name}/{STATE_NAME}: SHA-256 does not match"
    for reader in (read_checkpoint, checkpointer.io.load_checkpoint):
        with pytest.raises(UserInputError) as caught:
            reader(bad / STATE_NAME)
        assert str(caught.value).startswith(expected) and "\n" not in str(caught.value)
    skipped: list[str] = []
    for named in (tmp_path / "run", tmp_path / "run" / "checkpoints"):
        assert torch.equal(read_checkpoint(named, warn=skipped.append)["w"], torch.full((64,), 10.0))
    assert len(skipped) == 2 and all("step-00000020" in message for message in skipped)
    with pytest.raises(
        UserInputError, match=r"step-00000020.*is not usable"
    ):  # the pointer names the damaged one
        read_checkpoint(tmp_path / "run" / "checkpoints" / "latest")
    shutil.rmtree(bad)
    plain = tmp_path / "plain.ckpt"  # a plain Lightning file: no manifest to verify, read as it is
    torch.save({"w": torch.ones(2)}, plain)
    assert torch.equal(read_checkpoint(plain)["w"], torch.ones(2))
    with pytest.raises(UserInputError, match="is not usable"):  # a resume loads committed checkpoints only
        checkpointer.io.load_checkpoint(plain)
    assert torch.equal(read_checkpoint(good)["w"], torch.full((64,), 10.0))


def test_light_commits_have_their_own_directory_pointer_and_retention_and_are_not_mirrored(
    tmp_path: Path,
) -> None:
    config = CheckpointConfig(keep_last=3, light_keep_last=1, remote_url=(tmp_path / "remote").as_uri())
    checkpointer = Checkpointer(config, tmp_path / "run" / "checkpoints").start()
    light = checkpointer.light_manager
    assert light.directory == tmp_path / "run" / "light_checkpoints"
    full_state = {"global_step": 10, "w": torch.ones(64), "moment": torch.zeros(32)}
    checkpointer.io.save_checkpoint(full_state, checkpointer.manager.path_for(10) / STATE_NAME)
    for step in (11, 12):  # weights only: the snapshot of a light save needs no `moment` buffer
        checkpointer.io.save_checkpoint(
            {"global_step": step, "w": torch.ones(64)}, light.path_for(step) / STATE_NAME
        )
    checkpointer.wait()
    # The full save's host buffer the light ones did not use is kept for the next full save.
    assert checkpointer.io._buffers.get(((32,), torch.float32))  # type: ignore[attr-defined]
    checkpointer.io.save_checkpoint(
        {**full_state, "global_step": 20}, checkpointer.manager.path_for(20) / STATE_NAME
    )
    assert checkpointer.wait()  # the save in flight, then the uploads
    checkpointer.close()
    assert _steps(checkpointer) == [10, 20] and [step for step, _ in light.steps()] == [12]
    assert (light.directory / "latest").read_text() == "step-00000012\n"
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "step-00000020\n"
    fs, root = open_remote(config.remote_url)
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(root)) == ["latest", "step-00000010", "step-00000020"]


def test_light_checkpoint_config_is_validated_in_one_line() -> None:
    from gaudi3_scale.config.core import parse_overrides
    from gaudi3_scale.config.errors import ConfigError
    from gaudi3_scale.train import build_run_config

    def error(*overrides: str) -> str:
        with pytest.raises(ConfigError) as caught:
            build_run_config(None, parse_overrides(list(overrides)))
        assert "\n" not in str(caught.value)
        return str(caught.value)

    assert (
        error("--checkpoint.light_every_steps", "-1") == "checkpoint.light_every_steps: must be >= 0, got -1"
    )
    assert error("--checkpoint.light_keep_last", "0").startswith("checkpoint.light_keep_last: must be > 0")
    pointless = error("--checkpoint.every_steps", "50", "--checkpoint.light_every_steps", "100")
    assert pointless.startswith(
        "checkpoint.light_every_steps: 100 is a multiple of checkpoint.every_steps (50)"
    )
    for fine in (("50", "20"), ("50", "70"), ("0", "10")):  # some light steps are not full ones
        config = CheckpointConfig(every_steps=int(fine[0]), light_every_steps=int(fine[1]))
        assert config.light_every_steps == int(fine[1])


def test_a_longest_retry_wait_under_a_second_is_honoured(tmp_path: Path) -> None:
    """checkpoint.remote_max_backoff_s 0.5: the first retry waits 0.5 s too, rather than the mirror refusing to
    start once training has begun."""
    config = CheckpointConfig(
        async_save=False, remote_url=(tmp_path / "remote").as_uri(), remote_max_backoff_s=0.5
    )
    with Checkpointer(config, tmp_path / "checkpoints") as checkpointer:
        assert checkpointer.mirror is not None
        _save(checkpointer, 10)
    fs, root = open_remote(config.remote_url)
    assert fs.cat_file(f"{root}/latest") == b"step-00000010\n"
