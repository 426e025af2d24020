"""Two nodes on this machine: two `gaudi3 train` launchers meeting at a rendezvous on 127.0.0.1."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable

__all__ = ["start_two_nodes"]


def start_two_nodes(
    command: Callable[[int, int], list[str]], timeout_s: float = 120.0
) -> list[subprocess.Popen[str]]:
    """Node 0's launcher (`command(node, port)`), then node 1's once node 0's rendezvous store listens on `port`:
    on a real cluster only node 0 has that address; here both could host it, and node 1 hosting it first would
    leave node 0 finding its port taken. Both killed if node 0 stops or the store does not listen in time."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    def start(node: int) -> subprocess.Popen[str]:
        return subprocess.Popen(
            command(node, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    first = start(0)
    deadline = time.monotonic() + timeout_s
    while True:
        if first.poll() is not None or time.monotonic() > deadline:
            first.kill()
            raise AssertionError(f"node 0 did not open the rendezvous: {first.communicate()}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return [first, start(1)]
        time.sleep(0.1)
