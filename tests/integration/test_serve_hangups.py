"""`gaudi3 serve` against clients that hang up, trickle, or sit in the listen backlog at shutdown: real server
processes on 127.0.0.1, real sockets, real signals (the findings of the 2026-11-30 concurrency hunt).

Each test starts its own server on the run that `test_serve` trains (imported fixture), with small
`--client-timeout-s` values, so each takes a few seconds.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import select
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_serve import Server, _await_start, _post, _start, _wait_for, run_dir  # noqa: F401

pytestmark = pytest.mark.integration

# one byte this often: far below any --client-timeout-s here, so no single recv ever times out
TRICKLE_INTERVAL_S = 0.3


@pytest.fixture
def serve(run_dir: Path, tmp_path: Path) -> Iterator[Any]:  # noqa: F811
    """Start servers for one test; each is killed at the end, whatever the test did to it."""
    started: list[Server] = []

    def start(*args: str) -> Server:
        stderr_path = tmp_path / f"serve-{len(started)}.err"
        started.append(_await_start(_start([str(run_dir), *args], stderr_path), stderr_path))
        return started[-1]

    yield start
    for server in started:
        if server.proc.poll() is None:
            server.proc.kill()
        server.proc.wait(timeout=30)


def _trickle(port: int, count: int, stop: threading.Event) -> list[socket.socket]:
    """`count` connections that send their head one byte per TRICKLE_INTERVAL_S and never finish it: half in the
    request line, half in a header line. Trickling goes on in a thread until `stop` is set."""
    socks = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(count)]
    for i, sock in enumerate(socks):
        sock.sendall(b"G" if i % 2 else b"POST /v1/completions HTTP/1.0\r\nX-Slow: ")

    def trickle() -> None:
        while not stop.wait(TRICKLE_INTERVAL_S):
            for sock in socks:
                with contextlib.suppress(OSError):  # answered and closed by the server
                    sock.send(b"a")

    threading.Thread(target=trickle, daemon=True).start()
    return socks


def _status_lines(socks: list[socket.socket], until_s: float) -> list[bytes | None]:
    """Each connection's first response line, None for those with none by `until_s` (monotonic)."""
    lines: list[bytes | None] = [None] * len(socks)
    waiting = dict(enumerate(socks))
    while waiting and time.monotonic() < until_s:
        readable, _, _ = select.select(list(waiting.values()), [], [], 0.1)
        for i, sock in list(waiting.items()):
            if sock in readable:
                try:
                    lines[i] = sock.recv(4096).split(b"\r\n", 1)[0]
                except ConnectionError as exc:
                    lines[i] = type(exc).__name__.encode()
                del waiting[i]
    return lines


def test_trickled_heads_get_their_408_on_time(serve: Any) -> None:
    """A byte every 0.3 s keeps every recv within the socket timeout: the deadline must still hold for the head
    as a whole (docs/serving.md: 408 once --client-timeout-s has passed, however slowly the client sends)."""
    server = serve("--client-timeout-s", "1.5")
    stop = threading.Event()
    started_s = time.monotonic()
    socks = _trickle(server.port, 20, stop)
    try:
        lines = _status_lines(socks, started_s + 6.0)
        elapsed_s = time.monotonic() - started_s
    finally:
        stop.set()
        for sock in socks:
            sock.close()
    assert lines == [b"HTTP/1.0 408 Request Timeout"] * 20, lines
    assert 1.4 < elapsed_s < 5.0
    assert server.health()["status"] == "ok"


def test_a_second_sigterm_ends_the_server_despite_trickling_clients(serve: Any) -> None:
    """20 clients trickle their heads with a 60 s deadline: a SIGTERM starts the drain (which would wait its
    grace), a second one ends those connections and the process at once."""
    server = serve("--client-timeout-s", "60")
    stop = threading.Event()
    socks = _trickle(server.port, 20, stop)
    try:
        time.sleep(0.5)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert server.proc.poll() is None  # the first signal drains: it waits for the clients
        server.proc.send_signal(signal.SIGTERM)
        signalled_s = time.monotonic()
        assert server.proc.wait(timeout=10) == 0, server.stderr()
        assert time.monotonic() - signalled_s < 3.0
    finally:
        stop.set()
        for sock in socks:
            sock.close()
    assert server.proc.stdout is not None
    assert "stopped after 0 completions (0 cancelled at shutdown)" in server.proc.stdout.read()


def _send_and_hang_up(port: int, body: dict[str, Any]) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(_post(json.dumps(body).encode()))


def test_requests_of_clients_that_hung_up_leave_the_batch_and_the_queue(serve: Any) -> None:
    """Batch 1, queue 2. A non-streamed request whose client hangs up is cancelled, not decoded to max_tokens; two
    queued requests (streamed and not) whose clients hang up give their places to a live client."""
    server = serve("--max-batch-size", "1", "--max-queue", "2", "--max-tokens-limit", "4096")
    body = {"prompt": "KING", "max_tokens": 4096, "temperature": 0}
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(_post(json.dumps(body).encode()))
        _wait_for(server, "active_requests", 1)  # decoding
    _wait_for(server, "active_requests", 0)  # ~10 s of decoding without the fix; a poll interval with it
    engine = server.health()["engine"]
    assert engine["completed_requests"] == 0 and engine["generated_tokens"] < 4096, engine  # cancelled

    holder = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)  # a live stream holds the batch
    holder.request(
        "POST", "/v1/completions", json.dumps({"prompt": "KING", "max_tokens": 4096, "stream": True})
    )
    response = holder.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: {")
    for stream in (True, False):
        _send_and_hang_up(server.port, {"prompt": "KING", "max_tokens": 4, "stream": stream})
    started_s = time.monotonic()
    while (engine := server.health()["engine"])["queued_requests"] and time.monotonic() - started_s < 3.0:
        time.sleep(0.02)
    assert engine["queued_requests"] == 0, engine

    answers: list[tuple[int, Any]] = []
    live = threading.Thread(target=lambda: answers.append(
        server.request("POST", "/v1/completions", {"prompt": "KING", "max_tokens": 4})))  # fmt: skip
    live.start()
    _wait_for(server, "queued_requests", 1)  # queued, not refused as queue_full
    response.close()
    holder.close()
    live.join(timeout=30)
    assert answers and answers[0][0] == 200, answers
    assert answers[0][1]["usage"]["completion_tokens"] == 4


def test_connections_in_the_listen_backlog_at_sigterm_get_an_answer(serve: Any) -> None:
    """The server is stopped (SIGSTOP) while 100 clients connect and send a request, so the kernel holds them in
    the listen backlog; then SIGTERM and SIGCONT. Each client gets an HTTP answer (200 if its request got in
    before the shutdown, else 503 shutting_down), never a reset."""
    server = serve("--max-batch-size", "4")
    body = _post(json.dumps({"prompt": "KING", "max_tokens": 2}).encode())
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        socks = [socket.create_connection(("127.0.0.1", server.port), timeout=30) for _ in range(100)]
        for sock in socks:
            sock.sendall(body)
        server.proc.send_signal(signal.SIGTERM)
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    lines = _status_lines(socks, time.monotonic() + 30.0)
    for sock in socks:
        sock.close()
    outcomes = {line: lines.count(line) for line in set(lines)}
    assert set(outcomes) <= {b"HTTP/1.0 200 OK", b"HTTP/1.0 503 Service Unavailable"}, outcomes
    assert server.proc.wait(timeout=30) == 0, server.stderr()


def test_a_sigterm_right_after_the_start_line_drains_and_exits_0(serve: Any) -> None:
    """The start line is printed once SIGTERM is handled (a signal sent before that killed the process, which
    resets every connection in the backlog), and an idle server then stops at once."""
    server = serve()
    signalled_s = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=30) == 0, server.stderr()
    assert time.monotonic() - signalled_s < 3.0
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=5)


def test_clients_connecting_through_a_sigterm_get_an_answer_or_a_refusal(serve: Any) -> None:
    """30 clients loop on short requests while SIGTERM arrives: each try ends in an HTTP answer, or in connection
    refused once the listener is closed; never a reset after the kernel accepted the connection."""
    server = serve("--max-batch-size", "4", "--max-queue", "8")
    body = _post(json.dumps({"prompt": "KING", "max_tokens": 2}).encode())
    signalled = threading.Event()
    outcomes: list[str] = []

    def client() -> None:
        deadline_s = time.monotonic() + 20.0
        while time.monotonic() < deadline_s:
            try:
                with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
                    sock.sendall(body)
                    outcome = sock.recv(4096).split(b"\r\n", 1)[0].decode() or "closed without an answer"
            except OSError as exc:
                outcome = type(exc).__name__
            if signalled.is_set():
                outcomes.append(outcome)
            if outcome == "ConnectionRefusedError":
                return

    clients = [threading.Thread(target=client) for _ in range(30)]
    for thread in clients:
        thread.start()
    time.sleep(1.0)
    signalled.set()
    server.proc.send_signal(signal.SIGTERM)
    for thread in clients:
        thread.join(timeout=60)
    counts = {o: outcomes.count(o) for o in set(outcomes)}
    allowed = {"HTTP/1.0 200 OK", "HTTP/1.0 503 Service Unavailable", "ConnectionRefusedError"}
    assert set(counts) <= allowed and counts.get("ConnectionRefusedError") == 30, counts
    assert server.proc.wait(timeout=30) == 0, server.stderr()
