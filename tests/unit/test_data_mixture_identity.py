"""What a resume compares of a mixture: its members' data (names and tokens), not the weights or the order, which
the mixture sampler's state checks and names; and the refusal names data.mixture, not data.source."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gaudi3_scale.checkpoint.manifest import write_manifest
from gaudi3_scale.config.errors import ConfigError
from gaudi3_scale.data import DataConfig, prepare_dataset
from gaudi3_scale.data.config import MixtureSource
from gaudi3_scale.data.inputs import (
    MIXTURE_SHA256_PREFIX,
    DatasetMember,
    TrainingData,
    training_data_from_dir,
)
from gaudi3_scale.data.sources import bundled_corpora
from gaudi3_scale.train.resume import check_resume_data


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> tuple[DatasetMember, DatasetMember]:
    root = tmp_path_factory.mktemp("mix")
    text = bundled_corpora()["tinyshakespeare"].read_text(encoding="utf-8")
    dirs = []
    for name, start in (("a", 0), ("b", 5_000)):
        (root / f"{name}.txt").write_text(text[start : start + 4_000])
        cfg = DataConfig(source=str(root / f"{name}.txt"), tokenizer="byte")
        dirs.append(prepare_dataset(cfg, root / name, progress=False))
    return training_data_from_dir(dirs[0], name="a"), training_data_from_dir(dirs[1], name="b")


def _mix(*members: tuple[DatasetMember, float]) -> str:
    return TrainingData(members=[dataclasses.replace(m, weight=w) for m, w in members]).tokens_sha256


def _checkpoint(tmp_path: Path, data_sha256: str) -> Path:
    directory = tmp_path / "run" / "step-00000003"
    directory.mkdir(parents=True)
    (directory / "state.ckpt").write_bytes(b"x")
    write_manifest(directory, {"step": 3, "data_sha256": data_sha256})
    return directory


def test_weights_and_order_are_not_the_mixtures_data_identity(
    two: tuple[DatasetMember, DatasetMember],
) -> None:
    a, b = two
    saved = _mix((a, 3.0), (b, 1.0))
    assert saved.startswith(MIXTURE_SHA256_PREFIX)
    assert _mix((a, 6.0), (b, 2.0)) == _mix((a, 1.0), (b, 1.0)) == _mix((b, 1.0), (a, 3.0)) == saved
    assert (
        _mix(
            (a, 3.0),
        )
        != saved
    )  # one member: that dataset's own identity, not a mixture's


def test_a_changed_mixture_is_refused_naming_data_mixture(
    two: tuple[DatasetMember, DatasetMember], tmp_path: Path
) -> None:
    a, b = two
    checkpoint = _checkpoint(tmp_path, _mix((a, 3.0), (b, 1.0)))
    check_resume_data(checkpoint, _mix((a, 6.0), (b, 2.0)))  # weights scaled: same data, resumes
    renamed = dataclasses.replace(b, name="c")
    with pytest.raises(ConfigError) as info:
        check_resume_data(checkpoint, _mix((a, 3.0), (renamed, 1.0)))
    message = str(info.value)
    assert message.startswith(
        "data.mixture: the mixture now holds other tokens than the checkpoint step-00000003"
    )
    assert "a member was added, removed or renamed" in message and "data.source" not in message
    with pytest.raises(ConfigError, match=r"^data\.mixture: the checkpoint was trained on a data\.mixture"):
        check_resume_data(checkpoint, _mix((a, 1.0)))


def test_a_derived_member_name_clash_says_how_to_fix_it() -> None:
    with pytest.raises(ConfigError) as info:
        DataConfig(
            mixture=[MixtureSource(source="x/web", weight=1), MixtureSource(source="s3://y/web/", weight=1)]
        )
    message = str(info.value)
    assert "both get the name 'web' (the last part of their source)" in message and "name: web2" in message


def test_a_member_too_short_for_one_window_is_named(
    two: tuple[DatasetMember, DatasetMember], tmp_path: Path
) -> None:
    from gaudi3_scale.config.errors import UserInputError
    from gaudi3_scale.data.datamodule import TokenDataModule

    (tmp_path / "tiny.txt").write_text("to be or not\n")
    tiny = prepare_dataset(DataConfig(source=str(tmp_path / "tiny.txt"), tokenizer="byte"), tmp_path / "tiny",
                           progress=False)  # fmt: skip
    a, _ = two
    members = [dataclasses.replace(a, weight=1.0), training_data_from_dir(tiny, name="tiny", weight=0.0)]
    module = TokenDataModule(TrainingData(members=members), context_length=32, global_batch_size=2,
                             micro_batch_size=1, seed=0, val_batches=1)  # fmt: skip
    with pytest.raises(
        UserInputError, match=r"^data\.mixture member 'tiny': the train split has \d+ tokens, fewer"
    ):
        module.build_sampler(1, 0)
