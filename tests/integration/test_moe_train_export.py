"""moe-tiny trains on CPU (the loss falls, the router losses are logged) and its checkpoint exports as a Hugging Face
`MixtralForCausalLM` that transformers loads with our logits, and that reads back into our model bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import MixtralForCausalLM

from gaudi3_scale.artifacts.export import load_exported
from gaudi3_scale.artifacts.inference import load_for_generation
from gaudi3_scale.cli.main import main

pytestmark = pytest.mark.integration

ATOL = 1e-5  # fp32; SDPA vs HF eager attention, rotation order: close, not bitwise


def test_moe_tiny_trains_and_exports_as_mixtral(tmp_path: Path) -> None:
    train = ["train", "--model.name", "moe-tiny", "--train.max_steps", "15", "--optim.warmup_steps", "1",
             "--train.val_every_steps", "0", "--sample-tokens", "0", "--no-progress", "--train.log_every_steps", "1",
             "--checkpoint.every_steps", "15", "--out", str(tmp_path / "run")]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "gaudi3_scale.cli", *train], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train_loss" in r]
    assert len(steps) == 15 and steps[-1]["train_loss"] < steps[0]["train_loss"] - 0.5
    assert all(1.9 < r["train/moe_aux_loss"] < 2.5 and r["train/moe_z_loss"] > 0 for r in steps)

    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000015"
    main(
        ["ckpt", "export", str(checkpoint), "--out", str(tmp_path / "hf"), "--format", "hf"]
    )  # returns on success
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["architectures"], config["num_local_experts"], config["num_experts_per_tok"]) == (
        ["MixtralForCausalLM"], 8, 2)  # fmt: skip
    ours, _ = load_for_generation(checkpoint)
    hf, info = MixtralForCausalLM.from_pretrained(
        tmp_path / "hf", local_files_only=True, output_loading_info=True
    )
    assert not any(info.values()), info  # no missing, unexpected or mismatched weight
    tokens = torch.randint(0, 65, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = ours(tokens)
        torch.testing.assert_close(hf.eval()(tokens).logits, logits, atol=ATOL, rtol=0)
        assert torch.equal(load_exported(tmp_path / "hf")(tokens), logits)  # and back, exactly
