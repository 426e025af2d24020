"""Defaults an expert picks on accelerators, checked on CPU: vocabulary padding (resolved per device, kept on
resume, never counted), the loss inside the compiled region, CUDA graphs refused where there is no CUDA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from gaudi3_scale.config.core import parse_overrides
from gaudi3_scale.distributed.plan import ParallelPlan
from gaudi3_scale.models import ModelConfig, count_parameters, flops_per_token, get_model_config
from gaudi3_scale.train import GaudiTrainer, build_run_config
from gaudi3_scale.train.module import LanguageModel
from gaudi3_scale.train.optim_config import OptimConfig

pytestmark = pytest.mark.integration

TINY = ["--train.threads", "1", "--model.num_layers", "1", "--model.dim", "32", "--model.num_heads", "2",
        "--model.context_length", "16", "--train.global_batch_size", "2", "--train.val_every_steps", "0",
        "--train.val_batches", "1"]  # fmt: skip


def _fit(out: Path, *extra: str) -> dict:
    cfg = build_run_config(None, parse_overrides(["--out_dir", str(out), *TINY, *extra]))
    return GaudiTrainer(cfg, progress=False).fit()


def test_padding_is_resolved_per_device() -> None:
    cfg = ModelConfig(vocab_size=50257)
    assert cfg.resolve_padding("cpu").padded_vocab_size == 50257
    assert cfg.resolve_padding("cuda").padded_vocab_size == 50304  # nanoGPT's padded GPT-2 vocabulary
    assert cfg.resolve_padding("hpu").pad_vocab_to_multiple == 64
    explicit = ModelConfig(vocab_size=50257, pad_vocab_to_multiple=256)
    assert explicit.resolve_padding("cuda").padded_vocab_size == 50432


@pytest.mark.parametrize("name", ["gpt2-124m", "llama3-8b", "shakespeare-char"])
def test_padding_rows_are_not_counted(name: str) -> None:
    cfg = get_model_config(name)
    if cfg.vocab_size is None:
        cfg.vocab_size = 65
    plain = ModelConfig(**{**cfg.__dict__, "pad_vocab_to_multiple": 1})
    padded = ModelConfig(**{**cfg.__dict__, "pad_vocab_to_multiple": 64})
    assert padded.padded_vocab_size > plain.padded_vocab_size or plain.vocab_size % 64 == 0
    assert count_parameters(padded) == count_parameters(plain)
    assert count_parameters(padded, exclude_embeddings=True) == count_parameters(
        plain, exclude_embeddings=True
    )
    assert flops_per_token(padded) == flops_per_token(plain)


def test_a_resume_keeps_the_checkpoints_padding(tmp_path: Path) -> None:
    """Trained with 16-row padding, resumed with the padding left to the device default: the checkpoint's rows
    win (the default on CPU, 1, would not fit its weights)."""
    _fit(tmp_path, "--train.max_steps", "2", "--model.pad_vocab_to_multiple", "16")
    summary = _fit(tmp_path, "--train.max_steps", "4")
    assert summary["steps"] == 4
    resolved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert resolved["model"]["pad_vocab_to_multiple"] == 16


def test_cpu_run_resolves_no_padding(tmp_path: Path) -> None:
    _fit(tmp_path, "--train.max_steps", "1")
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["model"]["pad_vocab_to_multiple"] == 1


def test_cuda_graphs_are_refused_without_cuda(tmp_path: Path, gaudi3_cli) -> None:
    code, _, err = gaudi3_cli(
        "train", "--out", str(tmp_path / "run"), "--train.compile", "true",
        "--train.compile_mode", "reduce-overhead", *TINY,
    )  # fmt: skip
    assert code == 2, err
    assert err.startswith("gaudi3: error: train.compile_mode: reduce-overhead captures CUDA graphs")
    assert "allowed here: default, max-autotune, max-autotune-no-cudagraphs" in err and err.count("\n") == 1
    assert not (tmp_path / "run" / "checkpoints").exists()


def _module(compile: bool) -> LanguageModel:
    cfg = ModelConfig(num_layers=1, dim=32, num_heads=2, context_length=16, vocab_size=65)
    module = LanguageModel(cfg, OptimConfig(), max_steps=1, parallel=ParallelPlan(compile=compile))
    module.configure_model()
    return module


def test_the_loss_is_inside_the_compiled_region() -> None:
    """One graph, no break, and the cross-entropy in it: Inductor can then fuse the head's log-softmax instead of
    materialising fp32 logits (dynamo's own trace, no kernel compilation)."""
    module = _module(compile=True)
    original = module._loss_fn._torchdynamo_orig_callable  # what torch.compile wrapped
    x = torch.randint(0, 65, (2, 16))
    explained = torch._dynamo.explain(original)(x, torch.roll(x, -1, 1))
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    graph = str(explained.graphs[0].graph)
    assert "cross_entropy" in graph and "linear" in graph


def test_compiled_step_trains_like_eager(tmp_path: Path) -> None:
    """The same 3 steps, eager and compiled (Inductor on CPU): the losses agree to float rounding."""
    eager = _fit(tmp_path / "eager", "--train.max_steps", "3", "--checkpoint.enabled", "false")
    compiled = _fit(tmp_path / "compiled", "--train.max_steps", "3", "--checkpoint.enabled", "false",
                    "--train.compile", "true")  # fmt: skip
    assert compiled["train_loss"] == pytest.approx(eager["train_loss"], rel=1e-4)
    # The rule gives 5 warm-up steps with compile, at most max_steps - 1.
    assert compiled["warmup_steps"] == 2 and compiled["measured_steps"] == 1
    summary = json.loads((tmp_path / "compiled" / "summary.json").read_text())
    assert summary["warmup_s"] > summary["step_time_s"]  # compilation is warm-up, not steady state
