"""``data.source: synthetic[:VOCAB]``: parsing, the generated shards, caching, and a real `gaudi3 train` on them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gaudi3_scale.config.core import from_dict
from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.data import FORMAT_VERSION, DataConfig, load_prepared, prepare_dataset
from gaudi3_scale.data import synthetic as synthetic_module
from gaudi3_scale.data.sources import synthetic_vocab
from gaudi3_scale.data.tokenizers import SyntheticTokenizer, load_tokenizer


def _data(**fields: Any) -> DataConfig:
    """A DataConfig built the way YAML and CLI overrides build it, so errors carry the dotted name."""
    return from_dict(DataConfig, fields, prefix="data")


def _prepare(**fields: Any) -> Path:
    return prepare_dataset(_data(**fields), progress=False)


# ---- the source spelling ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "vocab"), [("synthetic", 50257), ("synthetic:1000", 1000), ("synthetic:2", 2)]
)
def test_synthetic_source_names_its_vocabulary(source: str, vocab: int) -> None:
    assert synthetic_vocab(source) == vocab
    assert _data(source=source).source == source


@pytest.mark.parametrize(
    "source", ["tinyshakespeare", "Synthetic", "synthetic.txt", "hf:synthetic", "x,synthetic"]
)
def test_other_sources_are_not_synthetic(source: str) -> None:
    assert synthetic_vocab(source) is None


@pytest.mark.parametrize(
    "source",
    [
        "synthetic:0",
        "synthetic:1",  # one token type: nothing to predict
        "synthetic:abc",
        "synthetic:",
        "synthetic:-5",
        "synthetic:1e3",
        "synthetic: 7",
        "synthetic:4294967297",
    ],
)
def test_malformed_synthetic_source_is_one_line_naming_data_source(source: str) -> None:
    with pytest.raises(
        ConfigError, match=r"^data\.source: .*synthetic:VOCAB with VOCAB an integer from 2 to"
    ) as info:
        _data(source=source)
    assert "\n" not in str(info.value)


def test_synthetic_settings_are_validated() -> None:
    with pytest.raises(ConfigError, match=r"^data\.synthetic_tokens: must be > 0, got 0$"):
        _data(source="synthetic", synthetic_tokens=0)
    with pytest.raises(ConfigError, match=r"^data\.vocab_size: .* has 512 ids; .* synthetic:1000$"):
        _data(source="synthetic:512", vocab_size=1000)
    assert _data(source="synthetic:512", vocab_size=512).vocab_size == 512  # agreeing is fine
    with pytest.raises(ConfigError, match=r"^data\.split_seed: must be an integer from 0 to 4,294,967,295"):
        _data(source="synthetic", split_seed=-1)


def test_synthetic_cannot_be_combined_with_text_sources() -> None:
    with pytest.raises(ConfigError, match=r"^source: 'synthetic': synthetic data has no files"):
        _prepare(source="tinyshakespeare,synthetic")


# ---- the prepared dataset -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("vocab", "dtype"),
    [(1000, "uint16"), (65535, "uint16"), (65536, "uint16"), (65537, "uint32"), (1 << 20, "uint32")],
)
def test_shards_hold_ids_below_vocab_in_the_narrowest_dtype(vocab: int, dtype: str) -> None:
    prepared = load_prepared(_prepare(source=f"synthetic:{vocab}", synthetic_tokens=9000))
    manifest = prepared.manifest
    assert (manifest.dtype, prepared.train.dtype, prepared.val.dtype) == (
        dtype,
        np.dtype(dtype),
        np.dtype(dtype),
    )
    # val is val_fraction of the total, as for text: 1000 / (9000 + 1000) = 0.1
    assert (len(prepared.train), len(prepared.val)) == (9000, 1000)
    assert manifest.num_tokens == {"train": 9000, "val": 1000}
    ids = np.concatenate([prepared.train, prepared.val]).astype(np.int64)
    assert ids.min() >= 0 and ids.max() < vocab
    assert ids.max() > 0.99 * vocab  # the top of the range is reached: ids are not capped by the dtype
    assert (manifest.format_version, manifest.tokenizer_kind, manifest.vocab_size) == (
        FORMAT_VERSION,
        "synthetic",
        vocab,
    )
    assert manifest.sources == [] and manifest.split_seed == 0 and manifest.settings["split_seed"] == 0


def test_ids_are_uniform() -> None:
    train = load_prepared(_prepare(source="synthetic:16", synthetic_tokens=160_000)).train
    counts = np.bincount(train, minlength=16)
    # Chi-square with 15 degrees of freedom: 37.7 is its 0.999 quantile.
    chi2 = float(((counts - 10_000) ** 2 / 10_000).sum())
    assert len(counts) == 16 and chi2 < 37.7


def test_prepare_is_deterministic_and_reuses_the_cache(tmp_path: Path) -> None:
    fields = {"source": "synthetic:512", "synthetic_tokens": 5000}
    first = _prepare(**fields)
    assert first.parent.name == "datasets" and first.name.startswith("synthetic-512-")
    files = ("train-00000.bin", "val-00000.bin", "manifest.json", "tokenizer.json")
    content = {name: (first / name).read_bytes() for name in ("train-00000.bin", "val-00000.bin")}
    mtimes = {name: (first / name).stat().st_mtime_ns for name in files}

    assert _prepare(**fields) == first
    assert {name: (first / name).stat().st_mtime_ns for name in files} == mtimes  # not rewritten

    elsewhere = prepare_dataset(_data(**fields), tmp_path / "copy", progress=False)
    assert {name: (elsewhere / name).read_bytes() for name in content} == content
    prepare_dataset(_data(**fields), progress=False, force=True)
    assert {name: (first / name).read_bytes() for name in content} == content


def test_vocab_size_and_seed_select_other_cache_entries() -> None:
    base = load_prepared(_prepare(source="synthetic:512", synthetic_tokens=5000))
    bigger = load_prepared(_prepare(source="synthetic:512", synthetic_tokens=8000))
    other_seed = load_prepared(_prepare(source="synthetic:512", synthetic_tokens=5000, split_seed=1))
    other_vocab = load_prepared(_prepare(source="synthetic:513", synthetic_tokens=5000))
    directories = {d.directory for d in (base, bigger, other_seed, other_vocab)}
    assert len(directories) == 4
    assert np.array_equal(bigger.train[:5000], base.train)  # a larger dataset starts with the smaller one
    assert not np.array_equal(other_seed.train, base.train)
    assert np.array_equal(np.asarray(base.val), np.asarray(bigger.val[: len(base.val)]))


def test_ids_are_drawn_block_by_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(synthetic_module, "BLOCK_TOKENS", 1000)
    prepared = load_prepared(
        _prepare(source="synthetic:50000", synthetic_tokens=2500, prepared_dir=str(tmp_path))
    )
    train = np.asarray(prepared.train)
    expected = np.concatenate(
        [
            np.random.default_rng([0, 0, b]).integers(0, 50000, size=n, dtype=np.uint16)
            for b, n in enumerate((1000, 1000, 500))
        ]
    )
    assert np.array_equal(train, expected)
    assert prepared.manifest.settings["block_tokens"] == 1000


def test_empty_validation_split() -> None:
    prepared = load_prepared(_prepare(source="synthetic:64", synthetic_tokens=1000, val_fraction=0.0))
    assert (len(prepared.train), len(prepared.val)) == (1000, 0)


# ---- the tokenizer ------------------------------------------------------------------------------------------


def test_load_prepared_reports_the_vocabulary_and_a_trivial_tokenizer() -> None:
    prepared = load_prepared(_prepare(source="synthetic:512", synthetic_tokens=2000))
    assert prepared.vocab_size == 512
    tok = prepared.tokenizer
    assert isinstance(tok, SyntheticTokenizer) and tok.vocab_size == 512
    assert isinstance(load_tokenizer(prepared.directory), SyntheticTokenizer)
    assert tok.decode([0, 17, 511]) == "<0><17><511>"
    assert tok.encode("<0><17><511>") == [0, 17, 511]
    assert tok.encode("\n") == [10]  # what an empty prompt starts from
    assert tok.encode("<5>a\u4e00") == [5, ord("a"), 0x4E00 % 512]
    with pytest.raises(UserInputError, match=r"<512> is not an id of its vocabulary \[0, 512\)"):
        tok.encode("<512>")


# ---- end to end ---------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_gaudi3_train_runs_on_synthetic_data(tmp_path: Path) -> None:
    cache, out = tmp_path / "cache", tmp_path / "run"
    args = ["train", "--data.source", "synthetic:512", "--model.name", "shakespeare-char", "--train.max_steps", "3",
            "--train.val_every_steps", "0", "--train.val_batches", "1", "--no-progress", "--sample-tokens", "8",
            "--out", str(out)]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "gaudi3_scale.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "GAUDI3_CACHE": str(cache)},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["steps"] == 3
    assert [p.name.startswith("synthetic-512-") for p in (cache / "datasets").iterdir()] == [True]
    # The newline an empty prompt starts from, then 8 sampled ids, all below the vocabulary.
    sample = proc.stdout.split("---- sample ----\n", 1)[1].strip()
    ids = [int(i) for i in re.findall(r"<(\d+)>", sample)]
    assert re.fullmatch(r"(<\d+>)+", sample) and len(ids) == 9 and ids[0] == 10 and max(ids) < 512
