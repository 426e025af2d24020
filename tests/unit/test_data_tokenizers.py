"""Tokenizers: nanoGPT's char vocabulary, lossless round trips, save/load, and the registry's errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.data import tokenizers as tk
from gaudi3_scale.data.sources import bundled_corpora

# The 65 characters nanoGPT's data/shakespeare_char/prepare.py prints for tinyshakespeare.
NANOGPT_CHARS = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


@pytest.fixture(scope="module")
def shakespeare() -> str:
    return bundled_corpora()["tinyshakespeare"].read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def bpe(shakespeare: str) -> tk.Tokenizer:
    return tk.build_tokenizer("bpe", [shakespeare[:200_000]], vocab_size=400)


def test_char_vocabulary_matches_nanogpt(shakespeare: str) -> None:
    tok = tk.build_tokenizer("char", [shakespeare])
    assert isinstance(tok, tk.CharTokenizer)
    assert tok.vocab_size == 65
    assert tok.chars == NANOGPT_CHARS
    assert tok.encode("hi!") == [46, 47, 2]  # nanoGPT's stoi: h=46, i=47, !=2


def test_char_vocabulary_accepts_files(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("bca", encoding="utf-8")
    tok = tk.build_tokenizer("char", [tmp_path / "a.txt", "zz"])
    assert tok.vocab_size == 4
    assert tok.decode([0, 1, 2, 3]) == "abcz"


@given(text=st.text(alphabet=NANOGPT_CHARS, max_size=300))
def test_char_round_trip(text: str) -> None:
    tok = tk.CharTokenizer(NANOGPT_CHARS)
    ids = tok.encode(text)
    assert all(0 <= i < 65 for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode_array(text).tolist() == ids


@given(text=st.text(alphabet="ab\n é✓😀~", max_size=200))
def test_char_ids_are_alphabet_positions_for_ascii_and_other_text(text: str) -> None:
    alphabet = "".join(sorted("ab\n é✓😀~"))
    tok = tk.CharTokenizer(alphabet)
    # The ASCII fast path (a bytes.translate table) and the code-point path give the same ids as a dict would.
    assert tok.encode_array(text).tolist() == [alphabet.index(c) for c in text]


@pytest.mark.parametrize(("text", "position"), [("abz", 2), ("abé", 2), ("a\x7f", 1)])
def test_char_unknown_character_position(text: str, position: int) -> None:
    with pytest.raises(UserInputError, match=rf"at position {position} is not in its 3-character vocabulary"):
        tk.CharTokenizer("abc").encode_array(text)


def test_char_out_of_vocabulary_is_one_line_error() -> None:
    tok = tk.CharTokenizer("abc")
    with pytest.raises(UserInputError, match=r"'é' \(U\+00E9\) at position 1 .* 3-character") as exc:
        tok.encode("aé")
    assert "\n" not in str(exc.value)
    with pytest.raises(ValueError, match=r"ids must be in \[0, 3\)"):
        tok.decode([3])


@given(text=st.text(max_size=200))
def test_byte_round_trip_any_unicode(text: str) -> None:
    tok = tk.ByteTokenizer()
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.encode_array(text).tolist() == ids


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=60)
@given(text=st.text(max_size=200))
def test_bpe_round_trip_any_unicode(bpe: tk.Tokenizer, text: str) -> None:
    ids = bpe.encode(text)
    assert all(0 <= i < bpe.vocab_size for i in ids)
    assert bpe.decode(ids) == text


def test_bpe_trains_to_requested_size_and_compresses(bpe: tk.Tokenizer, shakespeare: str) -> None:
    assert bpe.kind == "bpe"
    assert bpe.vocab_size == 400
    sample = shakespeare[:10_000]
    assert len(bpe.encode(sample)) < 0.7 * len(sample)  # merges were learned


def test_bpe_training_is_deterministic(shakespeare: str) -> None:
    a = tk.build_tokenizer("bpe", [shakespeare[:50_000]], vocab_size=300)
    b = tk.build_tokenizer("bpe", [shakespeare[:50_000]], vocab_size=300)
    assert a.to_json() == b.to_json()


@pytest.mark.parametrize("vocab_size", [None, 100])
def test_bpe_needs_vocab_size(vocab_size: int | None) -> None:
    with pytest.raises(ConfigError, match="vocab_size: tokenizer=bpe needs vocab_size from 256"):
        tk.build_tokenizer("bpe", ["abc"], vocab_size=vocab_size)


def test_vocab_size_rejected_where_fixed() -> None:
    with pytest.raises(ConfigError, match="byte always has 256"):
        tk.build_tokenizer("byte", [], vocab_size=300)
    with pytest.raises(ConfigError, match=r"from the data \(3\)"):
        tk.build_tokenizer("char", ["abc"], vocab_size=10)


@pytest.mark.parametrize("kind", ["char", "byte", "bpe"])
def test_save_then_load_encodes_identically(
    kind: str, tmp_path: Path, shakespeare: str, bpe: tk.Tokenizer
) -> None:
    tok = bpe if kind == "bpe" else tk.build_tokenizer(kind, [shakespeare])
    path = tok.save(tmp_path)
    assert path == tmp_path / tk.TOKENIZER_FILE
    loaded = tk.load_tokenizer(tmp_path)
    assert loaded.kind == kind
    assert loaded.vocab_size == tok.vocab_size
    sample = shakespeare[5000:6000]
    assert loaded.encode(sample) == tok.encode(sample)
    assert loaded.decode(loaded.encode(sample)) == sample


def test_path_to_tokenizer_json_is_loaded(tmp_path: Path, bpe: tk.Tokenizer) -> None:
    path = bpe.save(tmp_path)
    tok = tk.build_tokenizer(str(path))
    assert (tok.kind, tok.vocab_size) == ("bpe", 400)
    with pytest.raises(ConfigError, match=r"nor an existing tokenizer\.json"):
        tk.build_tokenizer(str(tmp_path / "missing.json"))


def test_unknown_kind_lists_valid_ones() -> None:
    with pytest.raises(
        UserInputError, match=r"unknown tokenizer 'wordpiece'; allowed: bpe, byte, char, or a path"
    ):
        tk.get_tokenizer("wordpiece")


def test_register_tokenizer_adds_a_kind() -> None:
    def build(texts: object, vocab_size: int | None, progress: bool) -> tk.Tokenizer:
        return tk.ByteTokenizer()

    tk.register_tokenizer("test-bytes", build)
    try:
        assert tk.build_tokenizer("test-bytes").vocab_size == 256
        with pytest.raises(ValueError, match="already registered"):
            tk.register_tokenizer("test-bytes", build)
    finally:
        del tk._BUILDERS["test-bytes"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"a": 1}', "not a tokenizer file"),
    ],
)
def test_bad_tokenizer_file(tmp_path: Path, content: str, message: str) -> None:
    (tmp_path / tk.TOKENIZER_FILE).write_text(content, encoding="utf-8")
    with pytest.raises(UserInputError, match=message):
        tk.load_tokenizer(tmp_path)


def test_missing_tokenizer_file(tmp_path: Path) -> None:
    with pytest.raises(UserInputError, match=r"tokenizer\.json: missing"):
        tk.load_tokenizer(tmp_path)


def test_char_json_is_plain(tmp_path: Path) -> None:
    tk.CharTokenizer("ba\n").save(tmp_path)
    assert json.loads((tmp_path / tk.TOKENIZER_FILE).read_text()) == {"type": "gaudi3-char", "chars": "\nab"}


def test_path_to_tokenizer_json_refuses_another_vocab_size(tmp_path: Path, bpe: tk.Tokenizer) -> None:
    path = bpe.save(tmp_path)
    message = r"^vocab_size: the tokenizer file '.*' fixes the vocabulary at 400 ids, got 500; leave vocab_size unset"
    with pytest.raises(ConfigError, match=message):
        tk.check_tokenizer_request(str(path), 500)
    with pytest.raises(ConfigError, match=message):
        tk.build_tokenizer(str(path), vocab_size=500)
    tk.check_tokenizer_request(str(path), 400)  # the file's own size is no contradiction
    assert tk.build_tokenizer(str(path), vocab_size=400).vocab_size == 400
