"""A run over several nodes, checked once its process group is up and before any checkpoint is restored: every rank
sees the output directory rank 0 writes, and every rank resumes from the same checkpoint.

Rank 0 commits each checkpoint in `--out` and reads what the other ranks wrote there: a sharded checkpoint (FSDP,
tensor or pipeline parallel, HSDP) or a DeepSpeed one holds a file per rank, so on node-local disks rank 0 would
commit it without the other nodes' shards, and no restart could load it. A single-file checkpoint (DDP) is written
by rank 0 alone, so on node-local disks only rank 0's node could resume from it, unless `checkpoint.remote_url`
mirrors it for the others. And ranks that pick different checkpoints (node-local copies, a mirror one upload
behind) would train on from different states: their first collectives do not match, and gloo aborts the process
with C++ frames. Each is one line on every rank, exit 2, before anything is restored or trained.
"""

from __future__ import annotations

import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import torch.distributed as dist

from gaudi3_scale.config.errors import UserInputError

__all__ = ["MirrorBehindError", "NodesCheck", "RankView", "nodes_problem"]

PROBE_PREFIX = ".gaudi3-nodes-"  # rank 0's probe file in --out, removed once every rank has looked for it
PROBE_WAIT_S = 3.0  # how long a rank looks for it


@dataclass(frozen=True)
class RankView:
    """What one rank sees: its host, whether rank 0's probe file is in its --out, the checkpoint it resumes from
    (its step directory's name; None: from scratch)."""

    rank: int
    host: str
    sees_out: bool
    resume: str | None


def nodes_problem(
    views: list[RankView],
    *,
    out_dir: Path,
    per_rank_files: str | None,
    remote_url: str | None,
    checkpoints: bool,
) -> str | None:
    """The one line that refuses this multi-node run, or None. `per_rank_files`: the setting that makes every rank
    write its part of each checkpoint (None: rank 0 writes it alone). Raises `MirrorBehindError` when ranks would
    resume from different checkpoints because the remote mirror is behind (a relaunch resolves it)."""
    blind = [v for v in views if not v.sees_out]
    if blind and checkpoints and (per_rank_files is not None or not remote_url):
        where = (
            f"--out {out_dir} is not one directory for all nodes: {_ranks(blind)} "
            f"{'do' if len(blind) > 1 else 'does'} not see the files rank 0 writes there"
        )
        if per_rank_files is not None:
            return (
                f"{where}, and with {per_rank_files} every rank writes its part of each checkpoint there for rank 0 "
                "to commit; put --out on storage every node mounts (NFS, a shared volume)"
            )
        return (
            f"{where}, so only rank 0's node could resume from its checkpoints; put --out on storage every node "
            "mounts, or set checkpoint.remote_url, which the other nodes resume from"
        )
    choices: dict[str | None, list[RankView]] = {}
    for view in views:
        choices.setdefault(view.resume, []).append(view)
    if len(choices) > 1:
        detail = "; ".join(
            f"{_ranks(group)}: {name or 'no checkpoint (from scratch)'}" for name, group in choices.items()
        )
        if remote_url:
            raise MirrorBehindError(
                f"the ranks would resume from different checkpoints ({detail}): checkpoint.remote_url is behind the "
                "newest; rank 0 uploads it as it stops and a relaunch fetches it"
            )
        return (
            f"the ranks would resume from different checkpoints ({detail}); every node must see the same: put --out "
            "on storage every node mounts, or set checkpoint.remote_url"
        )
    return None


class MirrorBehindError(Exception):
    """Nodes on their own disks would resume from different checkpoints because the remote mirror does not yet
    hold the newest one: one line and a restartable exit (`train.worker.RESTARTABLE_STOP_EXIT_CODE`)."""


def _ranks(views: list[RankView]) -> str:
    hosts = sorted({v.host for v in views})
    ranks = ", ".join(str(v.rank) for v in views)
    return f"rank{'s' if len(views) > 1 else ''} {ranks} (on {', '.join(hosts)})"


class NodesCheck(pl.Callback):
    """`nodes_problem` over every rank's view, in `setup`: after the process group is up (Lightning sets it up
    first), before the checkpoint is restored. `resume`: this rank's resume point."""

    def __init__(
        self,
        out_dir: Path,
        resume: Path | None,
        *,
        per_rank_files: str | None,
        remote_url: str | None,
        checkpoints: bool,
    ) -> None:
        self.out_dir, self.resume = out_dir, resume
        self.per_rank_files, self.remote_url, self.checkpoints = per_rank_files, remote_url, checkpoints

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not dist.is_available() or not dist.is_initialized():
            return
        rank = dist.get_rank()
        token = [secrets.token_hex(8) if rank == 0 else None]
        probe = self.out_dir / f"{PROBE_PREFIX}{token[0]}"
        if rank == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            probe.touch()
        try:
            views = self._views(rank, token)
        finally:
            if rank == 0:  # also when a peer was lost meanwhile
                probe.unlink(missing_ok=True)
        problem = nodes_problem(views, out_dir=self.out_dir,
                                per_rank_files=self.per_rank_files, remote_url=self.remote_url,
                                checkpoints=self.checkpoints)  # fmt: skip
        if problem is not None:
            raise UserInputError(problem)

    def _views(self, rank: int, token: list[str | None]) -> list[RankView]:
        """Every rank's view, once rank 0's probe (named by `token`, broadcast here) is in its --out."""
        from gaudi3_scale.checkpoint.manager import checkpoint_directory

        dist.broadcast_object_list(token, src=0)  # written before the others look
        probe = self.out_dir / f"{PROBE_PREFIX}{token[0]}"
        # A shared file system that caches what it lists (gcsfuse, s3fs, NFS attribute caches) shows a new file a
        # little later on the other nodes: a rank that does not see the probe yet looks again for a few seconds.
        deadline = time.monotonic() + PROBE_WAIT_S
        while not probe.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        mine = RankView(rank=rank, host=socket.gethostname(), sees_out=probe.exists(),
                        resume=None if self.resume is None else checkpoint_directory(self.resume).name)  # fmt: skip
        views: list[RankView | None] = [None] * dist.get_world_size()
        dist.all_gather_object(views, mine)
        return [v for v in views if v is not None]
