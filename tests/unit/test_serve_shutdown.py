"""The shutdown's backlog step of `gaudi3 serve` when the kernel refuses its socket filter (a seccomp sandbox): the
connections already waiting are still accepted and answered, and nothing raises (a raise there ended the stop
thread before the engine closed, and the server never exited)."""

from __future__ import annotations

import socket

import pytest

from gaudi3_scale.serve import server as serve_server


def test_a_refused_socket_filter_still_answers_the_backlog(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(listener: socket.socket) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(serve_server, "_drop_new_connections", refuse)
    listener = serve_server.CompletionServer(("127.0.0.1", 0), backlog=8, client_timeout_s=1.0)
    clients = [socket.create_connection(listener.server_address[:2]) for _ in range(2)]
    handed: list[object] = []

    def hand_over(request: socket.socket, address: object) -> None:
        handed.append(address)
        request.close()

    monkeypatch.setattr(listener, "process_request", hand_over)
    try:
        assert listener.answer_backlog() == 2 and len(handed) == 2
    finally:
        for client in clients:
            client.close()
        listener.server_close()
