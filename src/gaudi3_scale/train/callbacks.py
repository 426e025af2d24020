"""What keeps a run's state safe after each step: periodic committed checkpoints (`StepCheckpoint`) and graceful
stops agreed by every rank (`GracefulInterrupt`: signals, spot notices, budget). `train.after_step.AfterStep` calls
them in its order; step metrics and the progress bar are in `train.step_metrics`.

They only read training state; nothing here changes the math.
"""

from __future__ import annotations

import signal
import time
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from rich.console import Console

from gaudi3_scale.checkpoint.checkpointer import Checkpointer
from gaudi3_scale.checkpoint.contents import (
    DATA_SHA256_KEY,
    SEMANTICS_KEY,
    TOKENIZER_SHA256_KEY,
)
from gaudi3_scale.checkpoint.manager import (
    CheckpointManager,
    CheckpointSaveError,
)
from gaudi3_scale.distributed.launch import FORWARDED_SIGNALS, signal_exit_code
from gaudi3_scale.distributed.strategies import saves_sharded
from gaudi3_scale.models.semantics import model_semantics
from gaudi3_scale.monitor.durations import Durations
from gaudi3_scale.source import source_revision
from gaudi3_scale.train.step_metrics import RunMetrics

if TYPE_CHECKING:
    from gaudi3_scale.health.watchdog import Watchdog

__all__ = [
    "PREEMPTION_SIGNALS",
    "GracefulInterrupt",
    "StepCheckpoint",
    "own_signals",
    "preemption_exit_code",
]


class StepCheckpoint:
    """When a run saves: a committed `step-XXXXXXXX/` checkpoint every N optimizer steps and at the end (after the
    validation that follows the last step), an emergency one when the ranks agreed on a stop, and light ones between.
    How it is written is `Checkpointer.save`'s (one writer per layout: single file, sharded, light); the commit
    (upload, `latest`, retention) is `Checkpointer.commit`'s. `blocking_s` counts how long each save stopped training.

    A periodic save that fails (disk full, storage gone) is never committed and is cleaned up; the run continues
    with a warning naming it. The final or emergency save failing stops the run with that one line instead.

    With `light_every_steps`, a step that is a multiple of it and not due for a full checkpoint (periodic, final or
    emergency: the full one wins) gets a light one in the light tier: weights, counters, run config and manifest
    metadata only (`_light_state`). A light save that fails only warns, even when found at the end.
    """

    def __init__(
        self,
        checkpointer: Checkpointer,
        *,
        every_steps: int,
        val_every_steps: int = 0,
        metrics: RunMetrics | None = None,
        warn: Callable[[str], None] | None = None,
        config_sha256: str | None = None,
        enabled: bool = True,
        data_sha256: str | None = None,
        tokenizer_sha256: str | None = None,
        tokens_per_step: int = 0,
        strategy: str | None = None,
        light_every_steps: int = 0,
    ) -> None:
        self.checkpointer = checkpointer  # writes (`Checkpointer.save`), commits, keeps retention
        self.light_every_steps = light_every_steps
        self.tokens_per_step = tokens_per_step  # 0 = unknown: the manifest's tokens_seen is null
        self.strategy = strategy  # the run's resolved strategy name; None = the Lightning strategy's class
        # The tokens trained on (data.manifest.tokens_sha256); the manifest records it, a resume compares it.
        self.data_sha256 = data_sha256
        # And the tokenizer that made them (data.tokenizers.tokenizer_sha256): generate, serve and export refuse
        # another one.
        self.tokenizer_sha256 = tokenizer_sha256
        self.enabled = enabled  # False: never save (a stop request still stops after the agreed step)
        self.warn = warn
        self.config_sha256 = config_sha256
        self.every_steps = every_steps
        self.val_every_steps = val_every_steps
        self.metrics = metrics
        self._after_validation = False
        self.committed_at = 0.0
        self.last_path: Path | None = None
        self._last_step = -1
        self._trainer: pl.Trainer | None = None
        self.save_requested = False
        self.blocking_s = Durations()  # how long each save stopped training (bounded, see monitor.durations)
        self._uncommitted = False  # a save may still be in flight (asynchronous IO)
        self._light_in_flight = False  # and it is a light one: its failure never stops the run
        self.watchdog: Watchdog | None = None  # health.watchdog: a save is its `checkpoint` section

    @property
    def manager(self) -> CheckpointManager:
        """The full checkpoints' directory and retention."""
        return self.checkpointer.manager

    def start(self, trainer: pl.Trainer) -> None:
        self._trainer = trainer
        self._last_step = trainer.global_step  # never re-save the checkpoint we resumed from
        if trainer.is_global_zero and self.enabled:
            source_revision()  # asked of git now (cached), not on the first save's blocking path (its manifest)

    def after_step(self, trainer: pl.Trainer) -> None:
        """Save what this step is due (after the stop agreement): an emergency checkpoint and stop; at the last step,
        the stop (the final save follows the last validation, in `end`); a periodic one now, or right after this
        step's validation; else a light one."""
        step = trainer.global_step
        if self.save_requested:
            self.save(trainer, wait=True)  # an emergency save returns only once committed
            trainer.should_stop = True
            trainer.limit_val_batches = 0  # and no validation before leaving (a preempted run has seconds)
        elif step >= trainer.max_steps > 0:
            # The last step. Stopping the fit here has Lightning validate once more, in the fit loop
            # (training_epoch_loop._should_check_val_fx: a fit that stops early validates), where every strategy
            # can (a trainer.validate() after fit re-initializes DeepSpeed's engine, which fails). So a run
            # validates after its last step (train.val_every_steps 0: only then), and on_train_end saves after
            # that validation, so the final checkpoint records its loss.
            trainer.should_stop = True
        elif self.periodic_due(step):
            if self.val_every_steps and step % self.val_every_steps == 0:
                self._after_validation = True  # validation runs right after this hook: record its loss too
            else:
                self.save(trainer)
        elif self.enabled and self.light_every_steps and step % self.light_every_steps == 0:
            self.save(trainer, light=True)

    def periodic_due(self, step: int) -> bool:
        """Whether a periodic checkpoint falls on optimizer step `step` (a checkpoint boundary)."""
        return bool(self.enabled and self.every_steps and step % self.every_steps == 0)

    def validation_end(self, trainer: pl.Trainer) -> None:
        if self._after_validation and not trainer.sanity_checking:
            self._after_validation = False
            self.save(trainer)

    def end(self, trainer: pl.Trainer) -> None:
        """The final checkpoint (after the last validation), committed before returning."""
        self.save(trainer, wait=True)

    def release(self) -> None:
        """The fit is over: let go of its trainer (which holds the strategy, the model and the process groups)."""
        self._trainer = None

    def state_dict(self) -> dict[str, Any]:
        """The manifest fields this run records about each checkpoint (a `Stateful` merged into META_KEY), next to
        the files' checksums and the other owners' fields (LiveCost: the accrued cost)."""
        trainer = self._trainer
        assert trainer is not None, "start() runs before any save"
        tokens_per_step = self.tokens_per_step
        return {
            "tokens_seen": trainer.global_step * tokens_per_step if tokens_per_step else None,
            "world_size": trainer.world_size,
            "strategy": self.strategy or type(trainer.strategy).__name__,
            "layout": "sharded" if saves_sharded(trainer.strategy) else "single-file",
            "config_sha256": self.config_sha256,
            DATA_SHA256_KEY: self.data_sha256,
            TOKENIZER_SHA256_KEY: self.tokenizer_sha256,
            SEMANTICS_KEY: model_semantics(),
            # The newest validation so far (it may have run a few steps before this checkpoint).
            "val_loss": self.metrics.latest.get("val_loss") if self.metrics is not None else None,
            "val_loss_step": self.metrics.latest.get("val_loss_step") if self.metrics is not None else None,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass  # what a resume needs of the manifest fields, preflight reads from the manifest itself

    def save(self, trainer: pl.Trainer, *, wait: bool = False, light: bool = False) -> None:
        """A full checkpoint of this step (unless it has one), or with `light` a light one; `wait`: until committed."""
        if not self.enabled:
            return
        with self.watchdog.watching("checkpoint") if self.watchdog is not None else nullcontext():
            self._save(trainer, wait=wait, light=light)

    def _save(self, trainer: pl.Trainer, *, wait: bool, light: bool) -> None:
        step = trainer.global_step
        if light or step != self._last_step:
            if self.metrics is not None:
                self.metrics.pause()
            self._wait_for_commit(trainer, final=False)  # the previous save's outcome, before a new one
            started = time.perf_counter()
            path, saved, failure = self.checkpointer.save(
                trainer, light=light, sharded=saves_sharded(trainer.strategy)
            )
            self.blocking_s.add(time.perf_counter() - started)
            if saved:
                if not light:
                    self.last_path = path
                    self._last_step = step  # a failed step is tried again at the end of training
                self._uncommitted, self._light_in_flight = True, light
            elif failure is not None:
                self._failed(failure, final=wait and not light)
            if self.metrics is not None:
                self.metrics.resume()
        if wait and self._uncommitted:
            self._wait_for_commit(trainer, final=True)
            self.committed_at = time.perf_counter()

    def _wait_for_commit(self, trainer: pl.Trainer, *, final: bool) -> None:
        """Wait for an asynchronous save in flight (rank 0 writes it); warn or raise if it failed."""
        if not self._uncommitted:
            return
        self._uncommitted = False
        final = final and not self._light_in_flight
        error = self.checkpointer.wait_for_commit(trainer)
        if error is not None:
            self._failed(error, final=final)

    def _failed(self, error: CheckpointSaveError, *, final: bool) -> None:
        if final:
            raise error
        committed = self.manager.committed()
        newest = committed[-1][1].name if committed else "none yet"
        message = f"{error}; training continues (newest committed checkpoint: {newest})"
        if self.warn is not None:
            self.warn(message)
        else:
            warnings.warn(message, stacklevel=2)


# The signals a run stops on; the launcher passes the same ones on to its workers, and both exit by
# `distributed.launch.signal_exit_code`.
PREEMPTION_SIGNALS = {signum: signum.name for signum in FORWARDED_SIGNALS}


def preemption_exit_code(signal_name: str | None) -> int:
    return 0 if signal_name is None else signal_exit_code(getattr(signal, signal_name))


def own_signals(trainer: pl.Trainer, stop: GracefulInterrupt) -> None:
    """The stop signals are the run's for the whole fit: its handlers go up where Lightning would put its own.

    Lightning 2.6 installs a SIGTERM handler just before the fit loop (`_SignalConnector.register_signal_handlers`)
    that broadcasts inside the handler (a collective that can meet another one, a checkpoint's barrier, and hang)
    and, landing before the run's handlers were up, ends the fit as a SystemExit without a code: exit 0, nothing
    saved. Its SLURM requeue handler goes too; SIGUSR1 stops the run like SIGTERM.

    Without that handler Lightning's flag never rises, so its loop's per-batch broadcast of the flag goes as well:
    on more than one rank it was a blocking collective before every step, and the `.item()` that reads it holds
    the host until the device has run all the work queued (what `GracefulInterrupt` avoids for its own flags)."""
    connector = getattr(trainer, "_signal_connector", None)
    if connector is not None and hasattr(connector, "register_signal_handlers"):
        connector.register_signal_handlers = stop.start
        epoch_loop = trainer.fit_loop.epoch_loop
        if hasattr(epoch_loop, "_broadcast_sigterm_tensor"):
            epoch_loop._broadcast_sigterm_tensor = _no_flag_to_broadcast  # type: ignore[method-assign]


def _no_flag_to_broadcast() -> None:
    """Stands in for Lightning's per-batch SIGTERM broadcast (`own_signals`)."""


class GracefulInterrupt:
    """SIGTERM, SIGUSR1 or Ctrl-C: finish the current optimizer step, save a checkpoint on every rank, stop.

    A signal may reach only some ranks (a preempted node, `kill` of one process); at every step boundary the ranks
    agree by all-reducing the signal number (max), so all of them stop after the same step and save together. The
    all-reduce issued at one boundary is read at the next: waiting for it at once would block the host on the
    device every step (the host could no longer run ahead of an asynchronous accelerator), so a stop lands one
    step after the signal is seen.
    A second Ctrl-C aborts at once. `signal_name` and `signal_to_checkpoint_s` say what happened and how long the
    emergency checkpoint took from the signal to its commit.

    `request(reason, exit_code=N)` stops the same way for a reason of the run's own (LiveCost: budget spent, spot
    price too high); the exit code is agreed like the signal (max over ranks) and lands in `exit_code`.
    """

    def __init__(self, checkpoint: StepCheckpoint, console: Console | None = None) -> None:
        self.checkpoint = checkpoint
        self.console = console or Console(stderr=True)
        self._previous: dict[int, Any] = {}
        self._received = 0  # signal number seen by this process, 0 = none
        self._received_at: float | None = None
        self.signal_name: str | None = None
        self.reason: str | None = None  # the signal's name, or what requested the stop
        self.signal_to_checkpoint_s: float | None = None
        self._exit_code = 0  # requested by this process, 0 = none
        self._in_flight: tuple[Any, torch.Tensor] | None = (
            None  # the previous boundary's all-reduce and its flags
        )
        self.exit_code: int | None = None  # agreed by all ranks; None: the signal's convention applies

    @property
    def interrupted(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._received:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt  # second Ctrl-C: abort now
            return
        self._received, self._received_at = signum, time.perf_counter()
        self.reason = PREEMPTION_SIGNALS[signal.Signals(signum)]
        self.console.print(f"\n[yellow]{self.reason}: {self._after_this_step()} (Ctrl-C again aborts)")

    def request(self, reason: str, signum: int = signal.SIGTERM, *, exit_code: int | None = None) -> None:
        """Stop as if `signum` had arrived, for `reason` (callable from another thread, e.g. a spot watcher).

        With `exit_code` the process should end with that code instead of the signal's (see `exit_code`).
        """
        if self._received:
            return
        self.reason = reason
        self._exit_code = exit_code or 0
        self._received, self._received_at = signum, time.perf_counter()
        self.console.print(f"\n[yellow]{reason}: {self._after_this_step()}", highlight=False, soft_wrap=True)

    def _after_this_step(self) -> str:
        """What the stop does, said as it is asked for: with checkpoints off nothing is saved, and the line must
        not promise a checkpoint that the run's last line then says was never written."""
        if self.checkpoint.enabled:
            return "saving a checkpoint after this step"
        return "stopping after this step (checkpoint.enabled is false: nothing is saved)"

    def start(self) -> None:
        """Handle the stop signals (main thread only) until `end` (or `restore`). Called where Lightning would
        install its own handlers (`own_signals`), and again at the fit's start: the second call changes nothing."""
        if self._previous:
            return
        for signum in PREEMPTION_SIGNALS:
            try:
                self._previous[signum] = signal.signal(signum, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                return

    def after_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The ranks agree on a stop (of the previous boundary's flags); agreed, the checkpoint saves next."""
        if self.signal_name is not None:
            return
        agreed, exit_code = self._received, self._exit_code
        if trainer.world_size > 1:
            agreed, exit_code, first = self._agree(pl_module.device, trainer.global_rank, trainer.world_size)
            self._name_the_rank(agreed, first)
        if agreed:
            self.signal_name = PREEMPTION_SIGNALS[signal.Signals(agreed)]
            self.exit_code = exit_code or None
            if self._received_at is None:  # the signal reached another rank
                self._received_at = time.perf_counter()
            # StepCheckpoint (next in AfterStep) saves now and stops the run.
            self.checkpoint.save_requested = True

    def _name_the_rank(self, agreed: int, first: int) -> None:
        """A stop signal that reached another rank and not this one is named with that rank: on another node it is
        often that node's own loss (its launcher killed: the parent-death SIGTERM), not a preemption of this one."""
        if agreed and not self._received:
            self.reason = f"{PREEMPTION_SIGNALS[signal.Signals(agreed)]} to rank {first}"

    def _flags(self, rank: int, world_size: int) -> list[int]:
        """This rank's stop flags, all-reduced by MAX: its signal and rank in one number (signal × (world + 1) +
        world − rank: the max is the highest signal and, of the ranks that received that one, the lowest), and the
        exit code. `_read_flags` takes them apart."""
        received = self._received * (world_size + 1) + world_size - rank if self._received else 0
        return [received, self._exit_code]

    @staticmethod
    def _read_flags(flags: list[int], world_size: int) -> tuple[int, int, int]:
        """(signal, exit code, the rank that received it) of all-reduced `_flags`."""
        signum, rest = divmod(flags[0], world_size + 1)
        return signum, flags[1], world_size - rest

    def _agree(self, device: torch.device, rank: int, world_size: int) -> tuple[int, int, int]:
        """(signal, exit code, the lowest rank that received it), the max over ranks of what each had at the
        previous step boundary; issues this boundary's all-reduce without waiting for it. Every rank reads the same
        result, so all stop together."""
        flags = torch.tensor(self._flags(rank, world_size), dtype=torch.int64)
        if device.type == "cuda":  # a pinned source: the copy is queued, not waited for
            flags = flags.pin_memory().to(device, non_blocking=True)
        else:
            flags = flags.to(device)
        work = torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, async_op=True)
        previous, self._in_flight = self._in_flight, (work, flags)
        if previous is None:
            return 0, 0, 0
        previous[0].wait()
        return self._read_flags([int(v) for v in previous[1].tolist()], world_size)

    def adopt_pending(self, trainer: pl.Trainer) -> bool:
        """After a fit that a spike ended for a rollback: whether any rank holds a stop signal the step boundaries
        did not agree on yet (it arrived in the last step); if so it becomes this run's stop (every rank alike)."""
        received, exit_code = self._received, self._exit_code
        if trainer.world_size > 1 and torch.distributed.is_initialized():
            world = trainer.world_size
            flags = torch.tensor(
                self._flags(trainer.global_rank, world),
                dtype=torch.int64,
                device=trainer.strategy.root_device,
            )
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
            received, exit_code, first = self._read_flags([int(v) for v in flags.tolist()], world)
            if self.signal_name is None:
                self._name_the_rank(received, first)
        if received and self.signal_name is None:
            # the summary's stop: "interrupted" (a save the stop asked for), its signal or exit code
            self.signal_name = PREEMPTION_SIGNALS[signal.Signals(received)]
            self.exit_code, self.checkpoint.save_requested = exit_code or None, True
        return self.signal_name is not None

    def settle(self) -> None:
        """Wait for the last boundary's all-reduce (every rank issued it, so it completes): before the final save's
        own collectives."""
        if self._in_flight is not None:
            self._in_flight[0].wait()
            self._in_flight = None

    def end(self) -> None:
        """After the final save has committed: the time from the signal to that commit, the handlers restored. Until
        then a signal is ours to record (a Ctrl-C raised inside the save's wait would abandon its writer thread)."""
        self.settle()
        if self.signal_name is not None and self._received_at is not None:
            self.signal_to_checkpoint_s = self.checkpoint.committed_at - self._received_at
        self.restore()

    def restore(self) -> None:
        """The signal handlers there were before `start` (a fit that raised ends here, through teardown)."""
        for signum, previous in self._previous.items():
            if previous is not None:
                signal.signal(signum, previous)
        self._previous.clear()  # Lightning's handlers hold its trainer, and with it the model
