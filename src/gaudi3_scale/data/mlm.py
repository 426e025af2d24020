"""Masked-language-model inputs: the special tokens an encoder needs, and dynamic masking of token windows.

Special tokens. MLM needs a [MASK] id, and a BERT-style vocabulary has [PAD], [CLS] and [SEP] too. A tokenizer that
already has them (a BERT tokenizer.json) keeps its ids; otherwise (char, byte, our BPE) they are reserved *after* its
vocabulary: ids V, V+1, V+2, V+3 in the order of `SPECIAL_TOKENS`, with V the tokenizer's vocabulary size. Prepared
token files never contain them — a window is a span of text, as RoBERTa's packed inputs (Liu et al. 2019,
arXiv:1907.11692 §4.2) but without separators — so every prepared dataset serves MLM unchanged, and the ids follow
from the tokenizer saved beside the data (and beside every run) alone: `mlm_vocabulary(tokenizer)`.

Masking (Devlin et al. 2018, arXiv:1810.04805 §3.1 and create_pretraining_data.py): in each window of T tokens,
k = max(1, round(rate · T)) positions are selected; of those, 80 % become [MASK], 10 % a random text token and 10 %
stay unchanged; the labels are the original tokens at the selected positions and `IGNORE_INDEX` elsewhere, so the
loss counts the selected positions only. The masks are drawn anew every time a window is read (dynamic masking,
RoBERTa §4.1), from a counter-based hash of (seed, stream, sample position in the stream, token position): a
resumed run, on any world size or accumulation, masks every sample exactly as an uninterrupted one, and the
validation windows get the same masks at every evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from gaudi3_scale.data.sampler import (
    _GOLDEN,
    _mix64,
)  # the sampler's splitmix64: one hash for the data stream
from gaudi3_scale.data.tokenizers import Tokenizer

__all__ = ["IGNORE_INDEX", "SPECIAL_TOKENS", "MlmMasking", "MlmVocabulary", "masked_count", "mlm_vocabulary"]

SPECIAL_TOKENS = ("[PAD]", "[CLS]", "[SEP]", "[MASK]")
IGNORE_INDEX = -100  # torch.nn.functional.cross_entropy's default ignore_index: positions with no loss
TRAIN_STREAM, VAL_STREAM = 0, 1
# What happens to a selected position: [MASK] below 0.8, a random token below 0.9, else the token itself.
_MASK_FRACTION, _RANDOM_FRACTION = 0.8, 0.1
_SELECT, _ACTION, _RANDOM = 0, 1, 2  # independent hash streams per purpose


@dataclass(frozen=True)
class MlmVocabulary:
    """Ids of an MLM run: text tokens are [0, text_vocab_size); `special_ids` maps each of `SPECIAL_TOKENS`."""

    text_vocab_size: int
    special_ids: dict[str, int]

    @property
    def mask_id(self) -> int:
        return self.special_ids["[MASK]"]

    @property
    def vocab_size(self) -> int:
        """Rows the model's embedding needs: the text tokens and every special id."""
        return max(self.text_vocab_size, max(self.special_ids.values()) + 1)


def mlm_vocabulary(tokenizer: Tokenizer) -> MlmVocabulary:
    """The tokenizer's own special tokens where it has them, the others appended after its vocabulary."""
    size = tokenizer.vocab_size
    special: dict[str, int] = {}
    for token in SPECIAL_TOKENS:
        own = tokenizer.token_id(token)
        if own is None:
            own, size = size, size + 1
        special[token] = own
    return MlmVocabulary(text_vocab_size=tokenizer.vocab_size, special_ids=special)


def masked_count(context_length: int, mask_rate: float) -> int:
    """Positions selected per window: BERT's `max(1, round(T · rate))`, so every window has a loss."""
    return max(1, min(context_length, round(context_length * mask_rate)))


@lru_cache(maxsize=8)
def _keys(seed: int, stream: int) -> tuple[int, int, int]:
    """Hash keys of (seed, stream), one per purpose (selection, 80/10/10 action, random token)."""
    state = np.random.SeedSequence([seed, stream]).generate_state(3, dtype=np.uint64)
    return int(state[_SELECT]), int(state[_ACTION]), int(state[_RANDOM])


def _hash(key: int, counters: np.ndarray) -> np.ndarray:
    """splitmix64 of the counters: output i is mix64(key + (counter_i + 1) · golden), uint64."""
    return _mix64(np.uint64(key) + (counters + np.uint64(1)) * _GOLDEN)


@dataclass(frozen=True)
class MlmMasking:
    """Turns token windows into (inputs, labels) for the MLM loss; see the module docstring for the rule."""

    vocab: MlmVocabulary
    mask_rate: float
    seed: int

    def apply(
        self, tokens: torch.Tensor, positions: np.ndarray, *, stream: int = TRAIN_STREAM
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`tokens` int64 [n, T] whose rows are samples `positions` of `stream` → (inputs, labels), int64 [n, T]."""
        ids = tokens.numpy()
        n, length = ids.shape
        counters = (
            np.asarray(positions, dtype=np.uint64)[:, None] * np.uint64(length)
            + np.arange(length, dtype=np.uint64)[None, :]
        )
        select_key, action_key, random_key = _keys(self.seed, stream)
        k = masked_count(length, self.mask_rate)
        # The k positions with the smallest hashes: a uniformly random k-subset of each row.
        chosen = np.argpartition(_hash(select_key, counters), k - 1, axis=1)[:, :k]
        rows = np.arange(n)[:, None]
        action = (_hash(action_key, counters[rows, chosen]) >> np.uint64(11)) * (2.0**-53)  # uniform [0, 1)
        replacement = (
            _hash(random_key, counters[rows, chosen]) % np.uint64(self.vocab.text_vocab_size)
        ).astype(np.int64)
        original = ids[rows, chosen]
        new = np.where(action < _MASK_FRACTION, self.vocab.mask_id, original)
        new = np.where(
            (action >= _MASK_FRACTION) & (action < _MASK_FRACTION + _RANDOM_FRACTION), replacement, new
        )
        inputs = ids.copy()
        inputs[rows, chosen] = new
        labels = np.full_like(ids, IGNORE_INDEX)
        labels[rows, chosen] = original
        return torch.from_numpy(inputs), torch.from_numpy(labels)
