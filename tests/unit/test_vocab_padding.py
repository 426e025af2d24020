"""Vocabulary padding takes no part in the model's distribution (`models.vocab`): a model padded to 128 rows trains,
evaluates and samples as the unpadded one with the same real rows, however large its padding rows' logits would be.

The two models share their real rows bitwise: the init depends only on (seed, parameter name, element index), and
the first 65 rows of a [128, dim] table are its first 65 · dim elements (`models.common.init`)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from gaudi3_scale.data.mlm import IGNORE_INDEX
from gaudi3_scale.models import build_model, get_model_config
from gaudi3_scale.models.generate import sample_next_token
from gaudi3_scale.train.module import masked_lm_metrics, next_token_loss

VOCAB, PADDED = 65, 128
ARCHS = ["shakespeare-char", "llama-tiny", "bert-tiny"]  # gpt2 with a tied head, llama untied, an encoder


def _models(name: str) -> tuple[nn.Module, nn.Module]:
    """(unpadded, padded) models of preset `name` with the same real rows; the padding rows of the head are made
    50 times the init's scale (and bert's decoder bias 10), so unmasked they would take most of the probability."""
    cfg = replace(get_model_config(name), vocab_size=VOCAB, context_length=32, dropout=0.0)
    plain = build_model(replace(cfg, pad_vocab_to_multiple=1), seed=0)
    padded = build_model(replace(cfg, pad_vocab_to_multiple=64), seed=0)
    assert padded.output.weight.shape[0] == PADDED
    with torch.no_grad():
        padded.output.weight[VOCAB:].normal_(0.0, 1.0, generator=torch.Generator().manual_seed(1))
        if padded.output.bias is not None:
            padded.output.bias[VOCAB:] = 10.0
    return plain, padded


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (4, 33), generator=torch.Generator().manual_seed(2))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # as the data loader gives them


def _loss(model: nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The training objective (and bert's MLM accuracy) of one batch, as the LightningModule computes them."""
    x, y = _batch()
    if name != "bert-tiny":
        return next_token_loss(model, x, y), None
    labels = torch.where(
        torch.arange(y.numel()).view_as(y) % 3 == 0, y, IGNORE_INDEX
    )  # a third of the positions
    return masked_lm_metrics(model(x), labels)


@pytest.mark.parametrize("name", ARCHS)
def test_padding_changes_neither_loss_nor_gradients(name: str) -> None:
    plain, padded = _models(name)
    want, want_accuracy = _loss(plain, name)
    got, got_accuracy = _loss(padded, name)
    torch.testing.assert_close(got, want)
    if want_accuracy is not None:  # the argmax is never a padding column
        assert got_accuracy == want_accuracy
    want.backward()
    got.backward()
    wanted = dict(plain.named_parameters())
    for key, param in padded.named_parameters():
        assert param.grad is not None, key
        rows = wanted[key].shape[0]
        torch.testing.assert_close(param.grad[:rows], wanted[key].grad, msg=key)
        if rows < param.shape[0]:  # a vocabulary table: its padding rows learn nothing
            assert not param.grad[rows:].any(), key


@pytest.mark.parametrize("name", ["shakespeare-char", "llama-tiny"])
def test_padding_gets_zero_probability_and_is_never_sampled(name: str) -> None:
    _, padded = _models(name)
    with torch.no_grad():
        logits = padded(_batch()[0])[:, -1]  # [4, 128], the padding columns not cut off
    assert logits.shape[-1] == PADDED
    assert not torch.softmax(logits, dim=-1)[:, VOCAB:].any()
    generator = torch.Generator().manual_seed(3)
    draws = torch.cat([sample_next_token(logits, 2.0, None, generator) for _ in range(200)])
    assert int(draws.max()) < VOCAB


def test_compiled_loss_masks_the_padding_too() -> None:
    """`train.compile` compiles the model together with its loss (`distributed.parallelize`): the in-place write of
    the padding columns stays in one graph, and the padding rows still get no gradient. Backend aot_eager: the write
    through an alias is AOTAutograd's to get right (functionalization), and it skips Inductor's code generation
    (~10 s of CPU instead of ~30; Inductor gave the same loss and gradients when tried, torch 2.13)."""
    plain, padded = _models("llama-tiny")
    x, y = _batch()
    want = next_token_loss(plain, x, y)
    got = torch.compile(next_token_loss, fullgraph=True, backend="aot_eager")(padded, x, y)
    torch.testing.assert_close(got, want)
    want.backward()
    got.backward()
    assert padded.output.weight.grad is not None and plain.output.weight.grad is not None
    torch.testing.assert_close(padded.output.weight.grad[:VOCAB], plain.output.weight.grad)
    assert not padded.output.weight.grad[VOCAB:].any()


def test_an_fp8_head_is_masked_without_writing_its_output_in_place() -> None:
    """torchao's Float8Linear returns a view made inside its custom Function; writing it in place is refused at the
    next op. The masked copy trains (torch._scaled_mm runs on CPU), with zero probability on the padding."""
    pytest.importorskip("torchao.float8")
    from gaudi3_scale.device.float8 import apply_float8

    cfg = replace(
        get_model_config("llama-tiny"), vocab_size=VOCAB, context_length=32, pad_vocab_to_multiple=64
    )
    model = build_model(cfg, seed=0)
    assert apply_float8(model, head=True) > 0 and type(model.output).__name__ == "Float8Linear"
    x, y = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x.to(torch.int64))
        loss = nn.functional.cross_entropy(logits.float().view(-1, PADDED), y.view(-1))
    loss.backward()
    assert torch.isfinite(loss) and model.output.weight.grad is not None
    assert torch.softmax(logits.float(), -1)[..., VOCAB:].max().item() == 0.0
