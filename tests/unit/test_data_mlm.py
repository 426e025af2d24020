"""MLM data (data.mlm): the 80/10/10 rule on a large sample, labels on the selected positions only, masks that
depend on the seed and the sample's stream position alone (so resumes and other layouts see the same masks), the
special token ids, and `data.mlm_mask_rate` bad input as one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models

from gaudi3_scale.cli.main import main
from gaudi3_scale.config.errors import ConfigError
from gaudi3_scale.data import DataConfig, TokenWindowDataset, ValWindowDataset, WindowSampler
from gaudi3_scale.data.mlm import IGNORE_INDEX, MlmMasking, MlmVocabulary, masked_count, mlm_vocabulary
from gaudi3_scale.data.tokenizers import CharTokenizer, HFTokenizer

TEXT_VOCAB = 65
VOCAB = MlmVocabulary(TEXT_VOCAB, {"[PAD]": 65, "[CLS]": 66, "[SEP]": 67, "[MASK]": 68})
T = 64


def masking(seed: int = 0, rate: float = 0.15) -> MlmMasking:
    return MlmMasking(VOCAB, rate, seed)


def tokens(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, TEXT_VOCAB, (rows, T)))


def test_80_10_10_on_a_large_sample_with_loss_on_selected_positions_only() -> None:
    x = tokens(8192)
    inputs, labels = masking().apply(x, np.arange(len(x)))
    selected = labels != IGNORE_INDEX
    # Exactly round(0.15 * 64) = 10 positions a window (BERT's count), none elsewhere touched.
    assert (selected.sum(dim=1) == 10).all() and masked_count(T, 0.15) == 10
    assert torch.equal(inputs[~selected], x[~selected])
    assert torch.equal(labels[selected], x[selected])
    shown = inputs[selected]
    n = shown.numel()  # 81,920 selected positions: one standard deviation of a 10 % share is 0.1 points
    masked = (shown == VOCAB.mask_id).sum().item() / n
    replaced = ((shown != VOCAB.mask_id) & (shown != x[selected])).sum().item() / n
    kept = (shown == x[selected]).sum().item() / n
    assert abs(masked - 0.8) < 0.006
    # A random token equals the original 1 time in 65: that share of the 10 % counts as kept.
    assert abs(replaced - 0.1 * 64 / 65) < 0.005
    assert abs(kept - (0.1 + 0.1 / 65)) < 0.005
    assert shown[shown != VOCAB.mask_id].max() < TEXT_VOCAB  # random tokens are text tokens, never special
    # The selection is uniform over positions: every column selected about 15 % of the time.
    column_rate = selected.float().mean(dim=0)
    assert column_rate.min() > 0.13 and column_rate.max() < 0.17


def test_masks_are_deterministic_per_seed_and_position_and_differ_otherwise() -> None:
    x = tokens(16)
    first = masking(seed=1).apply(x, np.arange(100, 116))
    again = masking(seed=1).apply(x.clone(), np.arange(100, 116))
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    other_seed = masking(seed=2).apply(x, np.arange(100, 116))[1]
    other_positions = masking(seed=1).apply(x, np.arange(116, 132))[1]  # the same text read again later
    other_stream = masking(seed=1).apply(x, np.arange(100, 116), stream=1)[1]
    for labels in (other_seed, other_positions, other_stream):
        assert not torch.equal(labels != IGNORE_INDEX, first[1] != IGNORE_INDEX)
    # Row i depends on its own position only: masking rows one at a time gives the same batch.
    rows = [masking(seed=1).apply(x[i : i + 1], np.array([100 + i]))[0] for i in range(16)]
    assert torch.equal(torch.cat(rows), first[0])


def _stream(
    sampler: WindowSampler, data: np.ndarray, steps: range
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    dataset = TokenWindowDataset(
        data, sampler, start_step=steps.start, num_steps=len(steps), masking=masking()
    )
    return list(dataset)


def test_stream_masks_survive_resume_and_another_layout() -> None:
    data = np.random.default_rng(0).integers(0, TEXT_VOCAB, 20_000).astype(np.uint16)
    args = dict(global_batch_size=8, seed=3)
    one_rank = _stream(WindowSampler(len(data), T, micro_batch_size=4, **args), data, range(0, 4))
    resumed = _stream(WindowSampler(len(data), T, micro_batch_size=4, **args), data, range(2, 4))
    for (a, b), (c, d) in zip(one_rank[4:], resumed, strict=True):
        assert torch.equal(a, c) and torch.equal(b, d)
    # Two ranks with one micro-step each read, and mask, the very samples one rank reads in two micro-steps.
    ranks = [
        _stream(
            WindowSampler(len(data), T, micro_batch_size=4, world_size=2, rank=r, **args), data, range(0, 4)
        )
        for r in (0, 1)
    ]
    for step in range(4):
        for r in (0, 1):
            single, split = one_rank[2 * step + r], ranks[r][step]
            assert torch.equal(single[0], split[0]) and torch.equal(single[1], split[1])


def test_validation_masks_are_fixed() -> None:
    data = np.random.default_rng(1).integers(0, TEXT_VOCAB, 5_000).astype(np.uint16)
    val = ValWindowDataset(data, T, micro_batch_size=4, max_batches=3, masking=masking())
    first = [val[i] for i in range(len(val))]
    assert all(torch.equal(a[1], b[1]) for a, b in zip(first, [val[i] for i in range(len(val))], strict=True))
    assert (first[0][1] != IGNORE_INDEX).sum() == 4 * 10
    assert not torch.equal(first[0][1] != IGNORE_INDEX, first[1][1] != IGNORE_INDEX)


def test_special_tokens_appended_or_the_tokenizers_own() -> None:
    vocab = mlm_vocabulary(CharTokenizer("abc"))
    assert vocab.special_ids == {"[PAD]": 3, "[CLS]": 4, "[SEP]": 5, "[MASK]": 6}
    assert (vocab.vocab_size, vocab.text_vocab_size, vocab.mask_id) == (7, 3, 6)
    # A BERT-style tokenizer.json keeps its ids; what it lacks ([SEP] here) is appended.
    raw = RawTokenizer(models.WordLevel({"[PAD]": 0, "hello": 1, "[MASK]": 2, "[CLS]": 3}, unk_token="[PAD]"))
    vocab = mlm_vocabulary(HFTokenizer(raw, kind="wordlevel"))
    assert vocab.special_ids == {"[PAD]": 0, "[CLS]": 3, "[SEP]": 4, "[MASK]": 2}
    assert vocab.vocab_size == 5


@pytest.mark.parametrize("rate", [0, 1, 1.5, -0.1, float("nan")])
def test_mask_rate_outside_0_1_is_refused(rate: float) -> None:
    with pytest.raises(ConfigError, match="mlm_mask_rate"):
        DataConfig(mlm_mask_rate=rate)


@pytest.mark.parametrize("rate", ["0", "1.5"])
def test_cli_mask_rate_is_one_line_exit_2(rate: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["train", "--print-config", "--model.name", "bert-tiny", "--data.mlm_mask_rate", rate])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert err.count("\n") == 1 and err.startswith(
        "gaudi3: error: data.mlm_mask_rate: must be between 0 and 1"
    )
    assert err.rstrip().endswith(f"got {float(rate)}")
