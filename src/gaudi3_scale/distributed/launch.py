"""Start the ranks of a run with torch.distributed's elastic launcher (the machinery behind `torchrun`).

`gaudi3 train --nproc-per-node N …` re-runs itself as `python -m gaudi3_scale.train …` in N workers per node,
with a c10d rendezvous. Inside a worker (LOCAL_RANK is set) nothing is launched again.

Signals: every signal a run promises to handle (SIGTERM, SIGUSR1, Ctrl-C's SIGINT) is passed on from the launcher
to the workers (the agent's own handler, widened with torchrun's `--signals-to-handle`; the workers run in
sessions of their own, so a terminal's Ctrl-C reaches only the launcher), and the launcher exits as the workers
do: 128 + signal after a preemption checkpoint, 0 after Ctrl-C. A worker whose launcher dies (`kill -9`, OOM
killer) gets SIGTERM from the kernel (`stop_with_launcher`: Linux's parent-death signal), saves and stops, instead
of training on without a launcher.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import os
import signal
import socket
import sys
import uuid
from collections.abc import Sequence

from gaudi3_scale.config.errors import ConfigError
from gaudi3_scale.config.hosts import parse_endpoint
from gaudi3_scale.device.select import cpu_threads_per_rank
from gaudi3_scale.distributed.config import ParallelConfig
from gaudi3_scale.distributed.env import inside_launched_worker
from gaudi3_scale.distributed.network import apply_network_preset
from gaudi3_scale.distributed.rendezvous import hosted_here, wait_for_rendezvous

__all__ = [
    "EXPLAINED_EXIT_CODES",
    "FORWARDED_SIGNALS",
    "RESTARTABLE_EXIT_CODES",
    "free_port",
    "inside_launched_worker",
    "launch",
    "launched_parallel",
    "process_alive",
    "signal_exit_code",
    "stop_with_launcher",
]

RESTARTABLE_EXIT_CODES = {138, 143}  # 128 + SIGUSR1, 128 + SIGTERM: a worker saved a checkpoint and stopped
# 143 is also the hang watchdog's (health.watchdog.HANG_EXIT_CODE): the last committed checkpoint resumes.
# Workers exiting with one of these already printed why in one line: 2 bad input, 3 cost budget reached, 4 paused
# by the spot policy (metering.live BUDGET_EXIT_CODE / SPOT_PAUSE_EXIT_CODE), 5 stopped by the training-health
# guard (health.guard.HEALTH_STOP_EXIT_CODE), 130 interrupted before its run handled Ctrl-C
# (config.errors.INTERRUPTED_EXIT_CODE). The launcher exits the same, quietly.
EXPLAINED_EXIT_CODES = {2, 3, 4, 5, 130}
# What a run handles (train.callbacks.GracefulInterrupt): the launcher passes each on to its workers.
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# torch's agent handles SIGTERM, SIGINT, SIGHUP and SIGQUIT by default (torchrun --signals-to-handle, or its
# environment form PET_SIGNALS_TO_HANDLE): it shuts the workers down with the signal it got, then raises. SIGUSR1
# was not among them, so it killed the launcher and left the workers training on.
_AGENT_SIGNALS_ENV = "PET_SIGNALS_TO_HANDLE"
_AGENT_DEFAULT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
LAUNCHER_PID_ENV = "GAUDI3_LAUNCHER_PID"  # set for our workers: they check that their launcher still runs
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists (another user's process counts: it exists)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def signal_exit_code(signum: int) -> int:
    """How a run stopped by `signum` exits: 128 + signal (restartable), but 0 for Ctrl-C (a person stopping it).

    128 + the signal number is the shell convention. Kubeflow's ExitCode restart policy retries 143
    (training-operator, pkg/util/train IsRetryableExitCode: 130, 137, 143 retryable), and torchrun's
    --max-restarts restarts on any non-zero exit.
    """
    return 0 if signum == signal.SIGINT else 128 + int(signum)


def launched_parallel(cfg: ParallelConfig) -> ParallelConfig:
    """Inside a worker of any launcher that says how many ranks it started (torchrun: WORLD_SIZE and
    LOCAL_WORLD_SIZE), the launch geometry it used when the config left the default single process; a config
    that names another geometry is refused by the trainer, as before (a mistake, not a default)."""
    world, local = os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")
    if not inside_launched_worker() or local is None or cfg.world_size != 1 or int(world or 1) == 1:
        return cfg
    nnodes = max(1, int(world or 1) // int(local))
    endpoint = cfg.rdzv_endpoint
    if nnodes > 1 and endpoint is None and "MASTER_ADDR" in os.environ:
        endpoint = f"{os.environ['MASTER_ADDR']}:{os.environ.get('MASTER_PORT', '29500')}"
    return dataclasses.replace(
        cfg,
        nproc_per_node=int(local),
        nnodes=nnodes,
        node_rank=int(os.environ.get("GROUP_RANK", cfg.node_rank)),
        rdzv_endpoint=endpoint,
    )


def stop_with_launcher() -> None:
    """In a launched worker on Linux: have the kernel send this process SIGTERM when its launcher dies.

    Linux's parent-death signal (prctl PR_SET_PDEATHSIG, through ctypes) rather than a heartbeat: no thread, no
    polling, and it fires however the launcher ends (kill -9 included). SIGTERM is the preemption signal, so the
    ranks agree, commit a checkpoint and exit 143 as if a scheduler had stopped them. The signal follows the
    launcher *thread* that started the worker, which for torch's agent is its main thread. Elsewhere (macOS) this
    does nothing: the run-directory lock still refuses a second run while orphaned ranks hold it.
    """
    if not inside_launched_worker() or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher is not None and os.getppid() != int(launcher):  # it died before the request above
        raise SystemExit(f"the launcher (pid {launcher}) of this rank has exited; stopping")


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


def launch(cfg: ParallelConfig, worker_args: Sequence[str]) -> bool:
    """Run `python -m gaudi3_scale.train *worker_args` in every rank of this node; raises if a worker fails.

    Returns whether global rank 0 ran on this node (the c10d rendezvous, not `--node-rank`, orders the nodes): its
    launcher alone prints the run's sample and records its benchmark result, even when every node shares `--out`.
    """
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    endpoint = cfg.rdzv_endpoint or f"127.0.0.1:{free_port()}"
    host, port = parse_endpoint("parallel.rdzv_endpoint", endpoint)
    if cfg.node_rank == 0 and host in ("127.0.0.1", "localhost", socket.gethostname()):
        _check_port_free(host, port)
    elif not hosted_here(host):
        wait_for_rendezvous(host, port, cfg.rdzv_timeout_s)
    launcher_args = [
        "--nnodes", str(cfg.nnodes),
        "--nproc-per-node", str(cfg.nproc_per_node),
        # no --node-rank: the c10d rendezvous orders the nodes itself (torch ignores it there, with a warning)
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", endpoint,
        "--rdzv-conf", f"join_timeout={math.ceil(cfg.rdzv_timeout_s)}",
        "--rdzv-id", os.environ.get("GAUDI3_RUN_ID", uuid.uuid5(uuid.NAMESPACE_URL, endpoint).hex),
        "--max-restarts", str(cfg.max_restarts),
        "--signals-to-handle", ",".join(_agent_signals()),
        "-m", "gaudi3_scale.train",
        *worker_args,
    ]  # fmt: skip
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    # Under --max-restarts the workers open their own TCPStore instead of sharing the rendezvous one: with the
    # shared store, workers of a restarted group can read the previous attempt's addresses and fail to connect
    # (pytorch/pytorch#135712, seen here with gloo after a SIGKILL under --max-restarts). Their own store listens on
    # a port the agent found free and let go, which another process can take before rank 0 binds it (EADDRINUSE;
    # a restart then picks another). Without restarts the shared store is safe and its port is held throughout.
    if cfg.max_restarts > 0:
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # the workers' parent: the agent runs in this process
    # Each rank sets its intra-op threads (train.threads, else the usable cores ÷ ranks: train.assembly); the same
    # default here keeps torch's agent from setting 1 and printing its banner about it at every launch.
    os.environ.setdefault("OMP_NUM_THREADS", str(cpu_threads_per_rank(cfg.nproc_per_node)))
    apply_network_preset(cfg.network_preset)  # before the agent starts the workers: they inherit os.environ
    args = get_args_parser().parse_args(launcher_args)
    args.master_port = 29500  # torchrun's default for the static rendezvous; the c10d one does not read it
    config, entrypoint, entrypoint_args = config_from_args(args)
    try:
        local_ranks = elastic_launch(config=config, entrypoint=entrypoint)(*entrypoint_args)
    except RendezvousTimeoutError:
        # The other nodes did not all join (one stopped before it joined: its own output says why).
        raise ConfigError(
            "parallel.rdzv_timeout_s",
            f"{cfg.nnodes} nodes did not all join the rendezvous at {endpoint} within {cfg.rdzv_timeout_s:g} s; "
            "start the same `gaudi3 train` on every node (one that stopped before joining said why in its own "
            "output), or raise parallel.rdzv_timeout_s",
        ) from None
    except SignalException as exc:
        # SIGTERM/SIGUSR1/SIGINT to the launcher: the agent passed it on to the workers and gave them time to commit
        # their emergency checkpoint; exit as they do (128 + signal, restartable; 0 after Ctrl-C), no traceback.
        raise SystemExit(signal_exit_code(exc.sigval)) from None
    except ChildFailedError as exc:
        # Workers that stopped for a preemption signal saved a checkpoint and exit 128 + signal: pass that on,
        # so that whatever restarts this command (Kubeflow's ExitCode policy, a job script) sees it as restartable.
        code = launcher_exit_code({failure.exitcode for failure in exc.failures.values()})
        if code is None:
            raise
        raise SystemExit(code) from None
    return 0 in local_ranks  # the agent's return values, by the global rank of each worker of this node


def launcher_exit_code(codes: set[int]) -> int | None:
    """How the launcher exits when its workers failed with `codes` (negative: killed by that signal): a restartable
    code when every cause is one, an explained one (the workers said why in one line) when that is the only other
    cause, else None (torch's error report)."""
    # The agent SIGTERMs the workers still running once one has exited non-zero: those are not causes.
    causes = codes - {-signal.SIGTERM}
    # A worker that exited by itself with a failure (a crash, bad input) is the cause, whatever the others did after
    # it: a rank whose peer crashed exits 143 (`train.worker.stop_when_a_peer_is_lost`), which must not make it a
    # restart. A worker killed by a signal (the agent's SIGKILL of a rank the hang watchdog found stopped) is not.
    failed = {code for code in causes if code > 0} - RESTARTABLE_EXIT_CODES
    restartable = causes & RESTARTABLE_EXIT_CODES
    if restartable and not failed:
        return max(restartable)
    causes -= RESTARTABLE_EXIT_CODES
    if len(causes) == 1 and causes <= EXPLAINED_EXIT_CODES:
        return causes.pop()
    return None


def _agent_signals() -> list[str]:
    """The signals torch's agent handles: a user's own PET_SIGNALS_TO_HANDLE, or torch's defaults, plus ours."""
    given = os.environ.get(_AGENT_SIGNALS_ENV)
    names = [n.strip() for n in given.split(",") if n.strip()] if given else list(_AGENT_DEFAULT_SIGNALS)
    return names + [s.name for s in FORWARDED_SIGNALS if s.name not in names]
