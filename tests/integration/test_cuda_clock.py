"""The clock's claims on a real CUDA device (skipped without one): a mark reads the GPU's own timestamp, and a
training run's window ends neither drain the GPU nor read a time the GPU had not reached. The CPU tests prove the
same with a fake asynchronous device (test_throughput_clock.py); these are for a lent GPU session:
`PYTHONPATH=src python -m pytest -q tests/integration/test_cuda_clock.py`."""

from __future__ import annotations

import json
import time
from functools import cache
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # before the Lightning import: a skip here costs nothing
    pytest.skip("needs a CUDA device", allow_module_level=True)

import lightning.pytorch as pl

from gaudi3_scale.config.core import parse_overrides
from gaudi3_scale.device.sync import register_synchronizer
from gaudi3_scale.monitor.clock import DeviceClock
from gaudi3_scale.train import GaudiTrainer, build_run_config

pytestmark = pytest.mark.integration

STEP_S = 0.05  # GPU time added to every training step


@cache
def _cycles_per_s() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm up
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    end.synchronize()
    return 50_000_000 / (start.elapsed_time(end) / 1e3)


def _spin(seconds: float) -> None:
    """Queue `seconds` of GPU work; returns at once."""
    torch.cuda._sleep(int(seconds * _cycles_per_s()))


def test_a_mark_reads_the_gpu_timestamp_not_the_host_time() -> None:
    _cycles_per_s()
    clock = DeviceClock("cuda")
    start = clock.now()
    _spin(0.1)
    when = clock.mark()
    time.sleep(0.3)  # the GPU reached the mark long before the host asks
    assert 0.09 <= when() - start < 0.2


def test_window_ends_measure_the_gpu_and_do_not_drain_it(tmp_path: Path) -> None:
    _cycles_per_s()
    syncs: list[int] = [0]
    after_step: list[int] = []

    def counting_sync(device: torch.device) -> None:
        syncs[0] += 1
        torch.cuda.synchronize(device)

    class Spin(pl.Callback):
        def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            _spin(STEP_S)

        def on_train_batch_end(self, *args: object) -> None:
            after_step.append(syncs[0])

    overrides = ["--out_dir", str(tmp_path), "--train.device", "cuda", "--model.num_layers", "1",
                 "--model.dim", "32", "--model.num_heads", "2", "--model.context_length", "16",
                 "--train.global_batch_size", "2", "--checkpoint.enabled", "false", "--train.val_every_steps", "0",
                 "--train.val_batches", "1", "--train.max_steps", "12", "--train.log_every_steps", "2",
                 "--train.throughput_warmup_steps", "2"]  # fmt: skip
    with register_synchronizer("cuda", counting_sync):
        summary = GaudiTrainer(build_run_config(None, parse_overrides(overrides)), progress=False,
                               callbacks=[Spin()]).fit()  # fmt: skip
    assert len(after_step) == 12 and len(set(after_step)) == 1, f"a window end synchronised: {after_step}"
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    windows = [r for r in records if r.get("tokens_per_s")]
    assert [r["step"] for r in windows] == [2, 4, 6, 8, 10, 12]
    for r in windows[1:]:  # the first window holds the warm-up
        assert 0.95 * STEP_S <= r["step_time_s"] < 1.5 * STEP_S, r
    assert 0.95 * STEP_S <= summary["step_time_s"] < 1.2 * STEP_S
