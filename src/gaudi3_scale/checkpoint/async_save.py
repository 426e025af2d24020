"""Asynchronous checkpoint saving: training blocks only while tensors are copied to host memory.

The copy ("staging") is a snapshot, so training may change its tensors right after; a background thread then
writes, checksums and commits the snapshot exactly as a synchronous save would (then `on_commit`). At most one
save is in flight: a new save first waits for the previous one, and an error in the background is raised there
(or at `wait`/teardown), never lost. Staged memory is one extra host copy of the checkpoint while a save is in
flight.
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from gaudi3_scale.checkpoint.manager import CheckpointSaveError, checkpoint_directory
from gaudi3_scale.checkpoint.verified_io import VerifiedCheckpointIO

__all__ = ["AsyncVerifiedCheckpointIO", "stage_to_host"]

_WRITER_NICE = 10


def stage_to_host(
    value: Any,
    _copies: dict[tuple[Any, ...], torch.Tensor] | None = None,
    buffers: dict[tuple[Any, ...], list[torch.Tensor]] | None = None,
) -> Any:
    """A snapshot of a checkpoint: every tensor copied to CPU memory, containers rebuilt, other values copied.

    Tensors that view the same memory (tied weights) stay one copy, as `torch.save` would store them. With
    `buffers` (a dict kept between saves) host tensors of the previous snapshot are reused: no new allocation
    and no page faults, so staging is a plain memory copy.
    """
    copies = {} if _copies is None else _copies
    if isinstance(value, torch.Tensor):
        key = (value.device, value.untyped_storage().data_ptr(), value.storage_offset(), value.dtype,
               tuple(value.shape), value.stride())  # fmt: skip
        if key not in copies:
            copies[key] = _host_copy(value.detach(), buffers)
        return copies[key]
    if isinstance(value, Mapping):
        items = {k: stage_to_host(v, copies, buffers) for k, v in value.items()}
        return OrderedDict(items) if isinstance(value, OrderedDict) else items
    if isinstance(value, list):
        return [stage_to_host(v, copies, buffers) for v in value]
    if isinstance(value, tuple):
        return tuple(stage_to_host(v, copies, buffers) for v in value)
    if value is None or isinstance(value, int | float | str | bool | bytes):
        return value
    return copy.deepcopy(value)


def _host_copy(
    tensor: torch.Tensor, buffers: dict[tuple[Any, ...], list[torch.Tensor]] | None
) -> torch.Tensor:
    if buffers is None or not tensor.is_contiguous():
        return tensor.to("cpu", copy=True)
    free = buffers.get((tuple(tensor.shape), tensor.dtype))
    target = free.pop() if free else torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
    target.copy_(tensor)
    return target


def _recycle(value: Any, buffers: dict[tuple[Any, ...], list[torch.Tensor]]) -> None:
    """Hand a written snapshot's host tensors back for the next save."""
    seen: set[int] = set()

    def walk(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            if id(v) not in seen and v.is_contiguous():
                seen.add(id(v))
                buffers.setdefault((tuple(v.shape), v.dtype), []).append(v)
        elif isinstance(v, Mapping):
            for item in v.values():
                walk(item)
        elif isinstance(v, list | tuple):
            for item in v:
                walk(item)

    walk(value)


class AsyncVerifiedCheckpointIO(VerifiedCheckpointIO):
    """`VerifiedCheckpointIO` whose writes run in a background thread after a blocking copy to host memory."""

    def __init__(self, on_commit: Callable[[Path], None] | None = None) -> None:
        super().__init__(on_commit)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._buffers: dict[tuple[Any, ...], list[torch.Tensor]] = {}  # host memory reused between saves
        self.last_staging_s = 0.0  # how long the last save blocked training

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.wait()  # at most one save in flight
        started = time.perf_counter()
        buffers, self._buffers = self._buffers, {}
        snapshot = stage_to_host(checkpoint, buffers=buffers)
        self.last_staging_s = time.perf_counter() - started
        # `buffers` now holds what this snapshot did not use (the optimizer's, when a light checkpoint follows a
        # full one): handed back with the snapshot's own, so the next full save allocates nothing either.
        self._thread = threading.Thread(
            target=self._write,
            args=(snapshot, checkpoint_directory(path), buffers),
            name="gaudi3-checkpoint-writer",
        )
        self._thread.start()

    def _write(
        self, snapshot: dict[str, Any], directory: Path, unused: dict[tuple[Any, ...], list[torch.Tensor]]
    ) -> None:
        # The writer yields the CPU to training: on Linux, nice applies per thread.
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _WRITER_NICE)
        try:
            VerifiedCheckpointIO.save_checkpoint(self, snapshot, directory)
            _recycle(snapshot, self._buffers)
            for key, tensors in unused.items():
                self._buffers.setdefault(key, []).extend(tensors)
        except BaseException as exc:  # handed to the training thread by wait()
            self._error = exc if isinstance(exc, CheckpointSaveError) else CheckpointSaveError(directory, exc)

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Block until the save in flight is committed; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def teardown(self) -> None:
        self.wait()
