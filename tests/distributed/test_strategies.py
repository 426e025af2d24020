"""Every strategy on 2 real ranks (gloo) matches the single-process run; bad launches get one line and exit 2."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from gaudi3_scale.artifacts.inference import load_for_generation
from gaudi3_scale.checkpoint.reader import read_checkpoint
from two_nodes import start_two_nodes

pytestmark = pytest.mark.distributed

GAUDI3 = [sys.executable, "-m", "gaudi3_scale.cli"]
COMMON = ["--train.max_steps", "12", "--train.log_every_steps", "1", "--train.val_every_steps", "0",
          "--sample-tokens", "0", "--no-progress", "--train.global_batch_size", "8", "--optim.warmup_steps", "2",
          "--train.micro_batch_size", "2", "--checkpoint.every_steps", "6"]  # fmt: skip
# 12 steps, a checkpoint at 6 and 12: DeepSpeed steps take ~0.6 s each on 2 cores, and every assertion below holds
# from step 6 on (the loss falls by more than 0.5 in the first five steps).
STEPS, MID, END = 12, "step-00000006", "step-00000012"
STRATEGIES = ["ddp", "fsdp", "fsdp_grad_op", "deepspeed_zero2", "deepspeed_zero3"]


def _train(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*GAUDI3, "train", "--out", str(out), *COMMON, *args], capture_output=True, text=True
    )


def _losses(out: Path) -> list[float]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["train_loss"] for line in lines if "train_loss" in line]


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("single")
    proc = _train(out, "--train.threads", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _train_two_nodes(out: Path) -> None:
    """DDP on 2 nodes of 1 rank each, both on loopback: `gaudi3 train --nnodes 2 --node-rank N` twice."""
    # The threads `--nproc-per-node 2` gives each of its ranks (half the usable cores): the same kernels, so the
    # single-node resume below matches bit for bit.
    threads = str(max(1, len(os.sched_getaffinity(0)) // 2))

    def command(node: int, port: int) -> list[str]:
        return [*GAUDI3, "train", "--out", str(out), *COMMON, "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--parallel.strategy", "ddp", "--train.threads", threads,
                "--node-rank", str(node)]  # fmt: skip

    nodes = start_two_nodes(command)
    try:
        outputs = [node.communicate(timeout=300) for node in nodes]
    finally:
        for node in nodes:  # never leave an agent waiting for a rendezvous behind
            if node.poll() is None:
                node.kill()
    for node, (_, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, err[-3000:]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The uninterrupted 2-rank run of a strategy, trained once and shared (read-only) by the tests below.

    DDP's 2 ranks run as 2 nodes of 1 rank on loopback: the tests below then show that the multi-node launch
    trains like one process and that `--nproc-per-node 2` on one node resumes its checkpoint bit for bit (one
    2-rank launch fewer; `--nproc-per-node 2` DDP from scratch runs in the bf16 test, and in test_elastic_restart,
    test_preemption and test_benchmark)."""
    runs: dict[str, Path] = {}

    def run(strategy: str) -> Path:
        if strategy not in runs:
            out = tmp_path_factory.mktemp(f"two-ranks-{strategy}")
            if strategy == "ddp":
                _train_two_nodes(out)
            else:
                proc = _train(out, "--nproc-per-node", "2", "--parallel.strategy", strategy)
                assert proc.returncode == 0, proc.stderr[-3000:]
                # every strategy lets go of its groups before the ranks exit (`distributed.teardown`)
                assert "gloo worker threads are still up" not in proc.stderr, proc.stderr[-3000:]
                # the launcher sets the ranks' thread count: torch's agent has no default to warn about
                assert "Setting OMP_NUM_THREADS" not in proc.stderr, proc.stderr[-3000:]
            runs[strategy] = out
        return runs[strategy]

    return run


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_ranks_match_one_process(strategy: str, single: Path, two_ranks: Callable[[str], Path]) -> None:
    run = two_ranks(strategy)
    reference, losses = _losses(single), _losses(run)
    assert len(losses) == len(reference) == STEPS
    for a, b in zip(reference, losses, strict=True):
        assert abs(a - b) <= 1e-5 * abs(a), (strategy, reference, losses)
    last = [
        r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "train_loss" in r
    ][-1]
    per_rank = last["peak_memory_bytes_per_rank"]
    assert len(per_rank) == 2 and min(per_rank) > 50e6 and last["peak_memory_bytes"] == max(per_rank)
    ckpt = f"checkpoints/{END}"  # sharded under FSDP, consolidated by read_checkpoint
    want = read_checkpoint(single / ckpt)["state_dict"]
    got = read_checkpoint(run / ckpt)["state_dict"]
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=key)
    # The (consolidated) checkpoint loads into one process and gives the single-process run's logits.
    tokens = torch.randint(0, 65, (2, 64), generator=torch.Generator().manual_seed(0))
    model_a, _ = load_for_generation(single / ckpt)
    model_b, _ = load_for_generation(run / ckpt)
    with torch.no_grad():
        torch.testing.assert_close(model_b(tokens), model_a(tokens), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_rank_resume_is_bitwise(
    strategy: str,
    two_ranks: Callable[[str], Path],
    tmp_path: Path,
    gaudi3_cli: Callable[..., tuple[int, str, str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stop after step 6 (keep only that checkpoint), resume: the losses equal the uninterrupted run's exactly."""
    full, resumed = two_ranks(strategy), tmp_path / "resumed"
    args = ("--nproc-per-node", "2", "--parallel.strategy", strategy)
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / MID, resumed / "checkpoints" / MID)
    (resumed / "checkpoints" / "latest").write_text(MID + "\n")
    proc = _train(resumed, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _losses(resumed) == _losses(full)[6:]  # steps 7-12 only: it resumed, and bit for bit
    if strategy.startswith("deepspeed"):
        # ZeRO optimizer partitions resume only under the same stage and world size: one line, exit 2. Refused
        # before any worker starts (the launcher's or the single process's preflight), so in this process, each
        # as `gaudi3 train …` would run it; the single process sets torch's thread count first: restored below.
        before = (full / "checkpoints" / END / "state.ckpt").read_bytes()
        monkeypatch.setenv("OMP_NUM_THREADS", "1")  # restored after the test; the preflight overwrites it
        threads = torch.get_num_threads()
        try:
            for other in (
                ("--nproc-per-node", "2", "--parallel.strategy", "ddp"),
                ("--parallel.strategy", strategy),
            ):
                code, _out, err = gaudi3_cli("train", "--out", str(full), *COMMON, *other)
                lines = err.strip().splitlines()
                assert code == 2 and len(lines) == 1, (other, err[-3000:])
                assert f"holds {strategy} optimizer partitions for 2 ranks" in lines[0]
        finally:
            torch.set_num_threads(threads)
        assert (full / "checkpoints" / END / "state.ckpt").read_bytes() == before


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "deepspeed_zero3"])
def test_bf16_mixed_per_strategy_tracks_fp32(strategy: str, single: Path, tmp_path: Path) -> None:
    """bf16: autocast under DDP, FSDP's MixedPrecisionPolicy, DeepSpeed's bf16 engine — each within 2 % of fp32."""
    args = ("--nproc-per-node", "2", "--parallel.strategy", strategy, "--train.precision", "bf16-mixed")
    proc = _train(tmp_path, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference, losses = _losses(single), _losses(tmp_path)
    assert losses != reference  # bf16 really ran
    assert losses == pytest.approx(reference, rel=0.02)
    assert losses[-1] < losses[0] - 0.5


# DeepSpeed's offload config is checked in tests/unit/test_offload_config.py; its 2-rank run (within 1e-5 of the run
# without offload when it was written) costs 45 s of the suite's 2-core budget, so only FSDP2's runs here.
@pytest.mark.parametrize("strategy", ["fsdp"])
def test_cpu_offload_trains_and_checkpoints_as_without_it(
    strategy: str, two_ranks: Callable[[str], Path], tmp_path: Path
) -> None:
    """parallel.offload all: FSDP2's CPUOffloadPolicy (unpinned on a CPU mesh) or DeepSpeed's offload_optimizer +
    offload_param (our AdamW steps the host partitions). On a CPU the host is the device, so the same math runs:
    the losses and the checkpointed weights equal the run without offload — bit for bit under FSDP; DeepSpeed
    accumulates the offloaded gradients in its host fp32 buffers in another order (differences of ~1e-7)."""
    proc = _train(
        tmp_path, "--nproc-per-node", "2", "--parallel.strategy", strategy, "--parallel.offload", "all"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference, losses = _losses(two_ranks(strategy)), _losses(tmp_path)
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.5
    rtol = 0.0 if strategy == "fsdp" else 1e-5
    assert losses == pytest.approx(reference, rel=rtol, abs=0.0)
    ckpt = f"checkpoints/{END}"
    want = read_checkpoint(two_ranks(strategy) / ckpt)["state_dict"]
    got = read_checkpoint(tmp_path / ckpt)["state_dict"]
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=rtol * 10, atol=rtol)


def test_moe_trains_alike_under_ddp_and_fsdp(tmp_path: Path) -> None:
    """moe-tiny (8 experts, top-2) on 2 ranks: FSDP2 (experts sharded on their dim 0, 4 per rank) follows DDP's
    losses, the router losses join the objective and are logged, and the consolidated FSDP checkpoint holds DDP's
    weights. (Two launches, not three: the dense model's single-process equivalence is tested above.)"""
    runs = {name: tmp_path / name for name in ("ddp", "fsdp")}
    for name, out in runs.items():
        proc = _train(out, "--model.name", "moe-tiny", "--train.max_steps", "6", "--checkpoint.every_steps", "6",
                      "--nproc-per-node", "2", "--parallel.strategy", name)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
    reference = _losses(runs["ddp"])
    assert len(reference) == 6 and reference[-1] < reference[0]
    assert _losses(runs["fsdp"]) == pytest.approx(reference, rel=1e-5)
    records = [json.loads(line) for line in (runs["fsdp"] / "metrics.jsonl").read_text().splitlines()]
    aux = [r["train/moe_aux_loss"] for r in records if "train_loss" in r]
    assert len(aux) == 6 and all(1.9 < a < 2.5 for a in aux)  # k = 2 at perfect balance
    ckpt = "checkpoints/step-00000006"
    want = read_checkpoint(runs["ddp"] / ckpt)["state_dict"]
    got = read_checkpoint(runs["fsdp"] / ckpt)["state_dict"]
    assert got.keys() == want.keys() and got["model.layers.0.feed_forward.experts.w1"].shape == (8, 64, 96)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=key)


def test_activation_checkpointing_changes_memory_not_math(single: Path, tmp_path: Path) -> None:
    proc = _train(tmp_path, "--train.threads", "2", "--parallel.activation_checkpointing", "true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _losses(tmp_path) == pytest.approx(_losses(single), rel=1e-6)


def test_bad_launches_are_one_line_and_exit_2(
    gaudi3_cli: Callable[..., tuple[int, str, str]], tmp_path: Path
) -> None:
    """Refused before any worker starts, so in this process (each case as `gaudi3 train …` would run it)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cases = [
            (["--nproc-per-node", "3"], "train.global_batch_size: 8 is not divisible"),
            (["--parallel.strategy", "zero9"], "parallel.strategy: got 'zero9'; allowed: auto, ddp, fsdp"),
            (["--train.device", "cuda"], "train.device: cuda was requested but no CUDA device"),
            (["--train.device", "hpu"], "Gaudi (HPU) was requested but no HPU is usable here"),
            (["--train.hpu_graphs", "true"], "train.hpu_graphs: needs Intel Gaudi (train.device hpu)"),
            (["--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}"], f"port {port} on 127.0.0.1"),
            (["--nnodes", "2"], "parallel.rdzv_endpoint: is required when nnodes > 1"),
        ]
        for args, needle in cases:
            code, _out, err = gaudi3_cli("train", "--out", str(tmp_path / "bad"), *COMMON, *args)
            lines = err.strip().splitlines()
            assert code == 2 and len(lines) == 1 and needle in lines[0], (args, err)
        assert not (tmp_path / "bad" / "checkpoints").exists()


def test_two_nodes_on_loopback_train_and_checkpoint(two_ranks: Callable[[str], Path]) -> None:
    """Both nodes exited 0 (asserted where the fixture ran them); rank 0's node wrote the outputs."""
    run = two_ranks("ddp")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == STEPS and (Path(summary["checkpoint"]) / "manifest.json").is_file()
    assert len(_losses(run)) == STEPS
