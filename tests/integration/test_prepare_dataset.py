"""prepare_dataset end to end on real files: nanoGPT's split, no-op re-runs, workers, documents, failures."""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.data import DataConfig, load_manifest, load_prepared, prepare_dataset, verify_prepared
from gaudi3_scale.data.sources import bundled_corpora
from gaudi3_scale.data.tokenizers import CharTokenizer

SHAKESPEARE = bundled_corpora()["tinyshakespeare"].read_text(encoding="utf-8")


def prepare(tmp_path: Path, name: str = "out", **cfg: object) -> Path:
    return prepare_dataset(DataConfig(**cfg), tmp_path / name, progress=False)  # type: ignore[arg-type]


def shard_inode(directory: Path) -> int:
    return (directory / "train-00000.bin").stat().st_ino  # a rebuild renames a new file into place


def test_tinyshakespeare_char_matches_nanogpt(tmp_path: Path) -> None:
    data = load_prepared(prepare(tmp_path))
    # nanoGPT data/shakespeare_char/prepare.py: "train has 1,003,854 tokens", "val has 111,540 tokens"
    assert (len(data.train), len(data.val), data.vocab_size) == (1_003_854, 111_540, 65)
    expected = CharTokenizer(SHAKESPEARE).encode_array(SHAKESPEARE)
    n = int(len(SHAKESPEARE) * 0.9)
    assert np.array_equal(data.train, expected[:n]) and np.array_equal(data.val, expected[n:])


def test_default_directory_in_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GAUDI3_CACHE", str(tmp_path))
    out = prepare_dataset(DataConfig(tokenizer="byte"), progress=False)
    assert out.parent == tmp_path / "datasets"
    assert out.name.startswith("tinyshakespeare-byte-") and len(out.name.split("-")[-1]) == 10
    assert prepare_dataset(DataConfig(tokenizer="byte", split_seed=1), progress=False) != out
    assert prepare_dataset(DataConfig(tokenizer="byte"), progress=False) == out


def test_rerun_is_a_no_op_until_content_changes(tmp_path: Path) -> None:
    src = tmp_path / "corpus.txt"
    src.write_text(SHAKESPEARE[:50_000])
    out = prepare(tmp_path, source=str(src))
    inode, manifest_before = shard_inode(out), load_manifest(out)
    assert prepare(tmp_path, source=str(src)) == out
    assert shard_inode(out) == inode

    os.utime(src, ns=(1, 1))  # same content, new mtime: rehash, no rebuild, fingerprint refreshed
    prepare(tmp_path, source=str(src))
    assert shard_inode(out) == inode
    assert load_manifest(out).fingerprint != manifest_before.fingerprint

    src.write_text(SHAKESPEARE[:60_000])
    prepare(tmp_path, source=str(src))
    assert shard_inode(out) != inode
    assert sum(load_manifest(out).num_tokens.values()) == 60_000

    inode = shard_inode(out)
    prepare_dataset(DataConfig(source=str(src)), tmp_path / "out", progress=False, force=True)
    assert shard_inode(out) != inode


def test_changed_settings_rebuild(tmp_path: Path) -> None:
    out = prepare(tmp_path)
    inode = shard_inode(out)
    prepare(tmp_path, val_fraction=0.2)
    assert shard_inode(out) != inode
    assert load_manifest(out).num_tokens["val"] == 1_115_394 - int(1_115_394 * 0.8)


def test_two_workers_give_identical_shards(tmp_path: Path) -> None:
    src = tmp_path / "big.txt"
    src.write_text(SHAKESPEARE * 4)  # 4.5 MB: three 2 MiB chunks
    one = load_manifest(prepare(tmp_path, "w1", source=str(src), prepare_workers=1))
    # progress=True also drives the rich bar (on stderr) through both passes
    two = load_manifest(
        prepare_dataset(DataConfig(source=str(src)), tmp_path / "w2", workers=2, progress=True)
    )
    assert [s.sha256 for s in one.shards] == [s.sha256 for s in two.shards]
    assert one.num_tokens["train"] == int(len(SHAKESPEARE) * 4 * 0.9)
    # one piece of three chunks: the cut falls inside the last chunk, train streamed out before it was known
    data = load_prepared(tmp_path / "w2")
    expected = CharTokenizer(SHAKESPEARE).encode_array(SHAKESPEARE * 4)
    cut = int(len(expected) * 0.9)
    assert np.array_equal(data.train, expected[:cut]) and np.array_equal(data.val, expected[cut:])


def write_documents(root: Path) -> dict[str, str]:
    docs = {"a.txt": SHAKESPEARE[:3000], "b.md": SHAKESPEARE[3000:5000], "sub/c.txt": SHAKESPEARE[5000:9000]}
    for name, text in docs.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return docs


def test_each_file_is_a_shard_split_at_its_last_val_fraction(tmp_path: Path) -> None:
    docs = write_documents(tmp_path / "docs")
    data = load_prepared(prepare(tmp_path, source=str(tmp_path / "docs")))
    tok = CharTokenizer("".join(docs.values()))
    assert data.tokenizer.to_json() == tok.to_json()
    encoded = [tok.encode_array(text) for text in docs.values()]  # sorted path order: a.txt, b.md, sub/c.txt
    cut = [int(len(e) * 0.9) for e in encoded]
    assert [s.file for s in data.manifest.shards_of("val")] == [
        "val-00000.bin",
        "val-00001.bin",
        "val-00002.bin",
    ]
    for i, (e, c) in enumerate(zip(encoded, cut, strict=True)):
        assert np.array_equal(data.train_shards[i], e[:c]) and np.array_equal(data.val_shards[i], e[c:])
    assert data.manifest.num_tokens == {"train": sum(cut), "val": sum(len(e) for e in encoded) - sum(cut)}
    assert [s.path.split("/")[-1] for s in data.manifest.sources] == ["a.txt", "b.md", "c.txt"]
    assert [s.shards for s in data.manifest.sources] == [[0], [1], [2]]
    with pytest.raises(
        UserInputError, match=r"the train split has 3 shards .* use PreparedData.train_shards"
    ):
        _ = data.train


def test_glob_source_and_prepared_dir_source(tmp_path: Path) -> None:
    write_documents(tmp_path / "docs")
    out = prepare(tmp_path, source=str(tmp_path / "docs" / "*.txt"))
    assert [Path(s.path).name for s in load_manifest(out).sources] == ["a.txt"]
    inode = shard_inode(out)
    # a prepared directory as the source is returned as it is
    assert prepare_dataset(DataConfig(source=str(out)), progress=False) == out
    assert shard_inode(out) == inode


def test_prepared_dir_without_its_manifest_is_refused_not_read_as_text(tmp_path: Path) -> None:
    src = tmp_path / "t.txt"
    src.write_text(SHAKESPEARE[:5_000])
    out = prepare(tmp_path, source=str(src))
    (out / "manifest.json").unlink()  # tokenizer.json is text: it was trained on as if it were the corpus
    with pytest.raises(
        UserInputError, match=r"^source: .* looks like a prepared dataset \(train-00000.bin, val-00000.bin, "
    ):
        prepare_dataset(DataConfig(source=str(out)), progress=False)
    assert sorted(p.name for p in out.iterdir()) == [
        ".prepare.lock",
        "tokenizer.json",
        "train-00000.bin",
        "val-00000.bin",
    ]


def _tree(directory: Path) -> dict[str, str | None]:
    """Every path under `directory`: a file's text, None for a directory."""
    return {
        p.relative_to(directory).as_posix(): p.read_text() if p.is_file() else None
        for p in directory.rglob("*")
    }


def test_a_users_directory_holding_a_partial_folder_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    """`.partial` is the build's scratch directory, emptied before and after a build: in a directory prepare never
    built it is the user's own (it was deleted without a word)."""
    src = tmp_path / "t.txt"
    src.write_text(SHAKESPEARE[:5_000])
    user = tmp_path / "out"
    (user / ".partial").mkdir(parents=True)
    (user / ".partial" / "important.txt").write_text("my notes\n")
    (user / "notes.txt").write_text("more notes\n")
    before = _tree(user)
    with pytest.raises(UserInputError) as refused:
        prepare(tmp_path, source=str(src))
    assert str(refused.value) == (
        f"data.prepared_dir: {str(user)!r} is not a prepared dataset but holds .partial, which preparing would "
        "replace or delete; pass a new directory"
    )
    assert _tree(user) == before


@pytest.mark.parametrize("built", [False, True], ids=["first-build-killed", "rebuild-killed"])
def test_a_partial_folder_a_killed_build_left_is_cleaned_by_the_next(tmp_path: Path, built: bool) -> None:
    src = tmp_path / "t.txt"
    src.write_text(SHAKESPEARE[:5_000])
    out = tmp_path / "out"
    if built:
        prepare(tmp_path, source=str(src))
        src.write_text(SHAKESPEARE[:6_000])  # the next run rebuilds
    else:
        out.mkdir()
        (out / ".prepare.lock").touch()  # taken before `.partial` is made; a killed first build leaves both
    (out / ".partial").mkdir()
    (out / ".partial" / "train-00000.bin").write_bytes(b"half a shard")
    data = load_prepared(prepare(tmp_path, source=str(src)))
    assert (
        data.tokenizer.decode([*data.train.tolist(), *data.val.tolist()])
        == SHAKESPEARE[: 6_000 if built else 5_000]
    )
    assert sorted(p.name for p in out.iterdir()) == [
        ".prepare.lock",
        "manifest.json",
        "tokenizer.json",
        "train-00000.bin",
        "val-00000.bin",
    ]


def test_one_repeated_character_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    src = tmp_path / "a.txt"
    src.write_text("a" * 1000)
    with pytest.raises(
        UserInputError, match=r"^data.source: '.*a.txt': a vocabulary of 1 token type\(s\) leaves"
    ):
        prepare(tmp_path, source=str(src))
    assert not (tmp_path / "out").exists()  # nor the lock file: the directory was made by this call


def test_bpe_dataset_decodes_back_to_the_text(tmp_path: Path) -> None:
    src = tmp_path / "t.txt"
    src.write_text(SHAKESPEARE[:100_000] + "\nunicode: é ✓ 😀\n")
    data = load_prepared(
        prepare(tmp_path, source=str(src), tokenizer="bpe", vocab_size=300, val_fraction=0.0)
    )
    assert data.manifest.tokenizer_kind == "bpe" and data.vocab_size == 300 and len(data.val) == 0
    assert data.tokenizer.decode(data.train.tolist()) == src.read_text()
    # The saved tokenizer.json is itself a valid `tokenizer` setting and reproduces the tokens.
    saved_tokenizer = str(data.directory / "tokenizer.json")
    again = load_prepared(
        prepare(tmp_path, "again", source=str(src), tokenizer=saved_tokenizer, val_fraction=0.0)
    )
    assert np.array_equal(again.train, data.train)


def test_large_vocabulary_is_stored_as_uint32(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(69_999)} | {"the": 69_999, "[UNK]": 70_000}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.save(str(tmp_path / "wl.json"))
    (tmp_path / "t.txt").write_text("the w3 cat the\n" * 10)
    data = load_prepared(
        prepare(tmp_path, source=str(tmp_path / "t.txt"), tokenizer=str(tmp_path / "wl.json"))
    )
    assert data.manifest.dtype == "uint32" and data.train.dtype == np.dtype("<u4")
    assert data.train[:4].tolist() == [69_999, 3, 70_000, 69_999]


def test_failed_rebuild_keeps_the_previous_dataset_intact(tmp_path: Path) -> None:
    src = tmp_path / "t.txt"
    src.write_text(SHAKESPEARE[:20_000])
    out = prepare(tmp_path, source=str(src))
    before = load_manifest(out)
    src.write_bytes(SHAKESPEARE[:30_000].encode() + b"\xff\n")
    with pytest.raises(UserInputError, match=r"t.txt: not UTF-8 text \(invalid byte at offset 30000\)"):
        prepare(tmp_path, source=str(src))
    # the old shards still match the old manifest (nothing half-written), and no scratch files are left
    assert verify_prepared(out) == before
    assert sorted(p.name for p in out.iterdir()) == [
        ".prepare.lock",
        "manifest.json",
        "tokenizer.json",
        "train-00000.bin",
        "val-00000.bin",
    ]
    with pytest.raises(UserInputError, match="not UTF-8"):  # still stale: the next run tries again
        prepare(tmp_path, source=str(src))


def test_bad_tokenizer_setting_fails_before_touching_anything(tmp_path: Path) -> None:
    with pytest.raises(UserInputError, match=r"nor an existing tokenizer\.json"):
        prepare(tmp_path, tokenizer="missing/tokenizer.json")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("source", "pattern"),
    [
        ("no/such/file.txt", r"source: 'no/such/file.txt' is not a bundled corpus"),
        (
            "hf:foo",
            r"^hf:foo: the Hugging Face dataset could not be loaded \(.*\); pass local text files instead$",
        ),
    ],
)
def test_unusable_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, pattern: str) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # if `datasets` is installed, it must not try the network
    monkeypatch.setenv("GAUDI3_CACHE", str(tmp_path))
    with pytest.raises(UserInputError, match=pattern):
        prepare(tmp_path, source=source)


def test_hf_without_datasets_says_so(tmp_path: Path) -> None:
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(UserInputError, match=r"`datasets` is not installed: pip install datasets"):
            prepare(tmp_path, source="hf:foo")
    else:
        pytest.skip("`datasets` is installed here")


def test_hf_unreachable_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # No network here: a stand-in `datasets` fails the way load_dataset does offline.
    def load_dataset(name: str, split: str) -> None:
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    with pytest.raises(
        UserInputError, match=r"^hf:org/corpus: .* \(no network or unknown dataset: ConnectionError\)"
    ):
        prepare(tmp_path, source="hf:org/corpus")


def test_manifest_is_json_with_versions(tmp_path: Path) -> None:
    raw = json.loads((prepare(tmp_path) / "manifest.json").read_text())
    assert list(raw)[:2] == ["format", "format_version"]
    assert raw["library_version"] == "0.1.0"
    assert raw["settings"]["split_seed"] == 0 and raw["val_fraction"] == 0.1
