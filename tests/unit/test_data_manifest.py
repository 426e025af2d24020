"""Manifest schema and shard verification: every way a prepared directory can rot gives one clear line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.data import DataConfig, load_manifest, load_prepared, prepare_dataset, verify_prepared
from gaudi3_scale.data.manifest import FORMAT_NAME, FORMAT_VERSION, token_dtype


@pytest.fixture
def prepared(tmp_path: Path) -> Path:
    return prepare_dataset(DataConfig(), tmp_path / "ds", progress=False)


def rewrite_manifest(directory: Path, **changes: object) -> None:
    path = directory / "manifest.json"
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            del data[key]
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def expect_error(directory: Path, pattern: str, *, checksums: bool = True) -> str:
    with pytest.raises(UserInputError, match=pattern) as exc:
        verify_prepared(directory, checksums=checksums)
    assert "\n" not in str(exc.value)
    return str(exc.value)


def test_manifest_records_what_was_built(prepared: Path) -> None:
    manifest = load_manifest(prepared)
    assert (manifest.format, manifest.format_version) == (FORMAT_NAME, FORMAT_VERSION)
    assert (manifest.tokenizer_kind, manifest.vocab_size, manifest.dtype) == ("char", 65, "uint16")
    assert manifest.num_tokens == {"train": 1_003_854, "val": 111_540}
    assert [s.file for s in manifest.shards] == ["train-00000.bin", "val-00000.bin"]
    assert manifest.shard("val").size_bytes == 2 * 111_540
    assert manifest.sources[0].size_bytes == 1_115_394
    assert len(manifest.sources[0].sha256) == 64
    assert verify_prepared(prepared) == manifest


def test_flipped_byte_is_caught_by_checksum_only(prepared: Path) -> None:
    train = prepared / "train-00000.bin"
    data = bytearray(train.read_bytes())
    data[1000] ^= 0xFF
    train.write_bytes(bytes(data))
    verify_prepared(prepared, checksums=False)  # same size: the cheap check cannot see it
    message = expect_error(
        prepared, r"train-00000.bin: SHA-256 mismatch with manifest.json \(expected [0-9a-f]{12}…, got"
    )
    assert message.endswith("re-run `gaudi3 prepare --force`")
    assert len(load_prepared(prepared, verify_checksums=False).train) == 1_003_854
    with pytest.raises(UserInputError, match="SHA-256 mismatch"):
        load_prepared(prepared)


def test_truncated_and_missing_shards(prepared: Path) -> None:
    val = prepared / "val-00000.bin"
    val.write_bytes(val.read_bytes()[:-2])
    expect_error(
        prepared,
        r"val-00000.bin: size 223078 bytes disagrees with manifest.json \(expected 223080 = 111540 uint16",
        checksums=False,
    )
    val.unlink()
    expect_error(prepared, r"val-00000.bin: missing \(listed in manifest.json\)", checksums=False)


def test_missing_tokenizer(prepared: Path) -> None:
    (prepared / "tokenizer.json").unlink()
    expect_error(prepared, r"tokenizer.json: missing", checksums=False)


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        (
            {"format_version": FORMAT_VERSION + 1},
            f"format_version {FORMAT_VERSION + 1} is newer than this gaudi3-scale",
        ),
        ({"format_version": "1"}, "unknown format_version '1'"),
        ({"format": "nanogpt"}, "format 'nanogpt' is not"),
        ({"shards": None}, "missing key.s. shards"),
        ({"dtype": "float32"}, "dtype 'float32' is not one of uint16, uint32"),
        ({"shards": [{"split": "train"}]}, r"shards\[0\] must hold exactly split, file, num_tokens"),
        ({"vocab_size": "65"}, "key 'vocab_size' has the wrong type"),
        ({"vocab_size": 1}, "a vocabulary of 1 token type.s. leaves a language model nothing to predict"),
    ],
)
def test_bad_manifest(prepared: Path, changes: dict[str, object], pattern: str) -> None:
    rewrite_manifest(prepared, **changes)
    expect_error(prepared, pattern, checksums=False)


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        ({"num_tokens": "3776"}, r"shards\[0\]: num_tokens is '3776'; allowed: an integer >= 0"),
        ({"num_tokens": 3776.0}, r"num_tokens is 3776.0; allowed: an integer"),
        ({"num_tokens": True}, r"num_tokens is True; allowed: an integer"),
        ({"size_bytes": -1}, r"size_bytes is -1; allowed: an integer >= 0"),
        ({"size_bytes": "7552"}, r"size_bytes is '7552'"),
        ({"sha256": 12345}, r"sha256 is 12345; allowed: a string"),
        (
            {"sha256": "../../../escape/" + "0" * 48},
            r"sha256 '\.\./\.\./\.\./escape/0+' is not 64 lowercase hex",
        ),
        ({"sha256": "A" * 64}, r"is not 64 lowercase hex digits"),
        ({"file": 7}, r"file is 7; allowed: a string"),
        ({"file": "../train-00000.bin"}, r"file '\.\./train-00000\.bin' is not a plain file name"),
        ({"split": ["train"]}, r"split is \['train'\]; allowed: a string"),
        ({"extra": 1}, r"must hold exactly split, file, num_tokens, size_bytes, sha256, got \["),
        ("half", r"shards\[0\]: size_bytes \d+ disagrees with num_tokens \d+ × 2 bytes per token"),
        ("uint32", r"shards\[0\]: size_bytes \d+ disagrees with num_tokens \d+ × 4 bytes per token"),
    ],
)
def test_a_bad_shard_entry_is_one_line_naming_it(prepared: Path, change: object, pattern: str) -> None:
    """Types, the SHA-256 (it names cache files: a path in it wrote outside the cache) and size_bytes = num_tokens ×
    the dtype's bytes are checked where the manifest is parsed, for local and URL datasets alike."""
    path = prepared / "manifest.json"
    data = json.loads(path.read_text())
    shard = data["shards"][0]
    if change == "half":
        shard["num_tokens"] //= 2
    elif change == "uint32":
        data["dtype"] = "uint32"
    else:
        assert isinstance(change, dict)
        shard.update(change)
    path.write_text(json.dumps(data))
    with pytest.raises(UserInputError, match=pattern) as exc:
        load_manifest(prepared)
    assert "\n" not in str(exc.value) and str(exc.value).startswith(str(path))


def test_tokenizer_file_and_objects_dir_must_be_plain_names(prepared: Path) -> None:
    rewrite_manifest(prepared, tokenizer_file="../tokenizer.json")
    expect_error(prepared, r"tokenizer_file '\.\./tokenizer\.json' is not a plain file name")
    rewrite_manifest(
        prepared, tokenizer_file="tokenizer.json", objects_dir="../up", tokenizer_sha256="0" * 64
    )
    expect_error(prepared, r"objects_dir '\.\./up' is not a plain directory name")
    rewrite_manifest(prepared, objects_dir="objects", tokenizer_sha256="xyz")
    expect_error(prepared, r"tokenizer_sha256 'xyz' is not 64 lowercase hex digits")


def test_a_local_manifest_has_no_published_layout_keys(prepared: Path) -> None:
    data = json.loads((prepared / "manifest.json").read_text())
    assert "objects_dir" not in data and "tokenizer_sha256" not in data


def test_malformed_json_and_absent_manifest(prepared: Path, tmp_path: Path) -> None:
    (prepared / "manifest.json").write_text('{"format": ')
    expect_error(prepared, r"manifest.json': not valid JSON at line 1")
    (prepared / "manifest.json").write_text('{"format": ' + "[" * 100_000 + "]" * 100_000 + "}")
    expect_error(prepared, r"manifest.json': nested deeper than 64 levels; .*gaudi3 prepare")
    (prepared / "manifest.json").write_bytes(b'{"format": "caf\xe9"}')
    expect_error(prepared, r"manifest.json' is not UTF-8 text: byte 0xe9 at offset 15")
    expect_error(tmp_path, r"not a prepared dataset \(no manifest.json\); run `gaudi3 prepare` first")


def test_load_prepared_gives_read_only_memmaps(prepared: Path) -> None:
    data = load_prepared(prepared)
    assert isinstance(data.train, np.memmap) and data.train.dtype == np.dtype("<u2")
    assert data.vocab_size == 65
    assert data.tokenizer.decode(data.train[:14].tolist()) == "First Citizen:"
    with pytest.raises(ValueError, match="read-only"):
        data.train[0] = 1


def test_token_dtype_boundary() -> None:
    assert token_dtype(65) == "uint16"
    assert token_dtype(65_536) == "uint16"  # ids 0..65535
    assert token_dtype(65_537) == "uint32"


def test_a_manifest_over_a_config_files_size_is_read(prepared: Path) -> None:
    """A corpus of thousands of shards writes a manifest of megabytes (~300 bytes a shard): the 1 MiB cap of a
    config file refused what `prepare` had just written, and `--force` rebuilt the same."""
    path = prepared / "manifest.json"
    path.write_text(path.read_text() + " " * (2 << 20))  # whitespace: the same JSON, 2 MiB larger
    assert load_manifest(prepared).shards


def test_a_tokenizer_with_more_ids_than_the_manifests_vocabulary_is_refused(prepared: Path) -> None:
    """Its ids would index past the model's embedding rows: an IndexError mid-training, after the run wrote its
    files. Refused when the dataset is opened, with the fix."""
    from gaudi3_scale.data.inputs import training_data_from_dir

    path = prepared / "manifest.json"
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps({**manifest, "vocab_size": manifest["vocab_size"] - 10}))
    with pytest.raises(
        UserInputError, match=r"its tokenizer has 65 ids but the manifest's vocab_size is 55; re-run"
    ):
        training_data_from_dir(prepared)
