"""A checkpoint records the tokenizer it trained with, and generate, serve and export refuse another one.

A char tokenizer of other text fits any model with at least as many ids, but maps every character to another id:
before the record, `load_for_generation(run, tokenizer_dir=<other dataset>)` generated garbage without a word.
One real tiny run (char tokenizer of tinyshakespeare: 65 ids) is trained per module; the other tokenizer is that of
a dataset prepared from 12 characters of other text.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gaudi3_scale.artifacts.export import export_checkpoint, exported_tokenizer_sha256
from gaudi3_scale.artifacts.inference import generate_text, load_for_generation
from gaudi3_scale.checkpoint.contents import TOKENIZER_SHA256_KEY, trained_tokenizer_sha256
from gaudi3_scale.checkpoint.manifest import MANIFEST_NAME, read_manifest
from gaudi3_scale.config.core import parse_overrides
from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.data import DataConfig, load_tokenizer, prepare_dataset
from gaudi3_scale.data.tokenizers import TOKENIZER_FILE, build_tokenizer, tokenizer_sha256
from gaudi3_scale.serve.loading import load_served_model, resolve_source
from gaudi3_scale.train import GaudiTrainer, build_run_config

pytestmark = pytest.mark.integration

GAUDI3 = [sys.executable, "-m", "gaudi3_scale.cli"]
STEP = "step-00000002"
# check_trained_tokenizer's line: "tokenizer DIR is not the one MODEL was trained with (sha256 …); FIX"
REFUSED = "is not the one"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real 2-step run of a 1-layer model on tinyshakespeare (char tokenizer), one committed checkpoint."""
    out = tmp_path_factory.mktemp("tokid") / "run"
    overrides = ["--out_dir", str(out), "--train.threads", "1", "--model.num_layers", "1", "--train.max_steps", "2",
                 "--optim.warmup_steps", "1", "--train.val_every_steps", "0", "--checkpoint.every_steps", "2"]  # fmt: skip
    GaudiTrainer(build_run_config(None, parse_overrides(overrides)), progress=False).fit()
    return out


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tokenizer/ of another dataset: a char tokenizer of 12 characters, fewer than the model's 65 ids."""
    root = tmp_path_factory.mktemp("other")
    text = root / "other.txt"
    text.write_text("hello world\nwe two solder lids\n" * 400, encoding="utf-8")
    prepared = prepare_dataset(DataConfig(source=str(text)), root / "prepared", progress=False)
    assert load_tokenizer(prepared).vocab_size == 12
    return prepared


def _refused(exc: pytest.ExceptionInfo[UserInputError], tokenizer_dir: Path, recorded: str) -> None:
    message = str(exc.value)
    assert "\n" not in message and message.startswith(f"tokenizer {str(tokenizer_dir)!r} {REFUSED} "), message
    ours = tokenizer_sha256(load_tokenizer(tokenizer_dir))
    assert f"(sha256 {ours[:12]}… vs {recorded[:12]}…)" in message, message
    assert message.endswith("pass the run's own tokenizer directory or leave --tokenizer unset"), message


def test_the_identity_is_the_saved_file_and_survives_a_round_trip(tmp_path: Path) -> None:
    """The identity is the SHA-256 of tokenizer.json as saved, and a tokenizer read back from it has the same one
    (for a Hugging Face BPE too, whose JSON is re-serialized), so a run's own tokenizer is never refused."""
    texts = [
        "ROMEO: What light through yonder window breaks? " * 20,
        "It is the east, and Juliet is the sun.",
    ]
    for kind, vocab in (("char", None), ("byte", None), ("bpe", 300)):
        tok = build_tokenizer(kind, texts, vocab)
        saved = tok.save(tmp_path)
        assert tokenizer_sha256(tok) == hashlib.sha256(saved.read_bytes()).hexdigest(), kind
        assert tokenizer_sha256(load_tokenizer(tmp_path)) == tokenizer_sha256(tok), kind
    abc, abd = build_tokenizer("char", ["abc"]), build_tokenizer("char", ["abd"])
    assert tokenizer_sha256(abc) != tokenizer_sha256(abd)


def test_each_checkpoint_records_the_tokenizer_it_trained_with(run_dir: Path) -> None:
    recorded = trained_tokenizer_sha256(read_manifest(run_dir / "checkpoints" / STEP))
    assert recorded == tokenizer_sha256(load_tokenizer(run_dir / "tokenizer"))


def test_generation_refuses_another_tokenizer_and_takes_its_own(
    run_dir: Path, other_tokenizer: Path, tmp_path: Path
) -> None:
    recorded = trained_tokenizer_sha256(read_manifest(run_dir / "checkpoints" / STEP))
    assert recorded is not None
    with pytest.raises(UserInputError) as exc:
        load_for_generation(run_dir, tokenizer_dir=other_tokenizer)
    _refused(exc, other_tokenizer, recorded)
    # The run's own, named or not, and a copy of it elsewhere: the identity is the content, not the place.
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(run_dir / "tokenizer" / TOKENIZER_FILE, copy / TOKENIZER_FILE)
    texts = set()
    for tokenizer_dir in (None, run_dir / "tokenizer", copy):
        model, tokenizer = load_for_generation(run_dir, tokenizer_dir=tokenizer_dir)
        texts.add(generate_text(model, tokenizer, "ROMEO:", max_new_tokens=8, seed=0))
    assert len(texts) == 1 and next(iter(texts)).startswith("ROMEO:"), texts


def test_export_carries_the_identity_and_serving_the_export_checks_it(
    run_dir: Path, other_tokenizer: Path, tmp_path: Path
) -> None:
    recorded = trained_tokenizer_sha256(read_manifest(run_dir / "checkpoints" / STEP))
    assert recorded is not None
    with pytest.raises(UserInputError) as exc:
        export_checkpoint(run_dir, tmp_path / "refused", tokenizer_dir=other_tokenizer)
    _refused(exc, other_tokenizer, recorded)
    assert not (tmp_path / "refused").exists()

    export_checkpoint(run_dir, tmp_path / "export")
    assert exported_tokenizer_sha256(tmp_path / "export") == recorded
    source = resolve_source(tmp_path / "export")
    with pytest.raises(UserInputError) as exc:
        load_served_model(source, tokenizer_dir=other_tokenizer)
    _refused(exc, other_tokenizer, recorded)
    served = load_served_model(source)  # the export's own tokenizer/
    assert tokenizer_sha256(served.tokenizer) == recorded
    assert (
        tokenizer_sha256(load_served_model(source, tokenizer_dir=run_dir / "tokenizer").tokenizer) == recorded
    )
    with pytest.raises(UserInputError) as exc:  # a checkpoint served directly: load_for_generation's check
        load_served_model(resolve_source(run_dir), tokenizer_dir=other_tokenizer)
    _refused(exc, other_tokenizer, recorded)


def test_a_checkpoint_without_the_record_loads_as_before(
    run_dir: Path, other_tokenizer: Path, tmp_path: Path
) -> None:
    """Checkpoints written before the record (no tokenizer_sha256 in the manifest) are not refused, and neither are
    their exports: nothing says which tokenizer they trained with."""
    old = tmp_path / "old"
    shutil.copytree(run_dir / "checkpoints" / STEP, old)
    manifest = json.loads((old / MANIFEST_NAME).read_text())
    del manifest[TOKENIZER_SHA256_KEY]
    (old / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    assert read_manifest(old) is not None and trained_tokenizer_sha256(read_manifest(old)) is None

    model, tokenizer = load_for_generation(old, tokenizer_dir=other_tokenizer)
    assert tokenizer.vocab_size == 12 and model.config.vocab_size >= 65
    export_checkpoint(old, tmp_path / "export", tokenizer_dir=other_tokenizer)
    assert exported_tokenizer_sha256(tmp_path / "export") is None
    served = load_served_model(resolve_source(tmp_path / "export"), tokenizer_dir=run_dir / "tokenizer")
    assert served.tokenizer.vocab_size == 65


@pytest.mark.parametrize("verb", ["generate", "ckpt export", "serve"])
def test_cli_refuses_another_tokenizer_with_one_line_and_exit_2(
    verb: str, run_dir: Path, other_tokenizer: Path, tmp_path: Path
) -> None:
    args = {
        "generate": ["generate", str(run_dir), "--max-new-tokens", "3"],
        "ckpt export": ["ckpt", "export", str(run_dir), "--out", str(tmp_path / "export")],
        "serve": ["serve", str(run_dir), "--port", "0"],
    }[verb]
    proc = subprocess.run([*GAUDI3, *args, "--tokenizer", str(other_tokenizer)], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    want = f"gaudi3: error: tokenizer {str(other_tokenizer)!r} {REFUSED} "
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and proc.stderr.count("\n") == 1 and proc.stderr.startswith(want), proc.stderr
    assert not (tmp_path / "export").exists()
