"""Wait for a rendezvous hosted on another machine before torch's elastic agent connects to it.

Node 0's `gaudi3 train` hosts the c10d rendezvous at `parallel.rdzv_endpoint`; the other nodes connect to it as TCP
clients. torch's client retries an address that does not answer for its read timeout (60 s) and then prints each
failed attempt with its C++ frames (33 lines for the first) and ends in a Python traceback. The launcher therefore
tries HOST:PORT itself first, about once a second: it says once, in one line, which address does not answer and
how long it will wait (`parallel.rdzv_timeout_s`), and gives up with one error line. torch is handed only an
endpoint that accepts connections, so its own messages (real errors after that point) stay as they are.
"""

from __future__ import annotations

import socket
import sys
import time

from gaudi3_scale.config.errors import ConfigError

__all__ = ["hosted_here", "wait_for_rendezvous"]

_ATTEMPT_S = 5.0  # one connection attempt: how long a dropped SYN (no route, a firewall) is given
_RETRY_S = 1.0  # between attempts that failed at once (refused: node 0 has not started yet)


def hosted_here(host: str) -> bool:
    """Whether torch's agent on this machine would host the rendezvous store at `host` (its own test, so the two
    never disagree: `localhost`, a loopback address, this machine's name or one of its addresses)."""
    # A private helper of torch's c10d rendezvous backend (present in 2.x); the public API has no equivalent.
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    return bool(_matches_machine_hostname(host))


def _connect_problem(host: str, port: int, timeout_s: float) -> str | None:
    """None when `host:port` accepts a TCP connection, else why not, in a few words."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except socket.gaierror as exc:
        return f"{host!r} does not resolve: {exc.strerror}"
    except TimeoutError:
        return f"no answer within {timeout_s:.2g} s"
    except OSError as exc:
        return exc.strerror or type(exc).__name__


def wait_for_rendezvous(host: str, port: int, timeout_s: float) -> None:
    """Return once `host:port` accepts a connection; `ConfigError` naming it after `timeout_s` seconds."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    deadline = time.monotonic() + timeout_s
    waiting = False
    while True:
        attempt_s = min(_ATTEMPT_S, max(0.1, deadline - time.monotonic()))
        problem = _connect_problem(host, port, attempt_s)
        if problem is None:
            return
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            raise ConfigError(
                "parallel.rdzv_endpoint",
                f"the rendezvous at {where} did not answer within {timeout_s:g} s ({problem}); start node 0's "
                "`gaudi3 train` (one that started and stopped before opening it said why in its own output), "
                "check the address, or raise parallel.rdzv_timeout_s",
            )
        if not waiting:
            print(
                f"gaudi3: the rendezvous at {where} does not answer ({problem}); waiting up to {timeout_s:g} s "
                "for it (parallel.rdzv_timeout_s)",
                file=sys.stderr,
                flush=True,
            )
            waiting = True
        time.sleep(min(_RETRY_S, left_s))
