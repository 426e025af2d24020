"""Resuming a checkpoint across versions of what the model computes, and refusing a resume before any data work.

Every checkpoint's manifest records the changes to what the models compute that its run had (`model_semantics`,
`models.semantics`). A checkpoint from before one of them (by its record, or for checkpoints older than the record
by the day it was written) resumes with one warning naming the change, where the change makes a difference to its
model (vocabulary padding masked: a model with padding rows). Before, such a run continued on another objective
without a word (padding rows in the softmax until 2026-11-28, out of it after).

A resume refused for its model, seed or dataset is refused before the dataset is prepared: before, `gaudi3 train
--data.source other.txt` on a run of another dataset first tokenized and cached all of other.txt, then said no.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from gaudi3_scale.checkpoint.manifest import MANIFEST_NAME, ManifestError, parse_manifest
from gaudi3_scale.models.semantics import changes_missing_from, model_semantics

TINY = ["--model.name=llama-tiny", "--model.num_layers=1", "--model.context_length=32", "--train.threads=1",
        "--train.global_batch_size=2", "--train.micro_batch_size=2", "--train.val_every_steps=0",
        "--checkpoint.every_steps=2", "--optim.warmup_steps=1", "--sample-tokens=0", "--no-progress",
        "--model.pad_vocab_to_multiple=64"]  # fmt: skip
STEP2 = "checkpoints/step-00000002"
BEFORE_THE_MASK = datetime(2026, 11, 27, tzinfo=UTC).timestamp()


def _train(out: Path, *args: str, cache: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **({"GAUDI3_CACHE": str(cache)} if cache is not None else {})}
    return subprocess.run(
        [sys.executable, "-m", "gaudi3_scale.cli", "train", f"--out={out}", *TINY, *args],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("semantics") / "run"
    proc = _train(out, "--train.max_steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _manifest(run: Path) -> dict:
    return json.loads((run / STEP2 / MANIFEST_NAME).read_text())


def _rewrite_manifest(run: Path, **changes: object) -> None:
    manifest = _manifest(run)
    for key, value in changes.items():
        if value is None:
            manifest.pop(key, None)
        else:
            manifest[key] = value
    (run / STEP2 / MANIFEST_NAME).write_text(json.dumps(manifest))


def test_every_checkpoint_records_what_its_model_computes_and_which_code(run: Path) -> None:
    manifest = _manifest(run)
    assert manifest["model_semantics"] == model_semantics() == ["vocab-padding-masked"]
    import gaudi3_scale

    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=Path(gaudi3_scale.__file__).parent)  # fmt: skip
    if head.returncode == 0:  # a checkout (CI's clone): its commit, +dirty with uncommitted changes
        assert manifest["versions"]["gaudi3-scale-commit"].split("+")[0] == head.stdout.strip()
    else:  # an installed wheel: the version alone
        assert "gaudi3-scale-commit" not in manifest["versions"]


@pytest.mark.parametrize(
    "how",
    ["predates-the-record", "record-without-the-change"],
)
def test_a_checkpoint_from_before_the_padding_mask_resumes_with_a_warning(
    run: Path, tmp_path: Path, how: str
) -> None:
    old = tmp_path / "old"
    shutil.copytree(run, old)
    if how == "predates-the-record":
        _rewrite_manifest(old, model_semantics=None, created_unix_s=BEFORE_THE_MASK)
    else:
        _rewrite_manifest(old, model_semantics=[])
    proc = _train(old, "--train.max_steps=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "the checkpoint step-00000002 was written before 2026-11-28 21:17 UTC, when the vocabulary padding rows "
        "take no part in the model's distribution (models.vocab) came in: its 63 vocabulary padding rows took part "
        "in the softmax then and take none now" in " ".join(proc.stderr.split())
    ), proc.stderr[-3000:]
    # the resumed run computes with the mask: its own checkpoint says so
    manifest = json.loads((old / "checkpoints/step-00000004" / MANIFEST_NAME).read_text())
    assert manifest["model_semantics"] == model_semantics()


def test_a_checkpoint_of_this_version_resumes_without_the_warning(run: Path, tmp_path: Path) -> None:
    current = tmp_path / "current"
    shutil.copytree(run, current)
    proc = _train(current, "--train.max_steps=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "was written before" not in proc.stderr, proc.stderr[-3000:]


def test_the_change_concerns_only_models_with_padding_rows() -> None:
    before = {"created_unix_s": BEFORE_THE_MASK}
    padded = {"vocab_size": 65, "pad_vocab_to_multiple": 64}
    assert [c.name for c in changes_missing_from(before, padded)] == ["vocab-padding-masked"]
    assert changes_missing_from(before, {"vocab_size": 65, "pad_vocab_to_multiple": 1}) == []
    assert changes_missing_from(before, {"vocab_size": 128, "pad_vocab_to_multiple": 64}) == []
    assert changes_missing_from({"created_unix_s": 1795900621}, padded) == []  # written after it landed
    assert changes_missing_from({}, padded) == []  # nothing says when: no claim
    assert changes_missing_from({"model_semantics": ["vocab-padding-masked"]}, padded) == []


def test_a_manifest_with_a_malformed_record_is_damaged(run: Path) -> None:
    manifest = _manifest(run)
    parse_manifest(json.dumps(manifest))
    with pytest.raises(ManifestError, match=r"model_semantics is .*, not a list of names"):
        parse_manifest(json.dumps({**manifest, "model_semantics": "vocab-padding-masked"}))
    with pytest.raises(ManifestError, match="model_semantics"):
        parse_manifest(json.dumps({**manifest, "model_semantics": [1]}))


@pytest.mark.parametrize(
    ("flag", "says"),
    [
        ("--data.source={text}", "data.source: the checkpoint was trained with 'tinyshakespeare'"),
        ("--seed=7", "seed: the checkpoint was trained with"),
        ("--model.num_layers=2", "model.num_layers: the checkpoint was trained with 1"),
    ],
)
def test_a_refused_resume_prepares_no_data(run: Path, tmp_path: Path, flag: str, says: str) -> None:
    text = tmp_path / "other.txt"
    text.write_text("an entirely different corpus, " * 400)
    cache = tmp_path / "cache"
    shutil.copytree(Path(os.environ["GAUDI3_CACHE"]), cache)
    before = sorted(p.relative_to(cache) for p in cache.rglob("*"))
    target = tmp_path / "run"
    shutil.copytree(run, target)
    files = sorted(p.relative_to(target) for p in target.rglob("*"))
    proc = _train(target, "--train.max_steps=4", flag.format(text=text), cache=cache)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert says in proc.stderr, proc.stderr[-3000:]
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert (
        sorted(p.relative_to(cache) for p in cache.rglob("*")) == before
    )  # nothing prepared, nothing cached
    assert sorted(p.relative_to(target) for p in target.rglob("*")) == files  # nothing written in the run
