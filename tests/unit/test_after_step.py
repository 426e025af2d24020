"""`AfterStep` is the one place that runs what follows an optimizer step, and its lines are the order: cost →
metrics → stop agreement → health → checkpoint → profiler → progress. The parts here only record when they are
called (the real ones are exercised by every training test); what is tested is the dispatcher's order."""

from __future__ import annotations

import inspect
from typing import Any

from gaudi3_scale.train import after_step
from gaudi3_scale.train.after_step import AfterStep


class _Part:
    ends_fit = False  # the health part's flag: no rollback or stop asked for
    save_requested = False  # the checkpoint's: no stop agreed
    interrupted = False  # the stop's: no stop agreed

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def __getattr__(self, method: str) -> Any:
        def record(*args: Any, **kwargs: Any) -> None:
            self.log.append(f"{self.name}.{method}")

        return record


def _after(log: list[str]) -> AfterStep:
    parts = {name: _Part(name, log) for name in ("cost", "metrics", "stop", "health", "checkpoint", "profiler",
                                                  "progress")}  # fmt: skip
    return AfterStep(**parts)  # type: ignore[arg-type]


def test_after_a_step_the_parts_run_in_the_written_order() -> None:
    log: list[str] = []
    _after(log).after_step(trainer=None, pl_module=None)  # type: ignore[arg-type]
    assert log == ["cost.after_step", "metrics.after_step", "stop.after_step", "health.after_step",
                   "checkpoint.after_step", "profiler.after_step", "progress.after_step"]  # fmt: skip


def test_the_other_hooks_keep_one_order_too() -> None:
    log: list[str] = []
    after = _after(log)
    after.on_train_start(None, None)  # type: ignore[arg-type]
    assert log == ["cost.start", "metrics.start", "stop.start", "checkpoint.start", "profiler.start",
                   "progress.start"]  # fmt: skip
    log.clear()
    after.on_validation_end(None, None)  # type: ignore[arg-type]
    assert log == [
        "metrics.validation_end",
        "checkpoint.validation_end",
    ]  # the loss recorded, then saved with it
    log.clear()
    after.on_train_end(None, None)  # type: ignore[arg-type]
    # the signal handlers stay the run's until the final save committed (a Ctrl-C in it is recorded, not raised)
    assert log == [
        "metrics.end",
        "stop.settle",
        "checkpoint.end",
        "stop.end",
        "progress.stop",
        "profiler.end",
    ]


def test_checkpoint_hooks_write_and_restore_the_registered_entries() -> None:
    """Lightning's save/load hooks go to the run's `CheckpointContents`: each owner's entry, meta merged."""
    from gaudi3_scale.checkpoint.checkpointer import Checkpointer
    from gaudi3_scale.checkpoint.contents import META_KEY, CheckpointContents, FixedState

    class Meter:
        def __init__(self, value: float) -> None:
            self.value = value

        def state_dict(self) -> dict[str, float]:
            return {"cost_usd": self.value}

        def load_state_dict(self, state: dict[str, float]) -> None:
            self.value = state.get("cost_usd", 0.0)

    contents = CheckpointContents()
    contents.register("config", FixedState({"lr": 1.0}), light=True)
    meter = Meter(2.5)
    contents.register("cost", meter, meta=True)
    after = _after([])
    after.checkpoint.checkpointer = type("C", (), {"contents": contents, "load": Checkpointer.load})()  # type: ignore[union-attr]
    saved: dict[str, Any] = {"state_dict": {}}
    after.on_save_checkpoint(None, None, saved)  # type: ignore[arg-type]
    assert saved == {"state_dict": {}, "config": {"lr": 1.0}, META_KEY: {"cost_usd": 2.5}}
    meter.value = 0.0
    after.on_load_checkpoint(None, None, saved)  # type: ignore[arg-type]
    assert meter.value == 2.5


def test_no_other_module_of_the_trainer_hooks_the_step() -> None:
    """Only AfterStep implements on_train_batch_end among the trainer's own callbacks (train/*.py)."""
    import importlib
    import pkgutil

    import gaudi3_scale.train as train_pkg

    hooks = []
    for info in pkgutil.iter_modules(train_pkg.__path__):
        if info.name.startswith("_"):  # __main__ is the torchrun entry point: it parses sys.argv
            continue
        module = importlib.import_module(f"gaudi3_scale.train.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__ and "on_train_batch_end" in vars(cls):
                hooks.append(f"{module.__name__}.{cls.__name__}")
    assert hooks == [f"{after_step.__name__}.AfterStep"], hooks


def test_the_watchdog_hears_each_step_and_section(tmp_path: Any) -> None:
    """health.watchdog: steps from the train start, a beat before the step's parts, validation in between. The
    watchdog is a real one, not started (its sections and beats are attributes; no thread, no file)."""
    from gaudi3_scale.health.config import HealthConfig
    from gaudi3_scale.health.watchdog import Watchdog

    log: list[str] = []
    after = _after(log)
    watchdog = after.watchdog = Watchdog(HealthConfig(), tmp_path, rank=0, local_rank=0, local_world_size=1,
                                         warmup_steps=0)  # fmt: skip
    trainer = type("T", (), {"global_step": 7})()
    assert watchdog.section == "setup"
    after.on_train_start(trainer, None)  # type: ignore[arg-type]
    assert watchdog.section == "step" and log[-1] == "progress.start"
    beat_before = watchdog.last_beat_s
    after.on_train_batch_end(trainer, object(), None, None, 0)  # type: ignore[arg-type]
    assert watchdog.step == 7 and watchdog.last_beat_s > beat_before
    after.on_validation_start(trainer, None)  # type: ignore[arg-type]
    assert watchdog.section == "validation"
    after.on_validation_end(trainer, None)  # type: ignore[arg-type]
    assert watchdog.section == "step"
