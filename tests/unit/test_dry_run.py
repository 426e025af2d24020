"""`gaudi3 train --dry-run`: llama3-70b built on meta, its shards planned for 64 ranks and each rank's peak
estimated, in seconds, with nothing allocated or written."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from gaudi3_scale.distributed.plan import BatchPlan, ParallelPlan
from gaudi3_scale.distributed.shard_plan import parameter_bytes_per_rank
from gaudi3_scale.models import build_model, get_model_config
from gaudi3_scale.tune.memory import estimate_memory


def test_dry_run_plans_llama3_70b_on_64_ranks_without_allocating(tmp_path: Path) -> None:
    args = ["train", "--dry-run", "--model.name", "llama3-70b", "--parallel.strategy", "fsdp", "--nproc-per-node",
            "8", "--nnodes", "8", "--rdzv-endpoint", "node0:29500", "--train.device", "cuda", "--train.precision",
            "bf16-mixed", "--train.global_batch_size", "512", "--train.micro_batch_size", "1",
            "--parallel.activation_checkpointing", "true", "--out", str(tmp_path / "run")]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "gaudi3_scale.cli", *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert (
        "llama3-70b (70.6 B parameters" in out and "fsdp on 64 rank(s) (8 node(s)), bf16-mixed, cuda" in out
    )
    assert "batch 512 = micro-batch 1 × accumulation 8 × 64 rank(s), context 8192" in out
    with torch.device("meta"):
        model = build_model(get_model_config("llama3-70b"))
    count = sum(p.numel() for p in model.parameters())
    rank0 = parameter_bytes_per_rank(model, ParallelPlan(strategy="fsdp", world_size=64), element_bytes=4)[0]
    assert f"parameters per rank: {rank0 / 2**30:.2f} GiB on rank 0" in out
    assert f"whole model {count * 4 / 2**30:.2f} GiB" in out
    peak = re.search(r"estimated peak per rank: ([\d.]+) GiB at (\w[\w ]*) \(", out)
    assert peak is not None and 0 < float(peak.group(1)) < 80, out
    assert not (tmp_path / "run").exists()  # nothing written


def test_shard_plan_matches_each_strategys_layout() -> None:
    with torch.device("meta"):
        model = build_model(get_model_config("llama-tiny").resolve_vocab(97))
    total = sum(p.numel() for p in model.parameters()) * 4
    fsdp = parameter_bytes_per_rank(model, ParallelPlan(strategy="fsdp", world_size=3), element_bytes=4)
    assert sum(fsdp) == total and max(fsdp) - min(fsdp) > 0  # dim-0 chunks: the last rank gets fewer rows
    zero3 = parameter_bytes_per_rank(
        model, ParallelPlan(strategy="deepspeed_zero3", world_size=3), element_bytes=4
    )
    assert zero3 == [math.ceil(total / 4 / 3) * 4] * 3
    ddp = parameter_bytes_per_rank(model, ParallelPlan(strategy="ddp", world_size=3), element_bytes=2)
    assert ddp == [total // 2] * 3


def test_dry_run_shows_tensor_parallel_hsdp_and_offload(
    gaudi3_cli: Callable[..., tuple[int, str, str]],
) -> None:
    args = ["train", "--dry-run", "--model.name", "llama3-70b", "--parallel.strategy", "fsdp", "--nproc-per-node", "8", "--nnodes", "8",
            "--rdzv-endpoint", "node0:29500", "--train.device", "cuda", "--train.precision", "bf16-mixed",
            "--train.global_batch_size", "64", "--train.micro_batch_size", "1", "--parallel.tp_size", "8",
            "--parallel.dp_replicate", "8", "--parallel.offload", "all", "--parallel.activation_checkpointing",
            "true"]  # fmt: skip
    code, out, err = gaudi3_cli(*args)
    assert code == 0, out + err
    assert "fsdp on 64 rank(s) (8 node(s))" in out
    assert "× 8 rank(s), context 8192" in out  # 64 ranks in tensor-parallel groups of 8 read 8 batches
    assert "layout: tensor parallel 8 × HSDP replicas 8 × shards 1, offload all" in out
    with torch.device("meta"):
        model = build_model(get_model_config("llama3-70b"))
    plan = ParallelPlan(strategy="fsdp", world_size=64, tp_size=8, dp_replicate=8, offload="all")
    per_rank = parameter_bytes_per_rank(model, plan, element_bytes=4)
    assert f"parameters per rank: {per_rank[0] / 2**30:.2f} GiB on rank 0" in out
    assert "held in host memory (offload all)" in out
    est = estimate_memory(
        get_model_config("llama3-70b"),
        ParallelPlan.build(strategy="fsdp", world_size=64, activation_checkpointing=True, tp_size=8, dp_replicate=8,
                           offload="all"),
        BatchPlan.from_micro_batch(1, data_parallel_size=8), precision="bf16-mixed", device_kind="cuda",
    )  # fmt: skip
    assert f"estimated peak per rank: {est.total_bytes / 2**30:.2f} GiB" in out
    assert (
        f"offloaded to host memory: {est.host_bytes / 2**30:.2f} GiB per rank, "
        f"{8 * est.host_bytes / 2**30:.2f} GiB per node of 8 rank(s)"
    ) in out


def test_shard_plan_under_tensor_parallel_and_hsdp() -> None:
    with torch.device("meta"):
        model = build_model(get_model_config("llama-tiny").resolve_vocab(96))
    params = dict(model.named_parameters())
    total = sum(p.numel() for p in params.values()) * 4
    norms = sum(p.numel() for p in params.values() if p.ndim == 1) * 4
    # HSDP: each replica of 2 ranks holds the whole model once
    hsdp = parameter_bytes_per_rank(
        model, ParallelPlan(strategy="fsdp", world_size=4, dp_replicate=2), element_bytes=4
    )
    assert hsdp[0] + hsdp[1] == hsdp[2] + hsdp[3] == total
    # tensor parallel 2 alone: every matrix halved (wo/w2 by columns, the rest by rows), the norms whole
    tp = parameter_bytes_per_rank(
        model, ParallelPlan(strategy="fsdp", world_size=2, tp_size=2), element_bytes=4
    )
    assert tp == [(total - norms) // 2 + norms] * 2


def test_dry_run_of_the_default_single_process_run(tmp_path: Path) -> None:
    """`auto` on one process resolves to a single device; the estimate takes the config's strategy, not the
    resolved name (which is not a config value)."""
    args = ["train", "--dry-run", "--out", str(tmp_path / "run")]
    proc = subprocess.run([sys.executable, "-m", "gaudi3_scale.cli", *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "single on 1 rank(s)" in proc.stdout and "estimated peak per rank:" in proc.stdout
    assert not (tmp_path / "run").exists()


def test_a_cpu_dry_run_says_the_resident_peak_tune_and_plan_hold_against_a_budget(tmp_path: Path) -> None:
    """On a CPU what a rank takes from the OS includes what glibc keeps of freed memory: `train --dry-run` shows
    that number, the one tune prunes with and plan forecasts (tune.memory.process_peak_bytes), beside the estimate;
    with MALLOC_MMAP_THRESHOLD_ set glibc keeps nothing and the line is left out."""
    args = ["train", "--dry-run", "--model.name=llama-tiny", "--out", str(tmp_path / "run")]
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    proc = subprocess.run(
        [sys.executable, "-m", "gaudi3_scale.cli", *args], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr
    estimate = float(re.search(r"estimated peak per rank: ([\d.]+) GiB", proc.stdout)[1])  # type: ignore[index]
    resident = re.search(r"peak resident set per rank: ([\d.]+) GiB \(with the ([\d.]+) GiB", proc.stdout)
    assert resident is not None, proc.stdout
    assert float(resident[1]) > estimate and float(resident[1]) == pytest.approx(
        estimate + float(resident[2]), abs=0.011
    )
    env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    proc = subprocess.run(
        [sys.executable, "-m", "gaudi3_scale.cli", *args], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0 and "peak resident set" not in proc.stdout, proc.stdout


def test_dry_run_of_a_pipeline_names_the_rank_it_estimates(tmp_path: Path) -> None:
    """llama3-405b with TP 8 × PP 8 (the Llama 3 split) × FSDP 2 on 16 nodes: the peak is the pipeline rank's with
    the most, and says which one and how many micro-batches it holds."""
    args = ["train", "--dry-run", "--model.name", "llama3-405b", "--nproc-per-node", "8", "--nnodes", "16",
            "--rdzv-endpoint", "node0:29500", "--train.device", "cuda", "--train.precision", "bf16-mixed",
            "--train.global_batch_size", "64", "--train.micro_batch_size", "1", "--parallel.tp_size", "8",
            "--parallel.pp_size", "8", "--parallel.pp_split", "[15,31,47,63,79,95,111]",
            "--parallel.activation_checkpointing", "true", "--data.tokenizer", "gpt2",
            "--out", str(tmp_path / "run")]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "gaudi3_scale.cli", *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    plan = ParallelPlan.build(strategy="fsdp", world_size=128, tp_size=8, pp_size=8, activation_checkpointing=True,
                              pp_split=(15, 31, 47, 63, 79, 95, 111))  # fmt: skip
    batch = BatchPlan.from_micro_batch(1, accumulation=32, data_parallel_size=2, context_length=8192)
    est = estimate_memory(
        get_model_config("llama3-405b"), plan, batch, precision="bf16-mixed", device_kind="cuda"
    )
    assert (
        f"estimated peak per rank on pipeline rank {est.pp_rank} (the largest; stages {est.pp_rank}, "
        f"{8 - est.pp_rank} micro-batch(es) in flight under 1f1b): {est.total_bytes / 2**30:.2f} GiB"
    ) in proc.stdout
