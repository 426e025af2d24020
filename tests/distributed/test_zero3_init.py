"""ZeRO-3 builds the model partitioned: under DeepSpeed's `zero.Init` each module is split over the ranks as it is
constructed, then initialised one gathered module at a time with the layout-independent init — so the gathered
weights are bitwise those one process builds whole, and no rank keeps more than its 1/N partition. A pretrained
checkpoint (`model.init_from`) loads into the partitions the same way, bitwise the one-process load."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gaudi3_scale.models import build_model, get_model_config
from hf_checkpoints import load_ours, save_hf_checkpoints

pytestmark = pytest.mark.distributed
pytest.importorskip("deepspeed")

WORKER = Path(__file__).with_name("zero3_init_worker.py")
MODELS = ("llama-tiny", "shakespeare-char")  # untied, and a tied embedding/head


def test_zero3_builds_partitioned_with_the_whole_models_weights(tmp_path: Path) -> None:
    ranks = 2
    hf = save_hf_checkpoints(tmp_path / "hf")["llama-sharded"]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(WORKER), "11",
         str(tmp_path), *MODELS, str(hf)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    # each rank joined its group's threads before exiting (a rank that did not could abort at exit)
    assert [(tmp_path / f"gloo-threads-{rank}").read_text() for rank in range(ranks)] == ["0"] * ranks
    loaded = torch.load(tmp_path / f"{hf.name}.pt", weights_only=True)
    reference = load_ours(hf).state_dict()
    assert loaded["held"] == 0 and loaded["weights"].keys() == reference.keys()
    for key, tensor in reference.items():
        assert torch.equal(loaded["weights"][key], tensor), key
    for name in MODELS:
        whole = build_model(get_model_config(name).resolve_vocab(97), seed=11)
        saved = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        expected = whole.state_dict()
        assert saved["weights"].keys() == expected.keys()
        for key, tensor in expected.items():
            assert torch.equal(saved["weights"][key], tensor), (name, key)
        total = sum(p.numel() for p in whole.parameters())
        assert saved["held"] == 0, name  # nothing whole outside a gather
        # each parameter's partition is ceil(numel / ranks), DeepSpeed's padding included
        expected_partition = sum(-(-p.numel() // ranks) for p in whole.parameters())
        assert saved["partition"] == expected_partition and saved["partition"] <= total / ranks + 64, name
