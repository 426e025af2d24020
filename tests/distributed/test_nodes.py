"""Two nodes on this machine (two `gaudi3 train` launchers, one rank each, meeting at a rendezvous on 127.0.0.1),
each with its own --out, as node-local disks are (`train.nodes`).

Without a shared --out or a remote mirror the run is refused before it trains: only rank 0's node would hold the
checkpoints. With `checkpoint.remote_url` it trains, and a restart resumes every node from the same checkpoint (the
other node fetches what rank 0 uploaded); when the mirror is behind (one node would resume from an older step),
the restart is one line on both nodes, exit 143 (restartable), instead of gloo aborting on mismatched
collectives, and the relaunch, once rank 0 has uploaded as it stopped, resumes both from the newest."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from gaudi3_scale.train.nodes import MirrorBehindError, RankView, nodes_problem
from two_nodes import start_two_nodes

pytestmark = pytest.mark.distributed

TINY = ["--model.name=llama-tiny", "--model.num_layers=1", "--train.val_every_steps=0", "--train.threads=1",
        "--train.log_every_steps=1", "--sample-tokens=0", "--no-progress", "--checkpoint.every_steps=2"]  # fmt: skip


def _start(outs: tuple[Path, Path], *args: str) -> list[subprocess.Popen[str]]:
    """Node 0 and node 1 (`two_nodes.start_two_nodes`), each with its own --out."""

    def command(node: int, port: int) -> list[str]:
        return [sys.executable, "-m", "gaudi3_scale.cli", "train", *TINY, "--out", str(outs[node]), "--nnodes", "2",
                "--node-rank", str(node), "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", *args]  # fmt: skip

    return start_two_nodes(command)


def _pair(outs: tuple[Path, Path], *args: str) -> list[subprocess.CompletedProcess[str]]:
    """Both nodes to the end; (node 0's, node 1's) results."""
    procs = _start(outs, *args)
    done = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=300)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    finally:
        for proc in procs:  # never leave an agent waiting for a rendezvous behind
            if proc.poll() is None:
                proc.kill()
    return done


def _error_lines(done: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in done.stderr.splitlines() if line.startswith("gaudi3: error:")]


def _trained_steps(outs: tuple[Path, Path]) -> list[int]:
    """The steps rank 0 logged, whichever node it ran on (the rendezvous orders the nodes, not --node-rank)."""
    (metrics,) = [out / "metrics.jsonl" for out in outs if (out / "metrics.jsonl").is_file()]
    return [r["step"] for r in map(json.loads, metrics.read_text().splitlines()) if "train_loss" in r]


def test_node_local_out_without_a_mirror_is_refused_before_training(tmp_path: Path) -> None:
    outs = (tmp_path / "node0", tmp_path / "node1")
    for done, out in zip(_pair(outs, "--train.max_steps=4"), outs, strict=True):
        assert done.returncode == 2, done.stderr[-3000:]
        (line,) = _error_lines(done)
        assert line == (
            f"gaudi3: error: --out {out} is not one directory for all nodes: rank 1 (on {_host()}) does not see the "
            "files rank 0 writes there, so only rank 0's node could resume from its checkpoints; put --out on "
            "storage every node mounts, or set checkpoint.remote_url, which the other nodes resume from"
        )
        assert "Traceback" not in done.stderr and not (out / "checkpoints").exists()


def test_node_local_out_with_a_mirror_resumes_every_node_from_the_same_checkpoint(tmp_path: Path) -> None:
    outs, remote = (tmp_path / "node0", tmp_path / "node1"), tmp_path / "remote"
    mirror = f"--checkpoint.remote_url=file://{remote}"
    assert all(done.returncode == 0 for done in _pair(outs, mirror, "--train.max_steps=4"))
    assert (remote / "latest").read_text().strip() == "step-00000004"
    # The mirror one checkpoint behind: the node without a copy of its own fetches step 2, rank 0's has step 4.
    shutil.rmtree(remote / "step-00000004")
    (remote / "latest").write_text("step-00000002\n")
    for done in _pair(outs, mirror, "--train.max_steps=6"):
        assert done.returncode == 143, done.stderr[
            -3000:
        ]  # restartable: the relaunch below is what resolves it
        (line,) = _error_lines(done)
        assert "the ranks would resume from different checkpoints (" in line and "step-00000002" in line
        assert "step-00000004" in line and line.endswith(
            "checkpoint.remote_url is behind the newest; rank 0 uploads it as it stops and a relaunch fetches it: "
            "exit 143 (restartable)"
        )
        assert "Traceback" not in done.stderr and "gloo" not in done.stderr
    assert (remote / "latest").read_text().strip() == "step-00000004"  # rank 0 uploaded it as it stopped
    assert all(done.returncode == 0 for done in _pair(outs, mirror, "--train.max_steps=6"))
    assert _trained_steps(outs) == [1, 2, 3, 4, 5, 6]  # steps 5 and 6 resumed from step 4 on both nodes
    for out in outs:
        assert (out / "checkpoints" / "step-00000004" / "manifest.json").is_file()


def test_a_node_that_dies_stops_the_other_restartably_and_both_resume(tmp_path: Path) -> None:
    """Node 1's launcher and rank, killed together (its machine lost) after a checkpoint: node 0's next collective
    fails; one line naming the checkpoint to resume from, exit 143, which Kubeflow's ExitCode policy and torchrun's
    agent restart (gloo's traceback and exit 1 failed the whole job); the rerun resumes both nodes from it."""
    out = tmp_path / "shared"  # one --out for both nodes, as on NFS
    procs = _start((out, out), "--train.max_steps=100000", "--checkpoint.every_steps=20")
    deadline = time.monotonic() + 120
    while not (out / "checkpoints" / "latest").is_file():
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline
        time.sleep(0.1)
    # every process of node 1: the launcher and the rank it started
    node1 = [*psutil.Process(procs[1].pid).children(recursive=True), psutil.Process(procs[1].pid)]
    for proc in node1:
        proc.kill()
    _, stderr = procs[0].communicate(timeout=120)
    procs[1].communicate(timeout=60)
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert procs[0].returncode == 143, stderr[-3000:]
    (line,) = [line for line in stderr.splitlines() if line.startswith("gaudi3: error:")]
    assert line.startswith("gaudi3: error: lost another rank (") and "Traceback" not in stderr
    assert line.endswith(
        "exit 143 (restartable): run the same command on every node to resume from the last committed checkpoint "
        f"({latest} in this node's --out)"
    )
    step = int(latest.removeprefix("step-"))
    resumed = _pair(
        (out, out), f"--train.max_steps={step + 2}", "--checkpoint.every_steps=20", "--sample-tokens=8"
    )
    assert all(done.returncode == 0 for done in resumed), (
        resumed[0].stderr[-3000:] + resumed[1].stderr[-3000:]
    )
    # one --out: only the launcher of the node where rank 0 ran samples from the run's checkpoint
    assert [done.stdout.count("---- sample ----") for done in resumed] in ([1, 0], [0, 1])
    assert _trained_steps((out, tmp_path / "none"))[-2:] == [step + 1, step + 2]


def _host() -> str:
    return socket.gethostname()


def test_a_view_of_the_nodes_names_what_is_wrong() -> None:
    """The decision itself, for the layouts the runs above do not launch (a sharded run, one without checkpoints)."""
    out = Path("/data/run")
    blind = [RankView(0, "a", True, None), RankView(1, "b", False, None), RankView(2, "b", False, None)]
    fsdp = nodes_problem(blind, out_dir=out, per_rank_files="parallel.strategy fsdp", remote_url="s3://b/run",
                         checkpoints=True)  # fmt: skip
    assert fsdp == (
        "--out /data/run is not one directory for all nodes: ranks 1, 2 (on b) do not see the files rank 0 writes "
        "there, and with parallel.strategy fsdp every rank writes its part of each checkpoint there for rank 0 to "
        "commit; put --out on storage every node mounts (NFS, a shared volume)"
    )
    assert (
        nodes_problem(blind, out_dir=out, per_rank_files=None, remote_url="s3://b/run", checkpoints=True)
        is None
    )
    assert nodes_problem(blind, out_dir=out, per_rank_files="x", remote_url=None, checkpoints=False) is None
    shared = [RankView(0, "a", True, "step-00000004"), RankView(1, "b", True, "step-00000004")]
    assert nodes_problem(shared, out_dir=out, per_rank_files="x", remote_url=None, checkpoints=True) is None
    apart = [RankView(0, "a", True, "step-00000004"), RankView(1, "b", True, None)]
    with pytest.raises(
        MirrorBehindError, match=r"\(rank 0 \(on a\): step-00000004; rank 1 \(on b\): no checkpoint"
    ):
        nodes_problem(apart, out_dir=out, per_rank_files=None, remote_url="s3://b/run", checkpoints=True)
    assert nodes_problem(apart, out_dir=out, per_rank_files=None, remote_url=None, checkpoints=True) == (
        "the ranks would resume from different checkpoints (rank 0 (on a): step-00000004; rank 1 (on b): no "
        "checkpoint (from scratch)); every node must see the same: put --out on storage every node mounts, or set "
        "checkpoint.remote_url"
    )
