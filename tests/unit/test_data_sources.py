"""Source resolution and chunking: which files, in which order, cut where."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.data.sources import bundled_corpora, read_chunk, resolve_source, split_into_chunks


def test_bundled_corpus_resolves_by_name() -> None:
    source = resolve_source("tinyshakespeare")
    assert source.key == "bundled:tinyshakespeare"
    assert source.name == "tinyshakespeare"
    assert [f.path for f in source.files] == [bundled_corpora()["tinyshakespeare"].resolve()]
    assert source.files[0].size_bytes == 1_115_394


def test_directory_is_recursive_sorted_and_skips_hidden_and_binary(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("b")
    (tmp_path / "a.md").write_text("a")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.rst").write_text("c")
    (tmp_path / "notes").write_text("no suffix, still text")
    (tmp_path / ".hidden.txt").write_text("x")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("ref")
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "prepared").mkdir()  # a prepared dataset inside the corpus is not text to train on
    (tmp_path / "prepared" / "manifest.json").write_text("{}")
    (tmp_path / "prepared" / "tokenizer.json").write_text("{}")
    names = [f.path.relative_to(tmp_path.resolve()).as_posix() for f in resolve_source(str(tmp_path)).files]
    assert names == ["a.md", "b.txt", "notes", "sub/c.rst"]


def test_comma_separated_sources_keep_the_given_order(tmp_path: Path) -> None:
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text(name)
    spec = f"{tmp_path / 'b.txt'},tinyshakespeare, {tmp_path / '*.txt'}"
    source = resolve_source(spec)
    assert [f.path.name for f in source.files] == ["b.txt", "tinyshakespeare.txt", "a.txt"]  # each file once
    assert source.key.split(",")[1] == "bundled:tinyshakespeare"
    assert source.name.startswith("b_tinyshakespeare_")  # the cache directory label
    with pytest.raises(UserInputError, match="'nope' is not a bundled corpus"):
        resolve_source(f"{tmp_path / 'a.txt'},nope")


def test_glob_and_errors(tmp_path: Path) -> None:
    for name in ("x1.txt", "x2.txt", "y.txt"):
        (tmp_path / name).write_text(name)
    files = resolve_source(str(tmp_path / "x*.txt")).files
    assert [f.path.name for f in files] == ["x1.txt", "x2.txt"]
    with pytest.raises(UserInputError, match=r"source: glob .* matches no files"):
        resolve_source(str(tmp_path / "z*.txt"))
    with pytest.raises(
        UserInputError, match=r"source: 'nope' is not a bundled corpus \(tinyshakespeare\), an existing"
    ):
        resolve_source("nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserInputError, match="holds no text files"):
        resolve_source(str(tmp_path / "empty"))
    (tmp_path / "zero.txt").write_text("")
    with pytest.raises(UserInputError, match=r"is empty \(0 bytes of text\)"):
        resolve_source(str(tmp_path / "zero.txt"))


@settings(max_examples=50, deadline=None)
@given(
    # no NUL: it is not text (read_chunk refuses it, as binary or UTF-16 data)
    lines=st.lists(
        st.text(alphabet=st.characters(exclude_characters="\n\0", exclude_categories=["Cs"]), max_size=40),
        max_size=60,
    ),
    chunk_bytes=st.integers(1, 64),
)
def test_chunks_cover_the_file_and_cut_after_newlines(
    tmp_path_factory: pytest.TempPathFactory, lines: list[str], chunk_bytes: int
) -> None:
    text = "\n".join(lines)
    path = tmp_path_factory.mktemp("chunks") / "t.txt"
    path.write_text(text, encoding="utf-8")
    size = path.stat().st_size
    chunks = split_into_chunks(0, path, size, chunk_bytes)
    pieces = [read_chunk(c) for c in chunks]  # each decodes on its own: cuts are on character boundaries
    assert "".join(pieces) == text
    assert sum(c.length_bytes for c in chunks) == size
    raw = text.encode()
    for chunk, piece in zip(chunks[:-1], pieces[:-1], strict=True):
        assert chunk.length_bytes >= chunk_bytes  # a cut only moves forward from the nominal offset
        # ... to just after the next newline, when the file has one after the nominal offset
        assert piece.endswith("\n") or b"\n" not in raw[chunk.offset_bytes + chunk_bytes :]


def test_chunk_without_newlines_cuts_on_characters(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_text("é" * 100, encoding="utf-8")  # 2 bytes each
    chunks = split_into_chunks(0, path, 200, 33)
    assert all(c.offset_bytes % 2 == 0 for c in chunks)
    assert "".join(read_chunk(c) for c in chunks) == "é" * 100


def test_invalid_utf8_names_file_and_offset(tmp_path: Path) -> None:
    path = tmp_path / "bad.txt"
    path.write_bytes(b"hello\nwor\xffld\n")
    (chunk,) = split_into_chunks(0, path, path.stat().st_size)
    with pytest.raises(UserInputError, match=r"bad.txt: not UTF-8 text \(invalid byte at offset 9\)"):
        read_chunk(chunk)


def test_a_utf16_file_or_glob_match_is_refused_like_a_directorys_binary_file(tmp_path: Path) -> None:
    """ASCII in UTF-16 (no BOM) is valid UTF-8 with a NUL after every character: given as a file or a glob it was
    trained on as such, while the same file in a directory was skipped as binary. Now one line names it, and a NUL
    past the sniffed head stops `read_chunk`."""
    (tmp_path / "u16").mkdir()
    utf16 = tmp_path / "u16" / "notes.txt"
    utf16.write_bytes("To be, or not to be\n".encode("utf-16-le"))
    expected = r"notes.txt: not UTF-8 text \(a NUL byte at offset 1: binary, or UTF-16/UTF-32 text\); convert"
    for spec in (str(utf16), str(tmp_path / "u16" / "*.txt"), f"tinyshakespeare,{utf16}"):
        with pytest.raises(UserInputError, match=expected):
            resolve_source(spec)
    late = tmp_path / "late.txt"
    late.write_bytes(b"a\n" * 5000 + b"b\0c\n")
    (source,) = resolve_source(str(late)).files  # the first 8 KiB are text
    chunks = split_into_chunks(0, source.path, source.size_bytes, 4096)
    with pytest.raises(UserInputError, match=r"late.txt: not UTF-8 text \(a NUL byte at offset 10001: bin"):
        [read_chunk(c) for c in chunks]


def test_prepare_and_train_refuse_a_utf16_file_with_one_line(tmp_path: Path) -> None:
    utf16 = tmp_path / "u16le.txt"
    utf16.write_bytes(bundled_corpora()["tinyshakespeare"].read_text()[:2000].encode("utf-16-le"))
    commands = [["prepare", str(utf16), "--tokenizer", "char", "--out", str(tmp_path / "p")],
                ["train", f"--data.source={utf16}", "--data.tokenizer=char", "--model.num_layers=1",
                 "--train.max_steps=1", "--train.threads=1", "--out", str(tmp_path / "run")]]  # fmt: skip
    for args in commands:
        done = subprocess.run([sys.executable, "-m", "gaudi3_scale.cli", *args], capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert done.returncode == 2 and done.stderr.count("\n") == 1, (args[0], done.stderr[-2000:])
        assert done.stderr.startswith(f"gaudi3: error: {utf16}: not UTF-8 text (a NUL byte at offset 1: ")
        assert "convert it to UTF-8" in done.stderr
    assert not (tmp_path / "p" / "manifest.json").exists() and not (tmp_path / "run" / "checkpoints").exists()
