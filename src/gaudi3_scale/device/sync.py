"""Wait for a device to finish the work queued on it: the one place a clock read meets an asynchronous device.

CUDA kernels and Gaudi ops (lazy and eager mode alike) run asynchronously: the host returns as soon as the work is
queued. A `time.perf_counter()` read before the device has finished measures how fast work was *launched*, not
done, so every throughput number taken on an accelerator must synchronise first. CPU work is done when the call
returns: synchronising there is a no-op.

`SYNCHRONIZERS` is a plain registry by `torch.device.type`; `register_synchronizer` adds a device (or, in the
tests, a fake one whose work completes only on synchronize, to prove every measurement boundary synchronises).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

__all__ = ["SYNCHRONIZERS", "register_synchronizer", "synchronize"]

Synchronizer = Callable[[torch.device], None]


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


@contextmanager
def register_synchronizer(device_type: str, sync: Synchronizer) -> Iterator[None]:
    """Use `sync` for `device_type` inside the block (the previous one, if any, comes back afterwards)."""
    previous = SYNCHRONIZERS.get(device_type)
    SYNCHRONIZERS[device_type] = sync
    try:
        yield
    finally:
        if previous is None:
            del SYNCHRONIZERS[device_type]
        else:
            SYNCHRONIZERS[device_type] = previous
