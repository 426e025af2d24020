"""Wait for a device to finish the work queued on it: the one place a clock read meets an asynchronous device.

CUDA kernels and Gaudi ops (lazy and eager mode alike) run asynchronously: the host returns as soon as the work is
queued. A `time.perf_counter()` read before the device has finished measures how fast work was *launched*, not
done, so every throughput number taken on an accelerator must synchronise first. CPU work is done when the call
returns: synchronising there is a no-op.

`SYNCHRONIZERS` is a plain registry by `torch.device.type`; `register_synchronizer` adds a device (or, in the
tests, a fake one whose work completes only on synchronize, to prove every measurement boundary synchronises).

`TIMING_EVENTS` (CUDA) marks a point in the device's queue without waiting: waiting on the mark later, and the
device's own timestamps, give the time it was reached. A full synchronise drains the queue, and the device then
idles until the host has queued the next step; a mark lets the host read a finished window while the device is
already busy with the next step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

import torch

__all__ = [
    "SYNCHRONIZERS",
    "TIMING_EVENTS",
    "TimingEvent",
    "record_timing_event",
    "register_synchronizer",
    "register_timing_events",
    "synchronize",
]

Synchronizer = Callable[[torch.device], None]


class TimingEvent(Protocol):
    """A point in a device's queue with the device's own timestamp (what `torch.cuda.Event(enable_timing=True)` is):
    `synchronize()` waits until the device has done the work queued before it, `elapsed_time(later)` is the device
    time in milliseconds from this event to `later`, both reached."""

    def synchronize(self) -> None: ...

    def elapsed_time(self, end_event: Any, /) -> float: ...


def _cuda(device: torch.device) -> None:
    torch.cuda.synchronize(device)


def _hpu(device: torch.device) -> None:
    """Not yet validated on Gaudi hardware. In lazy mode this also flushes the accumulated graph."""
    from gaudi3_scale.device.hpu import torch_hpu

    torch_hpu().synchronize()


def _xpu(device: torch.device) -> None:
    torch.xpu.synchronize(device)


def _mps(device: torch.device) -> None:
    torch.mps.synchronize()


def _host(device: torch.device) -> None:
    """CPU (and meta) work is finished when the call that queued it returns."""


SYNCHRONIZERS: dict[str, Synchronizer] = {
    "cpu": _host,
    "meta": _host,
    "cuda": _cuda,
    "hpu": _hpu,
    "xpu": _xpu,
    "mps": _mps,
}


def _cuda_event(device: torch.device) -> TimingEvent:
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


# Devices whose queue can be marked without waiting. Gaudi (HPU) is left out until validated there: its clock
# synchronises at every reading instead.
TIMING_EVENTS: dict[str, Callable[[torch.device], TimingEvent]] = {"cuda": _cuda_event}


def record_timing_event(device: torch.device | str) -> TimingEvent | None:
    """A timing event recorded now on `device`'s current stream, or None where the device type has none (the
    caller then synchronises instead)."""
    device = torch.device(device)
    record = TIMING_EVENTS.get(device.type)
    return None if record is None else record(device)


def synchronize(device: torch.device | str) -> None:
    """Block until `device` has finished all queued work; an unknown device type is an error, never a silent skip
    (a skipped synchronise is exactly the wrong-throughput bug this module exists to prevent)."""
    device = torch.device(device)
    try:
        sync = SYNCHRONIZERS[device.type]
    except KeyError:
        known = ", ".join(sorted(SYNCHRONIZERS))
        raise ValueError(
            f"no synchronize for device type {device.type!r}; known: {known} (add one with register_synchronizer)"
        ) from None
    sync(device)


def register_synchronizer(device_type: str, sync: Synchronizer) -> AbstractContextManager[None]:
    """Use `sync` for `device_type` inside the block (the previous one, if any, comes back afterwards)."""
    return _registered(SYNCHRONIZERS, device_type, sync)


def register_timing_events(
    device_type: str, record: Callable[[torch.device], TimingEvent]
) -> AbstractContextManager[None]:
    """Use `record` for `device_type`'s timing events inside the block (tests: a fake asynchronous device)."""
    return _registered(TIMING_EVENTS, device_type, record)


@contextmanager
def _registered(registry: dict[str, Any], device_type: str, entry: Any) -> Iterator[None]:
    previous = registry.get(device_type)
    registry[device_type] = entry
    try:
        yield
    finally:
        if previous is None:
            del registry[device_type]
        else:
            registry[device_type] = previous
