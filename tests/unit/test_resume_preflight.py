"""`train.preflight.check_resume_config`: the resume comparison made before the dataset is opened, on the config as
given. The model fields the data resolves (vocabulary, padding) are left to the trainer when the config leaves them
null; a `train.max_epochs` run's placeholder max_steps is not compared with the checkpoint's step; a checkpoint
that cannot be read passes (resume_point verifies and names it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gaudi3_scale.checkpoint.manifest import write_manifest
from gaudi3_scale.config.core import to_dict
from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.train.config import RunConfig, build_run_config
from gaudi3_scale.train.preflight import check_resume_config


def _config(out: Path, *pairs: tuple[str, str]) -> RunConfig:
    return build_run_config(None, [("model.name", "llama-tiny"), ("out_dir", str(out)), *pairs])


def _checkpoint(out: Path, step: int, saved: dict) -> Path:
    directory = out / "checkpoints" / f"step-{step:08d}"
    directory.mkdir(parents=True)
    torch.save({"global_step": step, "gaudi3_config": saved}, directory / "state.ckpt")
    write_manifest(directory, {"step": step})
    return directory


def _resolved(cfg: RunConfig, **train: object) -> dict:
    """`cfg` as its trainer saves it: vocabulary and padding resolved from the data and device."""
    saved = to_dict(cfg)
    saved["model"].update(vocab_size=65, pad_vocab_to_multiple=1)
    saved["train"].update(train)
    return saved


def test_fields_the_data_resolves_wait_for_the_data_unless_set(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    _checkpoint(tmp_path, 4, _resolved(cfg))
    check_resume_config(cfg)  # vocab_size and padding null in the config: the trainer compares them
    with pytest.raises(
        UserInputError, match=r"^model\.pad_vocab_to_multiple: the checkpoint was trained with 1 "
    ):
        check_resume_config(_config(tmp_path, ("model.pad_vocab_to_multiple", "64")))
    with pytest.raises(UserInputError, match=r"^model\.num_layers: "):
        check_resume_config(_config(tmp_path, ("model.num_layers", "7")))


def test_an_epoch_based_run_past_the_default_max_steps_resumes(tmp_path: Path) -> None:
    cfg = _config(tmp_path, ("train.max_epochs", "3"))
    _checkpoint(tmp_path, 2500, _resolved(cfg, max_steps=6000, max_epochs=None))
    check_resume_config(cfg)  # its max_steps (2000, a placeholder) is not what it trains to
    with pytest.raises(
        UserInputError, match=r"^train\.max_steps: 2000, but the checkpoint step-00002500 is at"
    ):
        check_resume_config(_config(tmp_path))


def test_an_unreadable_checkpoint_is_left_to_resume_point(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    directory = _checkpoint(tmp_path, 4, _resolved(cfg))
    (directory / "state.ckpt").write_bytes(b"not a checkpoint")
    check_resume_config(_config(tmp_path, ("seed", "7")))


def _sharded_checkpoint(out: Path, step: int, saved: dict) -> Path:
    """A committed sharded (DCP) checkpoint as an FSDP run writes it: shards + index, meta.pt, then the manifest."""
    import torch.distributed.checkpoint as dcp

    directory = out / "checkpoints" / f"step-{step:08d}"
    directory.mkdir(parents=True)
    weights = {"w": torch.ones(4, 4)}
    dcp.save({"state_dict": weights, "optimizer_0": {"state": {"w": {"exp_avg": torch.zeros(4, 4)}},
                                                     "param_groups": [{"lr": 0.1, "params": ["w"]}]}},
             checkpoint_id=directory, no_dist=True)  # fmt: skip
    torch.save({"global_step": step, "gaudi3_config": saved}, directory / "meta.pt")
    write_manifest(directory, {"step": step, "layout": "sharded", "strategy": "fsdp", "world_size": 2})
    return directory


def test_resume_checks_read_no_tensor_of_a_sharded_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every rank and the launcher run `resume_point`: consolidating the shards there held the whole model and its
    optimizer state in each process (11 s and 1.4 GiB for a 100M-parameter FSDP checkpoint, 2026-11-30). The
    checks read the non-tensor state only, and a ZeRO strategy is still refused a sharded checkpoint's optimizer
    state, with or without the run's own model (`own_model`)."""
    import gaudi3_scale.checkpoint.reader as reader
    from gaudi3_scale.train.preflight import resume_point

    cfg = _config(tmp_path, ("parallel.strategy", "fsdp"), ("parallel.nproc_per_node", "2"))
    directory = _sharded_checkpoint(tmp_path, 4, _resolved(cfg))

    def full_load(target: Path) -> dict:
        raise AssertionError(f"the resume checks consolidated {target}")

    monkeypatch.setattr(reader, "consolidate", full_load)
    for own_model in (True, False):
        assert resume_point(cfg, own_model=own_model) == directory
    zero = _config(tmp_path, ("parallel.strategy", "deepspeed_zero2"), ("parallel.nproc_per_node", "2"))
    for own_model in (True, False):
        with pytest.raises(
            UserInputError, match=r"^parallel\.strategy: deepspeed_zero2 resumes only checkpoints"
        ):
            resume_point(zero, own_model=own_model)
