"""A checkpoint saved by an older gaudi3-scale, whose model section lacks fields added since (num_experts,
experts_per_token, the MoE loss coefficients, type_vocab_size, init_from: 2026-11-26), resumes when the config
leaves them at their defaults (what the old run trained with); set to something else, one line that says the
checkpoint predates the field. Before, every such run was refused with advice that could not be followed ("use the
original value": None, which the config refuses)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gaudi3_scale.checkpoint.manifest import write_manifest
from gaudi3_scale.config.core import to_dict
from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.train.config import build_run_config
from gaudi3_scale.train.resume import check_resume_compatible, check_resume_data

ADDED = (
    "num_experts",
    "experts_per_token",
    "moe_aux_loss_coef",
    "moe_z_loss_coef",
    "type_vocab_size",
    "init_from",
)


def _older_checkpoint(tmp_path: Path, config: dict) -> Path:
    saved = {**config, "model": {k: v for k, v in config["model"].items() if k not in ADDED}}
    path = tmp_path / "step-00000004" / "state.ckpt"
    path.parent.mkdir()
    torch.save({"global_step": 4, "gaudi3_config": saved}, path)
    write_manifest(path.parent, {"step": 4, "tokens_seen": 3072})
    return path


def test_fields_added_since_the_checkpoint_at_their_defaults_resume(tmp_path: Path) -> None:
    config = to_dict(build_run_config(None, [("model.name", "llama-tiny"), ("train.max_steps", "6")]))
    assert check_resume_compatible(_older_checkpoint(tmp_path, config), config) == 4
    moe = {**config, "model": {**config["model"], "num_experts": 4}}
    with pytest.raises(UserInputError) as refused:
        check_resume_compatible(tmp_path / "step-00000004" / "state.ckpt", moe)
    assert str(refused.value) == (
        "model.num_experts: the checkpoint was trained with no such field (an older gaudi3-scale) but the config "
        "says 4; use the original value or a new --out directory"
    )


def _checkpoint_with_data(tmp_path: Path, name: str, data: dict, data_sha256: str) -> Path:
    path = tmp_path / name / "state.ckpt"
    path.parent.mkdir()
    torch.save({"global_step": 4, "gaudi3_config": {"data": data}}, path)
    write_manifest(path.parent, {"step": 4, "tokens_seen": 3072, "data_sha256": data_sha256})
    return path


def test_a_mixture_checkpoint_from_before_the_mixtures_own_identity_resumes_with_a_note(
    tmp_path: Path,
) -> None:
    """Before 2026-11-30 a mixture's data identity had no `mixture:` form: such a run was refused as "trained on
    one dataset, not a mixture" (untrue). Its own config says it was a mixture: it resumes, with a note that the
    members' tokens could not be compared. A run that really trained on one dataset is still refused."""
    mixture = {"mixture": [{"source": "a", "weight": 1.0}, {"source": "b", "weight": 1.0}]}
    older = _checkpoint_with_data(tmp_path, "step-00000004", mixture, "0" * 64)
    notes: list[str] = []
    check_resume_data(older, "mixture:" + "1" * 64, warn=notes.append)
    assert notes == [
        "the checkpoint step-00000004 records its mixture's data in an older form: the members' tokens are not "
        "compared on this resume"
    ]
    single = _checkpoint_with_data(tmp_path, "step-00000008", {"source": "tinyshakespeare"}, "0" * 64)
    with pytest.raises(ConfigError, match="trained on one dataset"):
        check_resume_data(single, "mixture:" + "1" * 64, warn=notes.append)
