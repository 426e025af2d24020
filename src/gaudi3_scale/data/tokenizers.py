"""Tokenizers: text ↔ token ids, saved next to the tokens they produced.

Three kinds are built here and kept in a plain-dict registry: ``char`` (the vocabulary is the sorted set of
characters in the data, as in nanoGPT's ``shakespeare_char``: tinyshakespeare gives 65), ``byte`` (UTF-8 bytes,
256 ids, encodes anything) and ``bpe`` (byte-level BPE trained locally with Hugging Face ``tokenizers``, the GPT-2
scheme, so any text round-trips). A path to an existing ``tokenizer.json`` is loaded with
``tokenizers.Tokenizer.from_file``. ``synthetic`` is not built from text: prepare saves it beside the random ids of
``data.source: synthetic`` so that samples of a model trained on them can still be printed.

Every kind saves itself as ``tokenizer.json`` in the prepared directory: Hugging Face's format for the BPE-backed
kinds, a two-key JSON for ``char`` / ``byte`` / ``synthetic``. `load_tokenizer` tells them apart by content, so the file alone is
enough to decode a dataset.
"""

from __future__ import annotations

import hashlib
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.config.files import parse_json, read_text_file

__all__ = [
    "TOKENIZER_FILE",
    "ByteTokenizer",
    "CharTokenizer",
    "HFTokenizer",
    "SyntheticTokenizer",
    "Tokenizer",
    "build_tokenizer",
    "check_tokenizer_request",
    "get_tokenizer",
    "is_tokenizer_path",
    "load_tokenizer",
    "load_tokenizer_file",
    "register_tokenizer",
    "tokenizer_from_json",
    "tokenizer_sha256",
]

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_MAX_BYTES = 64 << 20  # Hugging Face tokenizer.json files run to ~20 MB (large vocabularies)
_CHAR_TYPE = "gaudi3-char"
_BYTE_TYPE = "gaudi3-byte"
_SYNTHETIC_TYPE = "gaudi3-synthetic"
_UNKNOWN_BYTE = 255  # never an ASCII character's id
_ID_OR_CHAR = re.compile(r"<([0-9]{1,12})>|.", re.DOTALL)


class Tokenizer(ABC):
    """What the rest of the stack needs from a tokenizer."""

    kind: str

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str: ...

    @abstractmethod
    def to_json(self) -> str:
        """The content of ``tokenizer.json``."""

    def encode_array(self, text: str) -> np.ndarray:
        """`encode` as an integer array; char and byte override it with vectorized versions (prepare's hot path)."""
        return np.asarray(self.encode(text), dtype=np.int64)

    def token_id(self, token: str) -> int | None:
        """The id of a special token such as ``[MASK]`` when the vocabulary has one (`data.mlm`), else None."""
        return None

    def save(self, directory: Path) -> Path:
        path = Path(directory) / TOKENIZER_FILE
        path.write_text(self.to_json(), encoding="utf-8")
        return path


def tokenizer_sha256(tokenizer: Tokenizer) -> str:
    """The tokenizer's identity: SHA-256 of its canonical form, `to_json()` in UTF-8 (the bytes `save` writes, and
    what a tokenizer.json read back gives again). Checkpoints record it (`checkpoint.contents`), so that a model is
    never paired with a tokenizer that maps text to other ids, however many ids that one has."""
    return hashlib.sha256(tokenizer.to_json().encode("utf-8")).hexdigest()


class CharTokenizer(Tokenizer):
    """One id per character; ids follow code-point order of the alphabet."""

    kind = "char"

    def __init__(self, chars: Iterable[str]) -> None:
        self.chars = "".join(sorted(set(chars)))
        if not self.chars or any(len(c) != 1 for c in self.chars):
            raise ValueError("a char tokenizer needs a non-empty alphabet of single characters")
        self._code_points = np.frombuffer(self.chars.encode("utf-32-le"), dtype=np.uint32)
        # A dense code point → id table makes encoding one numpy gather instead of a Python dict lookup per char.
        # Its last entry (one past the largest code point, -1) is where `take(mode="clip")` sends any code point
        # beyond the table, so one `min() < 0` check finds every unknown character.
        self._lookup = np.full(int(self._code_points[-1]) + 2, -1, dtype=np.int32)
        self._lookup[self._code_points] = np.arange(len(self.chars))
        # ASCII characters sort first, so their ids are < 128 and fit a bytes.translate table (GB/s, no numpy
        # temporaries); _UNKNOWN_BYTE marks the ASCII characters that are not in the vocabulary.
        ascii_ids = [int(i) if i >= 0 else _UNKNOWN_BYTE for i in self._lookup[:128]]
        self._ascii_table = bytes(ascii_ids + [_UNKNOWN_BYTE] * (256 - len(ascii_ids)))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def encode_array(self, text: str) -> np.ndarray:
        if text.isascii():  # most corpora, and O(1) to tell in CPython
            ids8 = text.encode("ascii").translate(self._ascii_table)
            pos = ids8.find(_UNKNOWN_BYTE)
            if pos >= 0:
                raise self._unknown(text, pos)
            return np.frombuffer(ids8, dtype=np.uint8)
        code_points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        ids = self._lookup.take(code_points, mode="clip")
        if ids.size and ids.min() < 0:
            raise self._unknown(text, int(np.flatnonzero(ids < 0)[0]))
        return ids

    def _unknown(self, text: str, pos: int) -> UserInputError:
        return UserInputError(
            f"char tokenizer: character {text[pos]!r} (U+{ord(text[pos]):04X}) at position {pos} is not in "
            f"its {self.vocab_size}-character vocabulary; use tokenizer=byte or bpe for open text"
        )

    def decode(self, ids: Sequence[int]) -> str:
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(
                f"char tokenizer: ids must be in [0, {self.vocab_size}), got {arr.min()}..{arr.max()}"
            )
        return self._code_points[arr].astype("<u4").tobytes().decode("utf-32-le")

    def to_json(self) -> str:
        return json.dumps({"type": _CHAR_TYPE, "chars": self.chars}, ensure_ascii=True)


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids: 256 symbols, no training, every string round-trips."""

    kind = "byte"

    @property
    def vocab_size(self) -> int:
        return 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids: Sequence[int]) -> str:
        # errors="replace": a window cut mid-character (a training sample) still decodes for display.
        return bytes(ids).decode("utf-8", errors="replace")

    def to_json(self) -> str:
        return json.dumps({"type": _BYTE_TYPE})


class SyntheticTokenizer(Tokenizer):
    """The ids of ``data.source: synthetic`` mean nothing, so their text is the ids themselves: ``<17><4>``.

    `encode` reads that form back; any other character c becomes ``ord(c) % vocab_size``, so every prompt (the
    empty prompt's newline too) gives valid ids to start sampling from.
    """

    kind = "synthetic"

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 1:
            raise ValueError(f"a synthetic tokenizer needs a positive vocab_size, got {vocab_size}")
        self._vocab_size = vocab_size

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str) -> list[int]:
        ids = []
        for match in _ID_OR_CHAR.finditer(text):
            if match.group(1) is None:
                ids.append(ord(match.group()) % self._vocab_size)
                continue
            token = int(match.group(1))
            if token >= self._vocab_size:
                raise UserInputError(
                    f"synthetic tokenizer: <{token}> is not an id of its vocabulary [0, {self._vocab_size})"
                )
            ids.append(token)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(f"<{int(i)}>" for i in ids)

    def to_json(self) -> str:
        return json.dumps({"type": _SYNTHETIC_TYPE, "vocab_size": self._vocab_size})


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers.Tokenizer`` (trained here or loaded from a tokenizer.json)."""

    def __init__(self, tokenizer: Any, kind: str) -> None:
        self._tok = tokenizer
        self.kind = kind

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def token_id(self, token: str) -> int | None:
        found = self._tok.token_to_id(token)
        return None if found is None else int(found)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=False))

    def to_json(self) -> str:
        return str(self._tok.to_str())


# ---- registry ---------------------------------------------------------------------------------------------

TokenizerBuilder = Callable[[Iterable[str], int | None, bool], Tokenizer]
_BUILDERS: dict[str, TokenizerBuilder] = {}


def register_tokenizer(kind: str, builder: TokenizerBuilder) -> None:
    """Add a kind: ``builder(texts, vocab_size, progress) -> Tokenizer``."""
    if kind in _BUILDERS:
        raise ValueError(f"tokenizer kind {kind!r} is already registered")
    _BUILDERS[kind] = builder


def get_tokenizer(kind: str) -> TokenizerBuilder:
    if kind not in _BUILDERS:
        allowed = ", ".join(sorted(_BUILDERS))
        raise ConfigError(
            "tokenizer", f"unknown tokenizer {kind!r}; allowed: {allowed}, or a path to a tokenizer.json"
        )
    return _BUILDERS[kind]


def check_tokenizer_request(kind: str, vocab_size: int | None) -> None:
    """What `build_tokenizer(kind, …, vocab_size)` would refuse without reading the data, refused before any is
    read (and before a progress bar is drawn): an unknown kind, a vocab_size the kind cannot have."""
    if is_tokenizer_path(kind):
        # A tokenizer.json fixes its own size: read here only when a size was asked for, to compare.
        if vocab_size is not None:
            _check_file_vocab(kind, load_tokenizer_file(Path(kind)), vocab_size)
        return
    get_tokenizer(kind)  # an unknown kind: one line with the allowed ones
    if kind == "char" and vocab_size is not None:
        raise ConfigError(
            "vocab_size",
            f"tokenizer=char takes its vocabulary from the data, got {vocab_size}; leave vocab_size unset, or "
            "use tokenizer=bpe (vocab_size >= 256)",
        )
    if kind == "byte":
        _check_byte_vocab(vocab_size)
    if kind == "bpe":
        _check_bpe_vocab(vocab_size)


def _check_file_vocab(path: str, tokenizer: Tokenizer, vocab_size: int | None) -> None:
    if vocab_size is not None and vocab_size != tokenizer.vocab_size:
        raise ConfigError(
            "vocab_size",
            f"the tokenizer file {path!r} fixes the vocabulary at {tokenizer.vocab_size} ids, got {vocab_size}; "
            "leave vocab_size unset (no --vocab-size)",
        )


def _check_byte_vocab(vocab_size: int | None) -> None:
    if vocab_size is not None and vocab_size != 256:
        raise ConfigError(
            "vocab_size", f"tokenizer=byte always has 256 ids, got {vocab_size}; set it to null"
        )


MAX_BPE_VOCAB = 1 << 20  # merges learned here; 2**31 asked the tokenizers library for 141 GB and aborted


def _check_bpe_vocab(vocab_size: int | None) -> None:
    if vocab_size is None or not 256 <= vocab_size <= MAX_BPE_VOCAB:
        raise ConfigError(
            "vocab_size",
            f"tokenizer=bpe needs vocab_size from 256 (256 byte symbols + merges) to {MAX_BPE_VOCAB:,}, got "
            f"{vocab_size}",
        )


def _build_char(texts: Iterable[str], vocab_size: int | None, progress: bool) -> Tokenizer:
    seen: set[str] = set()
    for text in texts:
        seen.update(text)
    if not seen:
        raise UserInputError("tokenizer=char: the data has no characters to build a vocabulary from")
    tok = CharTokenizer(seen)
    if vocab_size is not None and vocab_size != tok.vocab_size:
        raise ConfigError(
            "vocab_size",
            f"tokenizer=char takes its vocabulary from the data ({tok.vocab_size}); set it to null",
        )
    return tok


def _build_byte(texts: Iterable[str], vocab_size: int | None, progress: bool) -> Tokenizer:
    _check_byte_vocab(vocab_size)
    return ByteTokenizer()


def _build_bpe(texts: Iterable[str], vocab_size: int | None, progress: bool) -> Tokenizer:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    _check_bpe_vocab(vocab_size)
    assert vocab_size is not None  # checked just above
    # Byte-level BPE (GPT-2): every byte is in the initial alphabet, so no text is ever out of vocabulary.
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=progress
    )
    raw.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(raw, kind="bpe")


register_tokenizer("char", _build_char)
register_tokenizer("byte", _build_byte)
register_tokenizer("bpe", _build_bpe)


def is_tokenizer_path(kind: str) -> bool:
    """A `tokenizer` setting that is not a registered kind names a tokenizer.json file."""
    return kind not in _BUILDERS and (kind.endswith(".json") or "/" in kind or Path(kind).exists())


def _iter_texts(items: Iterable[str | Path]) -> Iterator[str]:
    for item in items:
        yield Path(item).read_text(encoding="utf-8") if isinstance(item, Path) else item


def build_tokenizer(
    kind: str, texts: Iterable[str | Path] = (), vocab_size: int | None = None, *, progress: bool = False
) -> Tokenizer:
    """Build a tokenizer of `kind` from `texts` (strings, or `Path`s of UTF-8 files), or load a tokenizer.json path."""
    if is_tokenizer_path(kind):
        tokenizer = load_tokenizer_file(Path(kind))
        _check_file_vocab(kind, tokenizer, vocab_size)
        return tokenizer
    return get_tokenizer(kind)(_iter_texts(texts), vocab_size, progress)


def tokenizer_from_json(text: str, *, where: str = "tokenizer.json") -> Tokenizer:
    """Inverse of `Tokenizer.to_json`; Hugging Face files are recognised by their ``model`` key."""
    data = parse_json(text, where=f"{where} (a tokenizer.json)", expect=None)
    if not isinstance(data, dict):
        raise UserInputError(f"{where}: expected a JSON object describing a tokenizer")
    if data.get("type") == _CHAR_TYPE:
        return CharTokenizer(data["chars"])
    if data.get("type") == _BYTE_TYPE:
        return ByteTokenizer()
    if data.get("type") == _SYNTHETIC_TYPE:
        vocab = data.get("vocab_size")
        if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
            raise UserInputError(
                f"{where}: a synthetic tokenizer needs a positive integer vocab_size, got {vocab!r}"
            )
        return SyntheticTokenizer(vocab)
    if "model" in data:
        from tokenizers import Tokenizer as RawTokenizer

        try:
            raw = RawTokenizer.from_str(text)
        except Exception as exc:  # tokenizers raises a bare Exception with a Rust message
            reason = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise UserInputError(f"{where}: Hugging Face tokenizers could not read it ({reason})") from None
        model_type = str(data["model"].get("type", "hf")).lower() if isinstance(data["model"], dict) else "hf"
        return HFTokenizer(raw, kind=model_type)
    raise UserInputError(
        f"{where}: not a tokenizer file (expected a Hugging Face tokenizer.json or a gaudi3 one)"
    )


def load_tokenizer_file(path: Path) -> Tokenizer:
    if not path.is_file():
        raise ConfigError(
            "tokenizer",
            f"{str(path)!r} is not a registered kind ({', '.join(sorted(_BUILDERS))}) "
            "nor an existing tokenizer.json file",
        )
    return tokenizer_from_json(_read_tokenizer_file(path), where=str(path))


def _read_tokenizer_file(path: Path) -> str:
    return read_text_file(path, what="tokenizer file", max_bytes=TOKENIZER_MAX_BYTES)


def load_tokenizer(prepared_dir: Path, *, flag: str | None = None) -> Tokenizer:
    """Load the tokenizer that `Tokenizer.save` wrote into a prepared dataset directory, or into the directory the
    user named with `flag` (e.g. ``--tokenizer``: then a missing file is blamed on that choice)."""
    path = Path(prepared_dir) / TOKENIZER_FILE
    if not path.is_file() and flag is not None:
        raise UserInputError(
            f"{flag} {str(prepared_dir)!r}: no {TOKENIZER_FILE} there; pass a directory that holds one (a run's "
            "tokenizer/, an export's tokenizer/ or a prepared dataset)"
        )
    if not path.is_file():
        raise UserInputError(
            f"{path}: missing; the prepared dataset has no tokenizer, re-run `gaudi3 prepare --force`"
        )
    return tokenizer_from_json(_read_tokenizer_file(path), where=str(path))
