"""Start the ranks of a run with torch.distributed's elastic launcher (the machinery behind `torchrun`).

`gaudi3 train --nproc-per-node N …` re-runs itself as `python -m gaudi3_scale.train …` in N workers per node,
with a c10d rendezvous. Inside a worker (LOCAL_RANK is set) nothing is launched again.
"""

from __future__ import annotations

import os
import signal
import socket
import uuid
from collections.abc import Sequence

from gaudi3_scale.config.errors import ConfigError
from gaudi3_scale.distributed.config import ParallelConfig
from gaudi3_scale.distributed.network import apply_network_preset

__all__ = ["EXPLAINED_EXIT_CODES", "RESTARTABLE_EXIT_CODES", "free_port", "inside_launched_worker", "launch"]

RESTARTABLE_EXIT_CODES = {138, 143}  # 128 + SIGUSR1, 128 + SIGTERM: a worker saved a checkpoint and stopped
# Workers exiting with one of these already printed why in one line: 2 bad input, 3 cost budget reached, 4 paused
# by the spot policy (cost.live BUDGET_EXIT_CODE / SPOT_PAUSE_EXIT_CODE). The launcher exits the same, quietly.
EXPLAINED_EXIT_CODES = {2, 3, 4}


def inside_launched_worker() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            raise ConfigError(
                "parallel.rdzv_endpoint", f"port {port} on {host} is already in use; choose a free port"
            ) from None


def launch(cfg: ParallelConfig, worker_args: Sequence[str]) -> None:
    """Run `python -m gaudi3_scale.train *worker_args` in every rank of this node; raises if a worker fails."""
    from torch.distributed.run import get_args_parser, run

    endpoint = cfg.rdzv_endpoint or f"127.0.0.1:{free_port()}"
    host, _, port = endpoint.rpartition(":")
    if cfg.node_rank == 0 and host in ("127.0.0.1", "localhost", socket.gethostname()):
        _check_port_free(host, int(port))
    launcher_args = [
        "--nnodes", str(cfg.nnodes),
        "--nproc-per-node", str(cfg.nproc_per_node),
        "--node-rank", str(cfg.node_rank),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", endpoint,
        "--rdzv-id", os.environ.get("GAUDI3_RUN_ID", uuid.uuid5(uuid.NAMESPACE_URL, endpoint).hex),
        "--max-restarts", str(cfg.max_restarts),
        "-m", "gaudi3_scale.train",
        *worker_args,
    ]  # fmt: skip
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # Workers open their own TCPStore instead of sharing the rendezvous one: with the shared store, workers of a
    # restarted group can read the previous attempt's addresses and fail to connect (pytorch/pytorch#135712,
    # seen here with gloo after a SIGKILL under --max-restarts).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    apply_network_preset(cfg.network_preset)  # before the agent starts the workers: they inherit os.environ
    try:
        run(get_args_parser().parse_args(launcher_args))
    except SignalException as exc:
        # SIGTERM/SIGUSR1 to the launcher: the agent passed it on to the workers and gave them time to commit their
        # emergency checkpoint; exit as they do, 128 + signal (restartable), not with a traceback.
        raise SystemExit(128 + int(exc.sigval)) from None
    except ChildFailedError as exc:
        # Workers that stopped for a preemption signal saved a checkpoint and exit 128 + signal: pass that on,
        # so that whatever restarts this command (Kubeflow's ExitCode policy, a job script) sees it as restartable.
        codes = {failure.exitcode for failure in exc.failures.values()}
        restartable = sorted(codes & RESTARTABLE_EXIT_CODES)
        if restartable:
            raise SystemExit(restartable[-1]) from None
        # The agent SIGTERMs the workers still running once one has exited non-zero: those are not causes.
        causes = codes - {-signal.SIGTERM}
        if len(causes) == 1 and causes <= EXPLAINED_EXIT_CODES:
            # The failed workers stopped for the same reason and rank 0 said why in one line: no traceback.
            raise SystemExit(causes.pop()) from None
        raise
