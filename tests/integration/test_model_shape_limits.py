"""A model shape out of bounds (`models.config.MAX_NUM_LAYERS`, `MAX_PARAMETERS`), or a checkpoint config without a
vocabulary, is one line and exit 2 at every entry point that reads a shape: `gaudi3 serve` (an export, a Hugging Face
directory), `model.init_from` (either) and `gaudi3 train --dry-run`. A layer count of 10**9 used to build a module per
layer for minutes while memory grew, so each verb runs in a subprocess with a timeout: a regression fails here
instead of hanging the suite.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gaudi3_scale.artifacts.export import export_checkpoint
from gaudi3_scale.config.core import parse_overrides
from gaudi3_scale.models.config import MAX_NUM_LAYERS, MAX_PARAMETERS
from gaudi3_scale.train import GaudiTrainer, build_run_config

pytestmark = pytest.mark.integration

GAUDI3 = [sys.executable, "-m", "gaudi3_scale.cli"]
# Far above the few seconds a refusal takes (most of it importing torch on a loaded 2-core machine), far below the
# minutes a model of 10**9 layers took to build before it was refused.
TIMEOUT_S = 60
HUGE_LAYERS = 10**9


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `gaudi3 ckpt export` (safetensors format) of a 1-step llama-tiny run on bytes."""
    root = tmp_path_factory.mktemp("limits")
    overrides = ["--out_dir", str(root / "run"), "--train.threads", "2", "--train.max_steps", "1", "--model.name",
                 "llama-tiny", "--train.val_every_steps", "0", "--checkpoint.every_steps", "1",
                 "--data.tokenizer", "byte"]  # fmt: skip
    GaudiTrainer(build_run_config(None, parse_overrides(overrides)), progress=False).fit()
    export_checkpoint(root / "run" / "checkpoints" / "step-00000001", root / "export")
    return root / "export"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("limits-hf") / "llama"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def _edited(source: Path, target: Path, config_name: str, edit: Callable[[dict[str, Any]], None]) -> Path:
    shutil.copytree(source, target)
    config = json.loads((target / config_name).read_text())
    edit(config)
    (target / config_name).write_text(json.dumps(config))
    return target


def _refused(*args: str) -> str:
    """The one stderr line of `gaudi3 ARGS` (exit 2, no traceback, nothing on stdout), within `TIMEOUT_S`."""
    done = subprocess.run([*GAUDI3, *args], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 2 and done.stdout == "", (
        args,
        done.returncode,
        done.stdout,
        done.stderr[-2000:],
    )
    assert done.stderr.startswith("gaudi3: error: ") and done.stderr.count("\n") == 1, (args, done.stderr)
    return done.stderr


def _serve(directory: Path) -> str:
    return _refused("serve", str(directory), "--port", "0")


def _init_from(directory: Path, out: Path) -> str:
    """A real training run (not a dry run) from `directory`: refused before its run directory is written."""
    message = _refused("train", "--model.init_from", str(directory), "--out", str(out), "--train.max_steps", "1",
                       "--no-progress", "--sample-tokens", "0")  # fmt: skip
    assert not out.exists()
    return message


LAYERS = f"is over the limit of {MAX_NUM_LAYERS} layers"


def test_a_huge_layer_count_in_an_export_is_refused_by_serve_and_init_from(
    export: Path, tmp_path: Path
) -> None:
    deep = _edited(export, tmp_path / "deep", "model_config.json", lambda c: c.update(num_layers=HUGE_LAYERS))
    for message in (_serve(deep), _init_from(deep, tmp_path / "run")):
        assert f"{deep / 'model_config.json'}: num_layers: {HUGE_LAYERS} {LAYERS}" in message, message


def test_a_huge_layer_count_in_a_hugging_face_config_is_refused(hf_dir: Path, tmp_path: Path) -> None:
    deep = _edited(
        hf_dir, tmp_path / "deep", "config.json", lambda c: c.update(num_hidden_layers=HUGE_LAYERS)
    )
    for message in (_serve(deep), _init_from(deep, tmp_path / "run")):
        assert f"{deep / 'config.json'}: num_hidden_layers {HUGE_LAYERS} {LAYERS}" in message, message


def test_a_shape_over_the_parameter_limit_is_refused(hf_dir: Path, tmp_path: Path) -> None:
    """Few layers, a vocabulary of 10**12 rows: 6.4e13 parameters, counted from the config without building it."""
    wide = _edited(hf_dir, tmp_path / "wide", "config.json", lambda c: c.update(vocab_size=10**12))
    limit = f"has 64,000,000,018,592 parameters, over the limit of {MAX_PARAMETERS:,}"
    for message in (_serve(wide), _init_from(wide, tmp_path / "run")):
        assert f"{wide / 'config.json'}: the shape (num_layers 2, dim 32, " in message and limit in message, (
            message
        )


def test_train_dry_run_refuses_huge_shapes_before_building(tmp_path: Path) -> None:
    message = _refused("train", "--model.num_layers", "100000000", "--dry-run")
    assert (
        f"model.num_layers: 100000000 {LAYERS} " in message and f"allowed: 1 to {MAX_NUM_LAYERS}" in message
    )
    message = _refused("train", "--model.dim", "10000000", "--model.num_heads", "1", "--model.vocab_size", "256",
                       "--dry-run")  # fmt: skip
    assert "model: the shape (num_layers 4, dim 10000000, ffn_dim 40000000, vocab_size 256" in message
    assert f"over the limit of {MAX_PARAMETERS:,}" in message


def test_an_export_without_a_vocabulary_is_refused_by_serve_and_init_from(
    export: Path, tmp_path: Path
) -> None:
    unsized = _edited(export, tmp_path / "unsized", "model_config.json", lambda c: c.pop("vocab_size"))
    for message in (_serve(unsized), _init_from(unsized, tmp_path / "run")):
        assert (
            f"{unsized / 'model_config.json'}: vocab_size is missing; allowed: a positive integer" in message
        )
    null = _edited(export, tmp_path / "null", "model_config.json", lambda c: c.update(vocab_size=None))
    assert f"{null / 'model_config.json'}: vocab_size is null; allowed: a positive integer" in _serve(null)
