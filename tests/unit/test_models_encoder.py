"""The BERT encoder (models.encoder): bidirectional attention, post-norm, the MLM loss on masked positions only, and
the bert-base parameter count pinned to the paper and to transformers' BertForMaskedLM."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from transformers import BertConfig, BertForMaskedLM, BertModel

from gaudi3_scale.data.mlm import IGNORE_INDEX
from gaudi3_scale.models import build_model, count_parameters, flops_per_token, get_model_config
from gaudi3_scale.models.encoder import Encoder
from gaudi3_scale.train.module import masked_lm_loss, masked_lm_metrics

BERT_BASE_MLM = 109_514_298  # HF BertForMaskedLM(BertConfig()): bert-base-uncased's shapes, no pooler


def _tiny(**changes: object) -> Encoder:
    model = build_model(replace(get_model_config("bert-tiny"), vocab_size=69, **changes), seed=0).eval()
    assert isinstance(model, Encoder)
    return model


@torch.no_grad()
def test_a_later_token_changes_earlier_outputs_unlike_a_decoder() -> None:
    x = torch.randint(0, 65, (1, 32))
    later = x.clone()
    later[0, 20] = (x[0, 20] + 1) % 65
    encoder = _tiny()
    changed = (encoder(x) - encoder(later)).abs().amax(dim=-1)[0]
    assert (changed[:20] > 1e-4).all()  # every earlier position sees token 20
    decoder = build_model(get_model_config("shakespeare-char").resolve_vocab(65), seed=0).eval()
    changed = (decoder(x) - decoder(later)).abs().amax(dim=-1)[0]
    assert (changed[:20] == 0).all() and (changed[20:] > 0).all()  # the causal mask the switch turns off


@torch.no_grad()
def test_block_is_post_norm() -> None:
    block = _tiny().layers[0]
    h = torch.randn(2, 8, 128) * 5 + 3
    attended = block.attention_norm(h + block.attention(h))
    expected = block.ffn_norm(attended + block.feed_forward(attended))
    out = block(h)
    assert torch.equal(out, expected)
    # LayerNorm last: every position leaves the block normalised (the norms' init weight 1, bias 0).
    torch.testing.assert_close(out.mean(-1), torch.zeros(2, 8), atol=1e-5, rtol=0)


def test_loss_counts_masked_positions_only() -> None:
    model = _tiny()
    x = torch.randint(0, 65, (2, 16))
    labels = torch.full_like(x, IGNORE_INDEX)
    labels[0, 3], labels[1, 9] = 7, 11
    logits = model(x)
    expected = F.cross_entropy(torch.stack([logits[0, 3], logits[1, 9]]), torch.tensor([7, 11]))
    torch.testing.assert_close(masked_lm_loss(model, x, labels), expected)
    loss, accuracy = masked_lm_metrics(logits, labels)
    torch.testing.assert_close(loss, expected)
    hits = (logits[0, 3].argmax() == 7).float() + (logits[1, 9].argmax() == 11).float()
    assert accuracy.item() == hits.item() / 2


def test_token_types_default_to_segment_0() -> None:
    model = _tiny()
    x = torch.randint(0, 65, (2, 16))
    with torch.no_grad():
        assert torch.equal(model(x), model(x, token_types=torch.zeros_like(x)))
        assert not torch.equal(model(x), model(x, token_types=torch.ones_like(x)))
        with pytest.raises(ValueError, match="has no KV cache"):
            model(x, object())  # type: ignore[arg-type]


def test_bert_base_has_the_published_110m_parameters() -> None:
    cfg = get_model_config("bert-base")
    # Devlin et al. 2018 §3: BERT-base "Total Parameters=110M"; with the MLM head and no pooler, as BertForMaskedLM.
    assert count_parameters(cfg) == BERT_BASE_MLM and round(BERT_BASE_MLM / 1e6) == 110
    hf_config = BertConfig(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                           intermediate_size=3072, max_position_embeddings=512, type_vocab_size=2)  # fmt: skip
    with torch.device("meta"):  # transformers' own counts, for the same shapes, allocating nothing
        assert BertForMaskedLM(hf_config).num_parameters() == BERT_BASE_MLM
        encoder_with_pooler = BertModel(hf_config).num_parameters()
    # The other common figure, 109,482,240, is BertModel: the pooler (dense + bias) instead of the MLM head
    # (transform dense + bias, its LayerNorm, the decoder bias).
    mlm_head, pooler = 768 * 768 + 768 + 2 * 768 + 30522, 768 * 768 + 768
    assert encoder_with_pooler == BERT_BASE_MLM - mlm_head + pooler == 109_482_240
    # Padding rows (GPUs round 30522 up to 30528) are never counted, the decoder bias's included.
    assert count_parameters(replace(cfg, pad_vocab_to_multiple=64)) == BERT_BASE_MLM
    # FLOPs count the matmul parameters: the position and token-type tables are lookups only.
    lookups = 512 * 768 + 2 * 768
    assert count_parameters(cfg, exclude_embeddings=True) == BERT_BASE_MLM - lookups
    assert flops_per_token(cfg) == 6 * (BERT_BASE_MLM - lookups) + 12 * 12 * 12 * 64 * 512


@pytest.mark.parametrize("tie", [True, False])
def test_init_is_seeded_and_biases_start_at_zero(tie: bool) -> None:
    a, b = _tiny(tie_embeddings=tie), _tiny(tie_embeddings=tie)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert (a.output.weight is a.tok_embeddings.weight) is tie
    assert torch.equal(a.output.bias, torch.zeros(69))
    with torch.device("meta"):
        meta = build_model(a.config)
    meta.to_empty(device="cpu")
    meta.init_weights(0)  # the decoder bias is garbage after to_empty: init must zero it
    assert all(torch.equal(p, q) for p, q in zip(meta.parameters(), a.parameters(), strict=True))
