"""Format 2: pieces become shards, any worker count gives the same bytes, new files are appended, JSONL / Parquet."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.data import DataConfig, load_manifest, load_prepared, prepare_dataset, verify_prepared
from gaudi3_scale.data.manifest import FORMAT_VERSION
from gaudi3_scale.data.sources import bundled_corpora
from gaudi3_scale.data.tokenizers import ByteTokenizer

SHAKESPEARE = bundled_corpora()["tinyshakespeare"].read_text(encoding="utf-8")
SHARD_MB = 0.02  # ~21 KB of text per shard: several shards from tiny files


def prepare(source: Path, out: Path, workers: int = 1, **cfg: object) -> Path:
    fields: dict[str, object] = {"source": str(source), "shard_mb": SHARD_MB} | cfg
    return prepare_dataset(DataConfig(**fields), out, workers=workers, progress=False)  # type: ignore[arg-type]


def shard_stats(directory: Path) -> dict[str, tuple[int, int, bytes]]:
    return {
        p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(directory.glob("*-*.bin"))
    }


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.txt").write_text(SHAKESPEARE[:50_000])
    (root / "b.txt").write_text(SHAKESPEARE[50_000:60_000])
    return root


def test_layout_and_manifest(corpus: Path, tmp_path: Path) -> None:
    out = prepare(corpus, tmp_path / "out")
    manifest = load_manifest(out)
    assert manifest.format_version == FORMAT_VERSION == 2
    # a.txt (50 KB) -> 3 pieces of >= 20,971 bytes (the last one shorter), b.txt (10 KB) -> 1
    assert [s.shards for s in manifest.sources] == [[0, 1, 2], [3]]
    names = [f"{split}-{i:05d}.bin" for split in ("train", "val") for i in range(4)]
    assert [s.file for s in manifest.shards] == names
    assert sorted(p.name for p in out.glob("*.bin")) == sorted(names)
    assert manifest.split_rule == "per shard: last val_fraction of its tokens -> val, rest -> train"
    assert manifest.settings["shard_mb"] == SHARD_MB
    data = load_prepared(out)
    tokens = np.concatenate(
        [np.concatenate([t, v]) for t, v in zip(data.train_shards, data.val_shards, strict=True)]
    )
    assert data.tokenizer.decode(tokens.tolist()) == SHAKESPEARE[:60_000]
    for train, val in zip(data.train_shards, data.val_shards, strict=True):
        assert len(train) == int((len(train) + len(val)) * 0.9)
    assert manifest.num_tokens == {
        "train": sum(map(len, data.train_shards)),
        "val": sum(map(len, data.val_shards)),
    }


def test_worker_count_does_not_change_the_bytes(corpus: Path, tmp_path: Path) -> None:
    one = prepare(corpus, tmp_path / "w1", workers=1)
    two = prepare(corpus, tmp_path / "w2", workers=2)
    assert {n: b for n, (_, _, b) in shard_stats(one).items()} == {
        n: b for n, (_, _, b) in shard_stats(two).items()
    }
    assert load_manifest(one).shards == load_manifest(two).shards


def test_new_file_is_appended_without_touching_old_shards(
    corpus: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = prepare(corpus, tmp_path / "out")
    before = shard_stats(out)
    (corpus / "0-new.txt").write_text(SHAKESPEARE[10_000:40_000])  # sorts first, still appended last
    with caplog.at_level(logging.INFO, logger="gaudi3_scale.data.prepare"):
        prepare(corpus, out, workers=2)
    assert "appended 2 shard(s) for 1 new source file(s)" in caplog.text
    after = shard_stats(out)
    assert {name: after[name] for name in before} == before  # same inode, mtime and bytes
    assert sorted(set(after) - set(before)) == [f"{s}-{i:05d}.bin" for s in ("train", "val") for i in (4, 5)]
    manifest = verify_prepared(out)
    assert [(Path(s.path).name, s.shards) for s in manifest.sources][-1] == ("0-new.txt", [4, 5])
    appended = load_prepared(out)
    new_text = np.concatenate(
        [np.concatenate([appended.train_shards[i], appended.val_shards[i]]) for i in (4, 5)]
    )
    assert appended.tokenizer.decode(new_text.tolist()) == SHAKESPEARE[10_000:40_000]
    assert prepare(corpus, out) == out and shard_stats(out) == after  # and now it is current


def test_change_to_an_old_file_rebuilds(corpus: Path, tmp_path: Path) -> None:
    out = prepare(corpus, tmp_path / "out", tokenizer="byte")
    before = shard_stats(out)
    (corpus / "b.txt").write_text(SHAKESPEARE[70_000:80_000])  # same size, other content
    (corpus / "c.txt").write_text("new\n")
    prepare(corpus, out, tokenizer="byte")
    after = shard_stats(out)
    assert after["train-00000.bin"][0] != before["train-00000.bin"][0]  # renamed in from a new build
    assert [Path(s.path).name for s in load_manifest(out).sources] == ["a.txt", "b.txt", "c.txt"]
    (corpus / "a.txt").unlink()  # a removed file rebuilds too, and the shards it no longer needs go away
    prepare(corpus, out, tokenizer="byte")
    assert sorted(p.name for p in out.glob("*.bin")) == [
        f"{s}-{i:05d}.bin" for s in ("train", "val") for i in (0, 1)
    ]
    verify_prepared(out)


def test_new_characters_or_trained_tokenizer_rebuild(
    corpus: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = prepare(corpus, tmp_path / "out")
    inode = (out / "train-00000.bin").stat().st_ino
    (corpus / "c.txt").write_text("naïve ✓\n")
    with caplog.at_level(logging.INFO, logger="gaudi3_scale.data.prepare"):
        prepare(corpus, out)
    assert "outside the char vocabulary" in caplog.text
    assert (out / "train-00000.bin").stat().st_ino != inode
    assert load_prepared(out).vocab_size == len(set(SHAKESPEARE[:60_000]) | set("naïve ✓\n"))


def test_format_1_manifest_still_loads(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    src = tmp_path / "t.txt"
    src.write_text(SHAKESPEARE[:5_000])
    out = prepare(src, tmp_path / "out", shard_mb=64)
    raw = json.loads((out / "manifest.json").read_text())
    for shard in raw["shards"]:
        (out / shard["file"]).rename(out / f"{shard['split']}.bin")
        shard["file"] = f"{shard['split']}.bin"
    for entry in raw["sources"]:
        del entry["shards"]
    raw["format_version"] = raw["settings"]["format_version"] = 1
    (out / "manifest.json").write_text(json.dumps(raw))
    data = load_prepared(out)
    assert data.tokenizer.decode(np.concatenate([data.train, data.val]).tolist()) == SHAKESPEARE[:5_000]
    assert data.manifest.sources[0].shards == []
    raw["shards"][0]["file"] = "train-00000.bin"
    (out / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(
        UserInputError, match=r"format 1 has exactly train.bin and val.bin, got train-00000.bin"
    ):
        load_manifest(out)
    raw["shards"][0]["file"] = "train.bin"
    (out / "manifest.json").write_text(json.dumps(raw))
    with caplog.at_level(logging.WARNING, logger="gaudi3_scale.data.prepare"):
        prepare(
            src, out, shard_mb=64
        )  # an old format-1 dataset is rebuilt as format 2, its train.bin removed
    assert (
        f"rebuilding {out}: prepared in layout 1 by another gaudi3-scale version, this one reads layout 2"
        in (caplog.text)
    )  # said, not silent: an older version sharing the cache rebuilds it back
    assert sorted(p.name for p in out.glob("*.bin")) == ["train-00000.bin", "val-00000.bin"]
    assert load_manifest(out).format_version == 2


def test_format_2_shard_names_are_checked(corpus: Path, tmp_path: Path) -> None:
    out = prepare(corpus, tmp_path / "out")
    raw = json.loads((out / "manifest.json").read_text())
    raw["shards"][1]["file"] = "train-00000.bin"
    (out / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(UserInputError, match=r"shard file\(s\) train-00000.bin listed twice"):
        load_manifest(out)
    raw["shards"][1]["file"] = "val-00001.bin"
    (out / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(
        UserInputError, match=r"'val-00001.bin' of split 'train' is not named train-NNNNN.bin"
    ):
        load_manifest(out)


def test_missing_and_corrupt_shards_are_one_line(corpus: Path, tmp_path: Path) -> None:
    out = prepare(corpus, tmp_path / "out")
    shard = out / "val-00002.bin"
    data = bytearray(shard.read_bytes())
    data[0] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(
        UserInputError, match=r"^\S*val-00002.bin: SHA-256 mismatch with manifest.json [^\n]*$"
    ):
        verify_prepared(out)
    shard.unlink()
    with pytest.raises(
        UserInputError, match=r"^\S*val-00002.bin: missing \(listed in manifest.json\)[^\n]*$"
    ):
        verify_prepared(out, checksums=False)


def write_rows(path: Path, rows: list[object], *, row_group_size: int = 2) -> None:
    if path.suffix == ".parquet":
        pq.write_table(
            pa.table({"id": list(range(len(rows))), "text": rows}), path, row_group_size=row_group_size
        )
    else:
        path.write_text("".join(json.dumps({"id": i, "text": r}) + "\n" for i, r in enumerate(rows)))


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_table_sources_read_the_text_column(tmp_path: Path, suffix: str) -> None:
    rows = ["First row.\nline two", None, "é ✓ third", "fourth\n"]
    root = tmp_path / "mixed"
    root.mkdir()
    write_rows(root / f"rows{suffix}", rows)
    (root / "plain.txt").write_text("plain text\n")  # a directory may mix formats
    data = load_prepared(prepare(root, tmp_path / "out", tokenizer="byte", val_fraction=0.0, shard_mb=64))
    texts = [data.tokenizer.decode(t.tolist()) for t in data.train_shards]
    # sorted paths: plain.txt, rows.*; each non-null row is followed by a blank line
    assert texts == ["plain text\n", "".join(r + "\n\n" for r in rows if r is not None)]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_table_pieces_split_into_shards(tmp_path: Path, suffix: str) -> None:
    rows = [SHAKESPEARE[i : i + 3000] for i in range(0, 60_000, 3000)]
    write_rows(tmp_path / f"rows{suffix}", rows, row_group_size=4)
    out = prepare(tmp_path / f"rows{suffix}", tmp_path / "out", tokenizer="byte", workers=2)
    data = load_prepared(out)
    assert len(data.train_shards) >= 3
    tokens = np.concatenate(
        [np.concatenate([t, v]) for t, v in zip(data.train_shards, data.val_shards, strict=True)]
    )
    assert bytes(tokens.astype(np.uint8)) == "".join(r + "\n\n" for r in rows).encode()
    assert np.array_equal(ByteTokenizer().encode_array(rows[0] + "\n\n"), tokens[: len(rows[0]) + 2])


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_table_errors_are_one_line(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"rows{suffix}"
    write_rows(path, ["a", "b"])
    with pytest.raises(
        UserInputError,
        match=rf"^\S*rows{suffix}: no column 'body' \(data.text_field\); its columns: id, text$",
    ):
        prepare(path, tmp_path / "out", text_field="body")
    with pytest.raises(
        UserInputError, match=rf"^\S*rows{suffix}: (line 1|row 0): column 'id' holds int64, not a string"
    ):
        prepare(path, tmp_path / "out", text_field="id")
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_without_pyarrow_the_error_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_rows(tmp_path / "rows.parquet", ["a", "b"])
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # makes `import pyarrow.parquet` fail
    with pytest.raises(
        UserInputError, match=r"^JSONL / Parquet sources need pyarrow: pip install 'gaudi3-scale\[parquet\]'$"
    ):
        prepare(tmp_path / "rows.parquet", tmp_path / "out")


def test_cli_prepares_jsonl_into_shards_and_appends(tmp_path: Path) -> None:
    rows = [SHAKESPEARE[i : i + 4000] for i in range(0, 40_000, 4000)]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_rows(corpus / "a.jsonl", rows)
    cli = [sys.executable, "-m", "gaudi3_scale.cli", "prepare", str(corpus), "--out", str(tmp_path / "out")]
    cli += ["--tokenizer", "byte", "--shard-mb", "0.02", "--workers", "2"]
    done = subprocess.run(cli, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "out")
    first = load_manifest(tmp_path / "out")
    assert [s.shards for s in first.sources] == [[0, 1]]
    write_rows(corpus / "b.jsonl", rows[:2])
    assert subprocess.run(cli, capture_output=True, text=True).returncode == 0
    manifest = verify_prepared(tmp_path / "out")
    assert manifest.shards[:2] == first.shards_of("train") and [s.shards for s in manifest.sources] == [
        [0, 1],
        [2],
    ]
    bad = subprocess.run([*cli, "--text-field", "body"], capture_output=True, text=True)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "no column 'body' (data.text_field); its columns: id, text" in bad.stderr


def _prepare_cli(source: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cli = [sys.executable, "-m", "gaudi3_scale.cli", "prepare", str(source), "--out", str(out)]
    return subprocess.run([*cli, "--tokenizer", "byte", *extra], capture_output=True, text=True, timeout=120)


def _error_line(done: subprocess.CompletedProcess[str]) -> str:
    """The one error line of a refused `gaudi3 prepare`: exit 2, no traceback, the last line on stderr (a progress
    bar may stand before it when the line was found while tokenizing)."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert [n for n, text in enumerate(lines) if text.startswith("gaudi3: error:")] == [len(lines) - 1], lines
    return lines[-1]


def _nested(depth: int) -> str:
    return json.dumps({"text": "deep", "meta": "<>"}).replace('"<>"', "[" * depth + "]" * depth)


@pytest.mark.parametrize(
    ("depth", "line"),
    [
        (5_000, 1),  # the first record is parsed by json.loads: a RecursionError
        (200_000, 2),  # the rest by pyarrow: a segmentation fault
    ],
)
def test_jsonl_nested_too_deep_is_one_line_naming_file_and_line(
    tmp_path: Path, depth: int, line: int
) -> None:
    path = tmp_path / "deep.jsonl"
    good = json.dumps({"text": "a fine row"})
    path.write_text("\n".join([good] * (line - 1) + [_nested(depth), good]) + "\n")
    done = _prepare_cli(path, tmp_path / "out")
    assert _error_line(done) == (
        f"gaudi3: error: {path}: line {line}: JSON nested more than 512 levels deep; allowed: at most 512"
    )
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_jsonl_nesting_up_to_the_bound_is_read(tmp_path: Path) -> None:
    path = tmp_path / "nested.jsonl"
    # 1 level for the record, 511 inside it; brackets inside strings are text, not nesting
    rows = [_nested(511), json.dumps({"text": "[" * 600 + "{" * 600, "tags": [{"a": [1]}]})]
    path.write_text("\n".join(rows) + "\n")
    data = load_prepared(prepare(path, tmp_path / "out", tokenizer="byte", val_fraction=0.0))
    text = "".join(data.tokenizer.decode(t.tolist()) for t in data.train_shards)
    assert text == "deep\n\n" + "[" * 600 + "{" * 600 + "\n\n"
    (tmp_path / "deeper.jsonl").write_text(_nested(512) + "\n")
    with pytest.raises(UserInputError, match=r"deeper.jsonl: line 1: JSON nested more than 512 levels deep"):
        prepare(tmp_path / "deeper.jsonl", tmp_path / "out2", tokenizer="byte")


def test_bad_jsonl_lines_are_named_by_their_line_in_the_file(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    good = json.dumps({"text": "x" * 50})
    path.write_text(f'{good}\n{{"text": "b"\n')
    line = _error_line(_prepare_cli(path, tmp_path / "out"))
    assert line.startswith(f"gaudi3: error: {path}: line 2: not valid JSON lines: Missing a comma")
    assert "in row" not in line and "row 1" not in line
    # Past blank lines and in a later piece of the file (~20 KB pieces): still the file's own line number.
    lines = [good] * 1000
    lines[3] = ""
    lines[900] = json.dumps({"text": 7})  # the column changes type
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(UserInputError) as info:
        prepare(path, tmp_path / "out", tokenizer="byte")
    assert str(info.value) == (
        f"{path}: line 901: not valid JSON lines: Column(/text) changed from string to number"
    )
    path.write_text("\n\n{\"text\": 'single'}\n")  # the first record, checked before any worker starts
    with pytest.raises(UserInputError, match=r"rows.jsonl: line 3: not valid JSON lines: Expecting value"):
        prepare(path, tmp_path / "out", tokenizer="byte")


def test_a_dictionary_encoded_parquet_text_column_is_text(tmp_path: Path) -> None:
    """pandas writes a `category` column as dictionary<string>: the same text as a plain string column."""
    rows = [SHAKESPEARE[i : i + 300] for i in range(0, 6_000, 300)]
    pq.write_table(pa.table({"text": pa.array(rows).dictionary_encode()}), tmp_path / "dict.parquet")
    pq.write_table(pa.table({"text": rows}), tmp_path / "plain.parquet")
    dictionary = prepare(tmp_path / "dict.parquet", tmp_path / "out-dict", tokenizer="byte")
    plain = prepare(tmp_path / "plain.parquet", tmp_path / "out-plain", tokenizer="byte")
    assert shard_stats(dictionary).keys() == shard_stats(plain).keys()
    assert [s.sha256 for s in load_manifest(dictionary).shards] == [
        s.sha256 for s in load_manifest(plain).shards
    ]


def test_rows_without_text_are_refused_like_an_empty_text_file(tmp_path: Path) -> None:
    from gaudi3_scale.config.errors import ConfigError

    pq.write_table(pa.table({"text": pa.array([], type=pa.string())}), tmp_path / "empty.parquet")
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n{"text": null}\n')
    for name in ("empty.parquet", "blank.jsonl"):
        with pytest.raises(ConfigError) as info:
            prepare(tmp_path / name, tmp_path / f"out-{name}", tokenizer="byte")
        assert str(info.value).startswith(f"data.source: {str(tmp_path / name)!r} holds no text (0 tokens")
        assert not (tmp_path / f"out-{name}" / "manifest.json").exists()


# ---- `gaudi3 prepare` refusals, run as users run it: exit 2, one line, nothing saved is touched ----------------


def _run_prepare(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GAUDI3_CACHE": str(tmp_path / "cache")}
    cli = [sys.executable, "-m", "gaudi3_scale.cli", "prepare", *args]
    return subprocess.run(cli, capture_output=True, text=True, timeout=120, env=env)


def _snapshot(directory: Path) -> dict[str, str | None]:
    """Every path under `directory` (hidden ones too): a file's SHA-256, None for a directory."""
    return {
        p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        if p.is_file()
        else None
        for p in sorted(directory.rglob("*"))
    }


def _text(tmp_path: Path) -> Path:
    src = tmp_path / "t.txt"
    src.write_text(SHAKESPEARE[:3_000])
    return src


def test_cli_refuses_an_out_dir_holding_a_committed_checkpoint_and_leaves_it_committed(
    tmp_path: Path,
) -> None:
    from gaudi3_scale.checkpoint.manifest import verify_checkpoint, write_manifest

    step = tmp_path / "run" / "checkpoints" / "step-00000004"
    step.mkdir(parents=True)
    (step / "state.ckpt").write_bytes(bytes(range(256)) * 8)
    write_manifest(step, {"step": 4, "tokens_seen": 3072})
    assert verify_checkpoint(step) == []
    before = _snapshot(tmp_path / "run")
    line = _error_line(_prepare_cli(_text(tmp_path), step))
    assert line == (
        f"gaudi3: error: --out: {str(step)!r} is not a prepared dataset but holds a "
        "'gaudi3-checkpoint' manifest.json, which preparing would replace; pass a new directory (or one "
        "`gaudi3 prepare` wrote)"
    )
    assert _snapshot(tmp_path / "run") == before
    assert verify_checkpoint(step) == []


@pytest.mark.parametrize(
    ("manifest", "what"),
    [('{"name": "my-model", "files": []}\n', "a manifest.json that is not a dataset's"), ("not json", None)],
    ids=["other-json", "not-json"],
)
def test_cli_refuses_an_out_dir_holding_a_foreign_manifest(
    tmp_path: Path, manifest: str, what: str | None
) -> None:
    out = tmp_path / "model"
    out.mkdir()
    (out / "manifest.json").write_text(manifest)
    (out / "weights.bin").write_bytes(b"\x00\x01" * 100)
    before = _snapshot(out)
    line = _error_line(_prepare_cli(_text(tmp_path), out))
    assert line.startswith(f"gaudi3: error: --out: {str(out)!r} is not a prepared dataset but holds ")
    assert (what or "a manifest.json that is not a dataset's") in line
    assert _snapshot(out) == before


def test_cli_still_rebuilds_a_directory_it_prepared(tmp_path: Path) -> None:
    src, out = _text(tmp_path), tmp_path / "out"
    assert _prepare_cli(src, out).returncode == 0
    rebuilt = _prepare_cli(src, out, "--val-fraction", "0.2")
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert load_manifest(out).val_fraction == 0.2


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_cli_refuses_an_http_out_before_tokenizing(tmp_path: Path, scheme: str) -> None:
    url = f"{scheme}://127.0.0.1:1/data"  # nothing listens on port 1
    done = _run_prepare(tmp_path, str(_text(tmp_path)), "--tokenizer", "byte", "--out", url)
    assert _error_line(done) == (
        f"gaudi3: error: --out: cannot publish to {url}: {scheme}:// is read-only (datasets are read from it, not "
        "written); allowed: a local directory or a writable store such as s3://bucket/prefix, gs://bucket/prefix, "
        "az://container/prefix, file:///abs/path, memory://name"
    )
    assert "%" not in done.stderr  # no progress bar: refused before any tokenizing
    assert not (tmp_path / "cache" / "datasets").exists()


def test_cli_refuses_a_vocab_size_other_than_the_tokenizer_files(tmp_path: Path) -> None:
    (tmp_path / "tok").mkdir()
    tok = ByteTokenizer().save(tmp_path / "tok")
    src, out = _text(tmp_path), tmp_path / "out"
    before = _snapshot(tmp_path / "tok")
    done = _run_prepare(
        tmp_path, str(src), "--out", str(out), "--tokenizer", str(tok), "--vocab-size", "1000"
    )
    assert _error_line(done) == (
        f"gaudi3: error: --vocab-size: the tokenizer file {str(tok)!r} fixes the vocabulary at 256 ids, got 1000; "
        "leave vocab_size unset (no --vocab-size)"
    )
    assert not out.exists() and _snapshot(tmp_path / "tok") == before
    same = _run_prepare(tmp_path, str(src), "--out", str(out), "--tokenizer", str(tok), "--vocab-size", "256")
    assert same.returncode == 0, same.stderr
    assert load_manifest(out).vocab_size == 256


@pytest.mark.parametrize("source", ["bad.jsonl", "one.txt"])
@pytest.mark.parametrize("existing", [None, "empty", "with-notes"])
def test_cli_refused_prepare_leaves_no_directory_or_lock_it_made(
    tmp_path: Path, source: str, existing: str | None
) -> None:
    (tmp_path / "bad.jsonl").write_text("not json\n")  # found while tokenizing, after --out was taken
    (tmp_path / "one.txt").write_text("a" * 100)  # one token type: found when the manifest is made
    out = tmp_path / "new" / "out" if existing is None else tmp_path / "out"
    if existing is not None:
        out.mkdir()
    if existing == "with-notes":
        (out / "notes.txt").write_text("mine\n")
    before = _snapshot(tmp_path)
    _error_line(_run_prepare(tmp_path, str(tmp_path / source), "--out", str(out), "--tokenizer", "char"))
    assert _snapshot(tmp_path) == before  # `new/` and `new/out/` gone again; an existing one as it was


def test_a_named_directory_of_another_sources_tokens_is_refused_not_rebuilt(tmp_path: Path) -> None:
    """`gaudi3 train --data.prepared_dir D` with data.source left at its default, where D holds the prepared tokens
    of the user's own text (since moved away): one line naming both sources and `--data.source D`; before, D was
    rebuilt from the bundled corpus and trained on, exit 0, the user's tokens gone. The same for `prepare --out`."""
    own = _text(tmp_path)
    out = tmp_path / "prepared"
    assert _prepare_cli(own, out).returncode == 0
    own.unlink()  # the text is gone: the prepared tokens are all that is left of it
    before = _snapshot(out)
    train = subprocess.run(
        [sys.executable, "-m", "gaudi3_scale.cli", "train", "--data.prepared_dir", str(out), "--out",
         str(tmp_path / "run"), "--train.max_steps", "1", "--no-progress"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    line = _error_line(train)
    assert line.startswith(f"gaudi3: error: data.prepared_dir: {str(out)!r} holds the prepared tokens of ")
    assert f"not of 'tinyshakespeare'; train on them with --data.source {out}, or prepare" in line
    other = tmp_path / "other.txt"
    other.write_text(SHAKESPEARE[3_000:6_000])
    line = _error_line(_prepare_cli(other, out))
    assert line.startswith(f"gaudi3: error: --out: {str(out)!r} holds the prepared tokens of ")
    assert _snapshot(out) == before
