"""`model.init_from` on 2 ranks: HF Llama, GPT-2 and Mixtral (FSDP only) checkpoints (several shard files) load into FSDP2 shards and
into a tensor-parallel layout (Shard(0) and Shard(1) placements, the 257 vocabulary rows split unevenly) with transformers' logits,
and the gathered weights are bitwise those one process loads — also in FSDP-over-TP's _StridedShard layout, whose
rows are interleaved. One torchrun launch for everything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_checkpoints import hf_model, load_ours, save_hf_checkpoints

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("load_pretrained_shards.py")
ATOL = 1e-5  # fp32, against transformers' kernels


def test_fsdp_and_tensor_parallel_shards_load_transformers_weights(tmp_path: Path) -> None:
    dirs = save_hf_checkpoints(tmp_path / "hf")
    names = ("llama-sharded", "gpt2-sharded", "llama-tied-bias", "mixtral-sharded")
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER), str(out),
         *(str(dirs[name]) for name in names)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the meshes live on in DTensor's caches; their groups, and so gloo's threads, must not
    assert [(out / f"gloo-threads-{rank}").read_text() for rank in range(2)] == ["0", "0"]
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))  # the worker's TOKENS
    for name in names:
        saved = torch.load(out / f"{name}.pt", weights_only=True)
        whole = load_ours(dirs[name])
        with torch.no_grad():
            expected = hf_model(dirs[name])(tokens).logits
        for layout in [layout for layout in ("fsdp", "tp", "run_tp") if layout in saved]:
            torch.testing.assert_close(
                saved[layout]["logits"], expected, atol=ATOL, rtol=0, msg=(name, layout)
            )
            assert saved[layout]["weights"].keys() == dict(whole.named_parameters()).keys()
            for key, tensor in whole.named_parameters():
                got = saved[layout]["weights"][key][
                    : tensor.shape[0]
                ]  # run_tp: padding rows beyond the vocab
                assert torch.equal(got, tensor), (name, layout, key)
        if "strided" in saved:  # interleaved rows (FSDP over tensor parallel): weights only
            assert any("_StridedShard" in p for p in saved["strided"]["placements"]), name
            for key, tensor in whole.named_parameters():
                assert torch.equal(saved["strided"]["weights"][key], tensor), (name, "strided", key)
        assert saved["fsdp"]["placements"] == ["(Shard(dim=0),)"]
        if name == "mixtral-sharded":  # 4 experts, 2 per rank, each read from its own stored tensors
            assert saved["fsdp"]["weights"]["layers.0.feed_forward.experts.w1"].shape == (4, 32, 64)
            continue
        assert {"(Shard(dim=0),)", "(Shard(dim=1),)"} <= set(saved["tp"]["placements"]), name
    assert all("run_tp" in torch.load(out / f"{n}.pt", weights_only=True) for n in names if "llama" in n)
    assert "tp" not in torch.load(out / "mixtral-sharded.pt", weights_only=True)
