"""What a run keeps in memory per step or per save stays bounded however long it runs: a soak of 120,000 steps
grew its RSS by ~286 bytes a step (every metrics record kept in a list nothing read), and summary.json by one
number per checkpoint save (6,000 saves: 135 kB of its 174 kB)."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

from gaudi3_scale.distributed.plan import BatchPlan
from gaudi3_scale.monitor.durations import Durations
from gaudi3_scale.train.step import StepState
from gaudi3_scale.train.step_metrics import RunMetrics


def test_checkpoint_save_durations_keep_the_newest_and_the_totals() -> None:
    saves = Durations(keep=64)
    for i in range(10_000):
        saves.add(0.001 * (i % 97))
    summary = saves.summary("checkpoint_blocking")
    assert len(summary["checkpoint_blocking_s"]) == 64
    assert summary["checkpoint_blocking_s"][-1] == 0.001 * (9_999 % 97)
    assert summary["checkpoint_blocking_count"] == 10_000
    assert summary["checkpoint_blocking_max_s"] == 0.001 * 96
    assert saves.snapshot() == (10_000, 0.001 * (9_999 % 97))


def test_run_metrics_keep_no_record_once_written(tmp_path: Path) -> None:
    batch = BatchPlan.build(global_batch_size=2, micro_batch_size=2, data_parallel_size=1, context_length=16)
    metrics = RunMetrics(tmp_path / "metrics.jsonl", log_every_steps=1, state=StepState.for_plan(batch, flops_per_token=None),
                         peak_flops_per_device=None, data_parallel_size=1)  # fmt: skip
    seen: list[int] = []
    metrics.listeners.append(lambda record: seen.append(record["step"]))
    record = {"step": 0, "health_event": "loss_spike", "loss": 2.5, "median": 2.0, "mad": 0.1}
    for step in range(200):  # warm
        metrics.event({**record, "step": step})
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for step in range(200, 20_200):
        metrics.event({**record, "step": step})
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(seen) == 20_200  # every record reached the listeners
    assert grown < 1_000_000, f"{grown} bytes kept for 20,000 records"  # was 4.7 MB (a list of every record)


def test_two_scrapes_at_once_count_each_save_once() -> None:
    """The metrics server is threaded: a scrape that read the saves' count before a save landed must not move the
    exporter's mark back once a later scrape has counted that save (it was counted twice)."""
    import threading

    from prometheus_client import CollectorRegistry

    from gaudi3_scale.monitor.prometheus import MetricsExporter

    registry = CollectorRegistry()
    exporter = MetricsExporter(registry, rank=0, run="r", tokens_per_step=1)
    saves = Durations()
    exporter.track_checkpoint_saves(saves)
    for _ in range(5):
        saves.add(0.1)
    exporter.sync_checkpoint_saves()
    snapshot, read, resume = saves.snapshot, threading.Event(), threading.Event()

    def late_snapshot() -> tuple[int, float | None]:  # scrape A: reads the count, then is descheduled
        taken = snapshot()
        if threading.current_thread().name == "A":
            read.set()
            resume.wait(10)
        return taken

    saves.snapshot = late_snapshot  # type: ignore[method-assign]
    scrape_a = threading.Thread(target=exporter.sync_checkpoint_saves, name="A")
    scrape_a.start()
    read.wait(10)
    saves.add(0.2)  # the sixth save lands
    exporter.sync_checkpoint_saves()  # scrape B counts it
    resume.set()
    scrape_a.join(10)
    saves.snapshot = snapshot  # type: ignore[method-assign]
    exporter.sync_checkpoint_saves()  # the next scrape
    assert registry.get_sample_value("gaudi3_checkpoint_saves_total", {"rank": "0", "run": "r"}) == 6
