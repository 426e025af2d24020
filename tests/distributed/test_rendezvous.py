"""A launch whose rendezvous is on another machine that does not answer: one line saying which address and how long
it waits, then one error line, exit 2; none of torch's c10d warnings with their C++ frames, no traceback."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

# TEST-NET-1 (RFC 5737): reserved for documentation, never routed, so never a rendezvous. Here a connection to it is
# refused at once; on a network that drops it, each attempt times out instead. Either way it does not answer.
UNREACHABLE = "192.0.2.1:29500"


def test_an_unreachable_rendezvous_is_one_line_naming_it_and_the_wait(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 100)
    cmd = [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(tmp_path / "run"),
           "--data.source", str(text), "--model.num_layers", "1", "--model.dim", "32", "--model.context_length",
           "32", "--train.global_batch_size", "2", "--train.max_steps", "1", "--sample-tokens", "0", "--no-progress",
           "--nproc-per-node", "2", "--rdzv-endpoint", UNREACHABLE, "--parallel.rdzv_timeout_s", "2"]  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    waited_s = time.monotonic() - started
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(lines) == 2 and done.stdout == "", done.stderr[-3000:]
    assert lines[0].startswith(f"gaudi3: the rendezvous at {UNREACHABLE} does not answer (")
    assert lines[0].endswith("); waiting up to 2 s for it (parallel.rdzv_timeout_s)")
    assert lines[1].startswith(
        f"gaudi3: error: parallel.rdzv_endpoint: the rendezvous at {UNREACHABLE} did not answer within 2 s ("
    )
    assert lines[1].endswith(
        "start node 0's `gaudi3 train` (one that started and stopped before opening it said why in its own "
        "output), check the address, or raise parallel.rdzv_timeout_s"
    )
    for noise in ("[c10d]", "frame #", "TCPStore", "Traceback", "torch/distributed"):
        assert noise not in done.stderr
    assert waited_s >= 2
    assert not (tmp_path / "run").exists()  # the run directory it would have made is gone again


def test_nodes_that_do_not_all_join_are_one_line_after_the_timeout(tmp_path: Path) -> None:
    """This node hosts the rendezvous (its endpoint is here) and the other never joins (it was not started, or it
    stopped before joining): one line once parallel.rdzv_timeout_s is up, exit 2; not torch's RendezvousTimeoutError
    traceback, nor its warning that the c10d rendezvous ignores --node-rank."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cmd = [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(tmp_path / "run"), "--model.num_layers",
           "1", "--train.max_steps", "1", "--sample-tokens", "0", "--no-progress", "--nnodes", "2", "--node-rank",
           "1", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--parallel.rdzv_timeout_s", "2"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [
        f"gaudi3: error: parallel.rdzv_timeout_s: 2 nodes did not all join the rendezvous at 127.0.0.1:{port} "
        "within 2 s; start the same `gaudi3 train` on every node (one that stopped before joining said why in its "
        "own output), or raise parallel.rdzv_timeout_s"
    ]


def test_a_node_waits_for_a_rendezvous_that_opens_later(capsys: pytest.CaptureFixture[str]) -> None:
    """Nodes start in any order: the wait ends as soon as node 0 listens, after one line saying it waits."""
    from gaudi3_scale.distributed.rendezvous import wait_for_rendezvous

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: a connection there is refused until the listener below
    listener = socket.socket()
    opener = threading.Timer(1.5, lambda: (listener.bind(("127.0.0.1", port)), listener.listen()))
    opener.start()
    try:
        started = time.monotonic()
        wait_for_rendezvous("127.0.0.1", port, 30)
        assert 1.5 <= time.monotonic() - started < 10
    finally:
        opener.join()
        listener.close()
    err = capsys.readouterr().err
    assert err == (
        f"gaudi3: the rendezvous at 127.0.0.1:{port} does not answer (Connection refused); waiting up to 30 s for "
        "it (parallel.rdzv_timeout_s)\n"
    )
