"""Meta-device construction and per-shard materialisation: the weights do not depend on the number of ranks.

Each world size builds the model on meta, shards it with FSDP2, allocates and initialises only its shards; the
gathered weights must be bitwise the weights one process builds whole, and a rank must hold about 1/N of them — also
under tensor parallel (TP=2 on 2 ranks, FSDP × TP on 4)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gaudi3_scale.distributed.plan import ParallelPlan
from gaudi3_scale.distributed.shard_plan import parameter_bytes_per_rank
from gaudi3_scale.models import build_model

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("materialize_shards.py")


# untied, a tied embedding/head, and 3 experts: on 2 and 4 ranks they do not divide, so FSDP shards them on dim 1
MODELS = ("llama-tiny", "shakespeare-char", "moe-tiny:num_experts=3")
sys.path.insert(0, str(WORKER.parent))
from materialize_shards import model_config  # noqa: E402


def test_sharded_init_is_bitwise_the_whole_models(tmp_path: Path) -> None:
    for ranks in (1, 2, 4):  # one launch per world size, every model in it
        out = tmp_path / f"w{ranks}"
        out.mkdir()
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(WORKER), "11",
             str(out), *MODELS],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        # the meshes live on in DTensor's caches; their groups, and so gloo's threads, must not
        assert [(out / f"gloo-threads-{rank}").read_text() for rank in range(ranks)] == ["0"] * ranks
        for model_name in MODELS:
            whole = build_model(model_config(model_name), seed=11)
            expected = whole.state_dict()
            total_bytes = sum(p.numel() * p.element_size() for p in whole.parameters())
            saved = torch.load(out / f"{model_name}.pt", weights_only=True)
            assert saved["weights"].keys() == expected.keys()
            for name, tensor in expected.items():
                assert torch.equal(saved["weights"][name], tensor), (ranks, model_name, name)
            # Rank 0 holds its shards only: about 1/N of the parameters (dim-0 chunks round up), exactly what the
            # dry run's shard plan says from the meta model.
            assert saved["local_bytes"] <= total_bytes / ranks * 1.1 + 4096, (
                ranks,
                model_name,
                saved["local_bytes"],
            )
            plan = ParallelPlan(strategy="fsdp", world_size=ranks)
            planned = parameter_bytes_per_rank(whole, plan, element_bytes=4)
            assert saved["local_bytes"] == planned[0] and sum(planned) == total_bytes
            if (
                ranks > 1 and whole.config.arch == "llama" and not whole.config.num_experts
            ):  # tensor parallel (× FSDP on 4 ranks): the same bits
                tp = torch.load(out / f"{model_name}-tp2.pt", weights_only=True)
                assert tp["weights"].keys() == expected.keys()
                for name, tensor in expected.items():
                    assert torch.equal(tp["weights"][name], tensor), (ranks, model_name, "tp2", name)
                assert tp["local_bytes"] <= total_bytes / ranks * 1.1 + 4096, (ranks, tp["local_bytes"])
