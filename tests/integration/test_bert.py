"""arch bert end to end: a short MLM training run of bert-tiny on the bundled corpus (val loss falls, masked-token
accuracy reported), its checkpoint exported as a Hugging Face BertForMaskedLM with the same logits and read back,
a random BertForMaskedLM made here loaded into our encoder with transformers' logits, and generate / serve refusing
an encoder in one line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import BertConfig, BertForMaskedLM

from conftest import summary_table
from gaudi3_scale.artifacts.export import load_exported
from gaudi3_scale.artifacts.inference import read_model_state
from gaudi3_scale.cli.main import main
from gaudi3_scale.config.core import to_dict
from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.models import build_model, get_model_config
from gaudi3_scale.models.encoder import Encoder
from gaudi3_scale.models.hf import hf_model_config
from gaudi3_scale.serve.loading import load_served_model, resolve_source
from gaudi3_scale.train.module import CONFIG_KEY
from hf_checkpoints import load_ours

pytestmark = pytest.mark.integration

ATOL = 1e-5  # fp32: SDPA against HF's attention kernel, close but not bitwise
TRAIN = ["train", "--model.name", "bert-tiny", "--model.context_length", "32",
         "--train.global_batch_size", "8", "--train.max_steps", "16", "--train.val_every_steps", "8",
         "--train.val_batches", "4", "--checkpoint.every_steps", "16", "--optim.warmup_steps", "2"]  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The run directory and what the run printed on stderr (the summary table among it)."""
    out = tmp_path_factory.mktemp("bert") / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "gaudi3_scale.cli", *TRAIN, "--out", str(out)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "---- sample ----" not in proc.stdout  # an encoder has no text to sample
    return out, proc.stderr


@pytest.fixture(scope="module")
def run(trained: tuple[Path, str]) -> Path:
    return trained[0]


def _command(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    capsys.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    return code, capsys.readouterr().err


def test_mlm_training_lowers_val_loss_and_reports_accuracy(run: Path) -> None:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in val] == [8, 16]
    assert val[-1]["val_loss"] < val[0]["val_loss"]
    assert all(0.0 <= r["val_mlm_accuracy"] <= 1.0 for r in val)
    assert val[-1]["val_mlm_accuracy"] > 0.05  # above chance (1/69): it predicts frequent characters at least
    config = (run / "config.yaml").read_text()
    assert "arch: bert" in config and "vocab_size: 69" in config  # 65 characters + [PAD] [CLS] [SEP] [MASK]


def test_mlm_accuracy_is_in_the_summary_and_table_of_bert_runs_only(
    trained: tuple[Path, str], tmp_path: Path
) -> None:
    run, stderr = trained
    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["val_mlm_accuracy"] == last["val_mlm_accuracy"] and summary["val_loss"] == last["val_loss"]
    assert summary_table(stderr)["val masked-token accuracy"] == f"{last['val_mlm_accuracy']:.2%}"

    gpt = tmp_path / "gpt"
    proc = subprocess.run(
        [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(gpt), "--model.num_layers", "1",
         "--train.max_steps", "2", "--train.val_every_steps", "2", "--train.val_batches", "1",
         "--sample-tokens", "0"], capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((gpt / "summary.json").read_text())
    assert summary["val_loss"] is not None and "val_mlm_accuracy" not in summary
    table = summary_table(proc.stderr)
    assert "val loss" in table and not any("accuracy" in label for label in table)


def test_export_to_hf_matches_and_reads_back(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = run / "checkpoints" / "step-00000016"
    cfg, state = read_model_state(checkpoint)
    ours = build_model(cfg)
    ours.load_state_dict(state)
    tokens = torch.randint(0, cfg.padded_vocab_size, (2, cfg.context_length))
    with torch.no_grad():
        expected = ours.eval()(tokens)

    assert _command(
        capsys, "ckpt", "export", str(checkpoint), "--out", str(tmp_path / "hf"), "--format", "hf"
    ) == (
        0,
        "",
    )
    hf, info = BertForMaskedLM.from_pretrained(
        tmp_path / "hf", local_files_only=True, output_loading_info=True
    )
    assert not any(info.values()), info  # no missing, unexpected or mismatched weight
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(tokens).logits, expected, atol=ATOL, rtol=0)
        back = load_exported(tmp_path / "hf")
        assert isinstance(back, Encoder) and torch.equal(back(tokens), expected)

    # An encoder generates and serves nothing: one line, exit 2, for the checkpoint and for its export.
    code, err = _command(capsys, "generate", str(checkpoint))
    assert code == 2 and err.count("\n") == 1 and "is a bert encoder" in err
    with pytest.raises(UserInputError, match="is a bert encoder"):
        load_served_model(resolve_source(tmp_path / "hf"))


def test_untied_padded_encoder_exports_to_hf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = replace(
        get_model_config("bert-tiny"), vocab_size=69, pad_vocab_to_multiple=16, tie_embeddings=False
    )
    model = build_model(cfg, seed=0).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(0.3 * torch.randn_like(param))
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    torch.save({"state_dict": state, CONFIG_KEY: {"model": to_dict(cfg)}}, tmp_path / "untied.ckpt")
    out = tmp_path / "hf"
    assert (
        _command(
            capsys, "ckpt", "export", str(tmp_path / "untied.ckpt"), "--out", str(out), "--format", "hf"
        )[0]
        == 0
    )
    hf, info = BertForMaskedLM.from_pretrained(out, local_files_only=True, output_loading_info=True)
    assert not any(info.values()), info
    tokens = torch.randint(0, 69, (2, 64))
    with torch.no_grad():
        expected = model(tokens)
        assert expected.shape[-1] == 80  # 69 rounded up to a multiple of 16
        # the export leaves the padding out (transformers would predict it): the tokenizer's 69 logits, as ours
        assert hf.config.vocab_size == 69
        torch.testing.assert_close(hf.eval()(tokens).logits, expected[..., :69], atol=ATOL, rtol=0)
        assert torch.equal(load_exported(out)(tokens), expected[..., :69])


@pytest.mark.parametrize("tied", [True, False])
def test_hf_bert_loads_with_transformers_logits(tmp_path: Path, tied: bool) -> None:
    torch.manual_seed(0)
    config = BertConfig(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=48, max_position_embeddings=40, type_vocab_size=3,
                        hidden_act="gelu" if tied else "gelu_pytorch_tanh", layer_norm_eps=1e-7,
                        tie_word_embeddings=tied)  # fmt: skip
    hf = BertForMaskedLM(config)
    with (
        torch.no_grad()
    ):  # norms and biases away from 1 / 0: a swapped norm or a dropped bias changes the logits
        for param in hf.parameters():
            if param.ndim == 1:
                param.add_(0.3 * torch.randn_like(param))
    hf.eval().save_pretrained(tmp_path / "bert")
    ours = load_ours(tmp_path / "bert")
    assert isinstance(ours, Encoder)
    assert (ours.config.type_vocab_size, ours.config.tie_embeddings, ours.config.norm_eps) == (3, tied, 1e-7)
    tokens = torch.randint(0, 101, (2, 40))
    types = torch.randint(0, 3, (2, 40))
    with torch.no_grad():
        expected = hf(tokens, token_type_ids=types).logits
        torch.testing.assert_close(ours(tokens, token_types=types), expected, atol=ATOL, rtol=0)
        shorter = load_ours(
            tmp_path / "bert", context_length=16
        )  # model.init_from may ask for fewer positions
        short_expected = hf(tokens[:, :16], token_type_ids=types[:, :16]).logits
        torch.testing.assert_close(
            shorter(tokens[:, :16], token_types=types[:, :16]), short_expected, atol=ATOL, rtol=0
        )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"position_embedding_type": "relative_key"},
            "position_embedding_type 'relative_key' is not supported",
        ),
        ({"is_decoder": True}, "is_decoder True is not supported"),
        ({"hidden_act": "relu"}, "hidden_act 'relu' is not supported"),
        ({"type_vocab_size": None}, "type_vocab_size is None; a BertForMaskedLM config needs an integer"),
    ],
)
def test_hf_bert_we_cannot_compute_is_one_line(change: dict[str, object], message: str) -> None:
    config = {**BertConfig(hidden_size=32, num_attention_heads=4).to_dict(), **change}
    with pytest.raises(UserInputError, match=re.escape(message)) as raised:
        hf_model_config(config, name="x", where="config.json")
    assert "\n" not in str(raised.value)
