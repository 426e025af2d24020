"""Throughput is read after the device finished its work: a fake asynchronous device on CPU (tests/fake_device.py)
takes 50 ms per step that only a synchronise waits for, while the host needs a few ms. Every boundary that reads the
clock (window end, end of warm-up, validation pause) must synchronise, or these numbers come out several times too
fast — the bug the first H100 run found."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from fake_device import FakeAsyncDevice, LaunchPerStep
from gaudi3_scale.config.core import parse_overrides
from gaudi3_scale.device.sync import register_synchronizer, register_timing_events, synchronize
from gaudi3_scale.monitor.clock import DeviceClock
from gaudi3_scale.train import GaudiTrainer, build_run_config

pytestmark = pytest.mark.integration

DEVICE_S = 0.05  # fake device time per step; the host's is ~3 ms for this model


TINY = ["--train.threads", "1", "--model.num_layers", "1", "--model.dim", "32", "--model.num_heads", "2",
        "--model.context_length", "16", "--train.global_batch_size", "2", "--checkpoint.enabled", "false",
        "--train.val_batches", "1"]  # fmt: skip


def _tiny(out: Path, *extra: str):
    return build_run_config(None, parse_overrides(["--out_dir", str(out), *TINY, *extra]))


def _records(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("tokens_per_s")]


@contextmanager
def _on(device: FakeAsyncDevice, *, events: bool) -> Iterator[None]:
    """The fake device as the `cpu` device: its synchronize, and (`events`) its timing events, as CUDA has."""
    with register_synchronizer("cpu", device.synchronize), contextlib.ExitStack() as stack:
        if events:
            stack.enter_context(register_timing_events("cpu", device.record_event))
        yield


@pytest.mark.parametrize("events", [False, True], ids=["synchronize", "timing-events"])
def test_every_measurement_boundary_waits_for_the_device(tmp_path: Path, events: bool) -> None:
    device = FakeAsyncDevice()
    cfg = _tiny(tmp_path, "--train.max_steps", "12", "--train.log_every_steps", "6",
                "--train.val_every_steps", "3", "--train.throughput_warmup_steps", "2")  # fmt: skip
    with _on(device, events=events):
        summary = GaudiTrainer(
            cfg, progress=False, callbacks=[LaunchPerStep(device, lambda m: DEVICE_S)]
        ).fit()
    records = _records(tmp_path)
    assert [r["step"] for r in records] == [6, 12]
    # Each 6-step window holds a validation after step 3 or 9: the pause must synchronise first, or the 3 steps of
    # queued device work drain inside the pause and drop out of the window.
    for r in records:
        assert r["step_time_s"] >= 0.95 * DEVICE_S, r
        assert r["tokens_per_s"] * r["step_time_s"] == pytest.approx(2 * 16)
    # The end of the warm-up synchronises: its 2 steps' device time is warm-up, not measured time.
    assert summary["warmup_steps"] == 2 and summary["warmup_s"] >= 2 * 0.95 * DEVICE_S
    assert summary["measured_steps"] == 10
    assert summary["step_time_s"] >= 0.95 * DEVICE_S
    assert summary["tokens_per_s"] == pytest.approx(2 * 16 / summary["step_time_s"])
    # Without timing events every boundary synchronises: window ends, the warm-up end, pause + resume around each
    # validation. With them, only the pauses do (and the start): window ends and the warm-up end are marks.
    assert device.syncs >= (2 + 1 + 4 if events else 2 + 4 + 4)


def test_window_ends_do_not_drain_the_device(tmp_path: Path) -> None:
    """With timing events (CUDA) a logging window ends at a mark, resolved a step later: the device is never
    synchronised at a window boundary (where it would sit idle while the host writes the record and queues the
    next step), yet every window and the summary still measure the device's time, not the host's."""
    device = FakeAsyncDevice()
    cfg = _tiny(tmp_path, "--train.max_steps", "12", "--train.log_every_steps", "2",
                "--train.val_every_steps", "0", "--train.throughput_warmup_steps", "2")  # fmt: skip
    syncs_after_step: list[int] = []

    class CountSyncs(LaunchPerStep):
        def on_train_batch_end(self, *args: object) -> None:
            syncs_after_step.append(device.syncs)

    with _on(device, events=True):
        summary = GaudiTrainer(cfg, progress=False, callbacks=[CountSyncs(device, lambda m: DEVICE_S)]).fit()
    assert len(syncs_after_step) == 12
    assert len(set(syncs_after_step)) == 1, f"a boundary inside training synchronised: {syncs_after_step}"
    records = _records(tmp_path)
    assert [r["step"] for r in records] == [2, 4, 6, 8, 10, 12]
    for r in records:
        assert 0.95 * DEVICE_S <= r["step_time_s"] < 1.5 * DEVICE_S, r
    assert summary["measured_steps"] == 10 and summary["warmup_steps"] == 2
    assert 0.95 * DEVICE_S <= summary["step_time_s"] < 1.2 * DEVICE_S


def test_a_mark_reads_the_time_the_device_reached_it() -> None:
    """Resolved long after the device got there, a mark still reads when it did (the device's timestamp)."""
    device = FakeAsyncDevice()
    with _on(device, events=True):
        clock = DeviceClock("cpu")
        start = clock.now()
        device.launch(0.1)
        when = clock.mark()
        time.sleep(0.4)
        assert 0.095 <= when() - start < 0.3
    assert device.syncs == 1  # the mark did not synchronise


def test_summary_leaves_the_warmup_out(tmp_path: Path) -> None:
    """A slow start (compilation on an accelerator: 0.5 s here on the first step) stays out of tokens/s, MFU and
    step time, and is reported on its own; the metrics records keep the raw window."""
    device = FakeAsyncDevice()
    first = {"done": False}

    def seconds(module: object) -> float:
        slow = not first["done"]
        first["done"] = True
        return 0.5 if slow else DEVICE_S

    cfg = _tiny(tmp_path, "--train.max_steps", "10", "--train.log_every_steps", "5",
                "--train.val_every_steps", "0")  # fmt: skip
    with register_synchronizer("cpu", device.synchronize):
        summary = GaudiTrainer(cfg, progress=False, callbacks=[LaunchPerStep(device, seconds)]).fit()
    assert summary["warmup_steps"] == 2  # the default rule without compile
    assert summary["warmup_s"] >= 0.5 + 0.95 * DEVICE_S
    assert summary["measured_steps"] == 8
    assert DEVICE_S * 0.95 <= summary["step_time_s"] < DEVICE_S + 0.05
    records = _records(tmp_path)
    assert records[0]["step_time_s"] >= (0.5 + 4 * DEVICE_S) / 5 * 0.95  # raw: the slow step is in it
    assert summary["mfu"] == pytest.approx(
        summary["tokens_per_s"] / records[-1]["tokens_per_s"] * records[-1]["mfu"]
    )


def test_device_clock_synchronises_before_reading() -> None:
    device = FakeAsyncDevice()
    with register_synchronizer("cpu", device.synchronize):
        clock = DeviceClock("cpu")
        start = clock.now()
        device.launch(0.1)
        assert clock.now() - start >= 0.095
    assert device.syncs == 2


def test_synchronize_refuses_an_unknown_device_type() -> None:
    with pytest.raises(ValueError, match="no synchronize for device type 'fpga'"):
        synchronize("fpga")
