"""Meta-device construction and per-shard materialisation: the weights do not depend on the number of ranks.

Each world size builds the model on meta, shards it with FSDP2, allocates and initialises only its shards; the
gathered weights must be bitwise the weights one process builds whole, and a rank must hold about 1/N of them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gaudi3_scale.models import build_model, get_model_config

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("materialize_shards.py")


@pytest.mark.parametrize("model_name", ["llama-tiny", "shakespeare-char"])  # untied, and tied embedding/head
def test_sharded_init_is_bitwise_the_whole_models(model_name: str, tmp_path: Path) -> None:
    whole = build_model(get_model_config(model_name).resolve_vocab(97), seed=11)
    expected = {name: t for name, t in whole.state_dict().items()}
    total_bytes = sum(p.numel() * p.element_size() for p in whole.parameters())
    for ranks in (1, 2, 4):
        out = tmp_path / f"w{ranks}.pt"
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", str(WORKER),
             model_name, "11", str(out)],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        saved = torch.load(out, weights_only=True)
        assert saved["weights"].keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(saved["weights"][name], tensor), (ranks, name)
        # Rank 0 holds its shards only: about 1/N of the parameters (dim-0 chunks round up).
        assert saved["local_bytes"] <= total_bytes / ranks * 1.1 + 4096, (
            ranks,
            saved["local_bytes"],
            total_bytes,
        )
