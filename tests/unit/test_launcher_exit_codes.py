"""How `gaudi3 train`'s launcher exits once its workers failed (`distributed.launch.launcher_exit_code`): what a
restarter (Kubeflow's ExitCode policy, torchrun's agent, a job script) sees."""

from __future__ import annotations

import signal

import pytest

from gaudi3_scale.distributed.launch import RESTARTABLE_EXIT_CODES, launcher_exit_code
from gaudi3_scale.train.worker import RESTARTABLE_STOP_EXIT_CODE

KILLED = -signal.SIGKILL
TERMINATED = -signal.SIGTERM  # what the agent does to the workers still running once one failed


@pytest.mark.parametrize(
    ("codes", "want"),
    [
        ({143, TERMINATED}, 143),  # preemption: a rank saved and stopped, the agent stopped the others
        ({138, 143}, 143),
        ({2, TERMINATED}, 2),  # bad input, said in one line
        ({130, TERMINATED}, 130),  # a rank interrupted before its run handled Ctrl-C: said in one line
        ({2, RESTARTABLE_STOP_EXIT_CODE}, 2),  # bad input on one rank; the other lost it: still bad input
        ({1, RESTARTABLE_STOP_EXIT_CODE}, None),  # a crash, not a restart because its peer then exited 143
        # a rank killed by a signal is not a failure of its own (the agent SIGKILLs a rank the hang watchdog
        # found stopped): restartable, as a hang is
        ({KILLED, 143}, 143),
        ({KILLED, 1}, None),
        ({TERMINATED}, None),
    ],
)
def test_a_restart_only_when_every_cause_is_restartable(codes: set[int], want: int | None) -> None:
    assert (
        RESTARTABLE_STOP_EXIT_CODE in RESTARTABLE_EXIT_CODES
    )  # train.worker cannot import it (torch behind it)
    assert launcher_exit_code(codes) == want


def test_only_a_collective_whose_peer_is_gone_is_a_lost_rank() -> None:
    """gloo's and NCCL's words for it; the same words from anything else (a storage upload) are not a lost rank,
    whose exit 143 would restart a failure that repeats."""
    import torch.distributed as dist

    from gaudi3_scale.train.worker import _lost_peer

    gloo = RuntimeError("[/w/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [10.0.0.2]:52927: "
                        "Connection reset by peer. This is typically caused by a remote worker crashing.")  # fmt: skip
    assert _lost_peer(gloo) == "Read error [10.0.0.2]:52927: Connection reset by peer"
    wrapped = ValueError("the fit failed")
    wrapped.__cause__ = gloo
    assert _lost_peer(wrapped) == "Read error [10.0.0.2]:52927: Connection reset by peer"
    nccl = dist.DistBackendError("NCCL error: remote process exited or there was a network error")
    assert _lost_peer(nccl) == "NCCL error: remote process exited or there was a network error"
    assert _lost_peer(RuntimeError("upload to s3://b/k failed: Connection reset by peer")) is None
    assert _lost_peer(RuntimeError("gloo: invalid argument")) is None
