"""The tracker side of `monitor.loggers`: metric names, the flat config, and the one line for a missing package."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from gaudi3_scale.config.errors import ConfigError
from gaudi3_scale.monitor.config import MonitorConfig, check_trackers
from gaudi3_scale.monitor.trackers import flatten_config, tracker_metrics
from gaudi3_scale.train.config import RunConfig


def test_records_become_namespaced_numeric_metrics() -> None:
    record = {
        "step": 40, "train_loss": 2.5, "lr": 1e-3, "grad_norm": None, "tokens_per_s": 900, "mfu": float("nan"),
        "peak_memory_bytes": 7, "peak_memory_bytes_per_rank": [7, 5], "cost_usd": 0.25, "cost_budget_warning": True,
        "spot_decision": None, "checkpoint/remote_backlog": 2.0, "val_loss": 2.4, "device": "cpu", "my_field": 3,
        "compute_s_per_rank": [0.01, 0.03], "stragglers": [1],  # rank numbers, not values: left out
        "wall_s": 12.5, "time_unix": 1.7e9,  # a date, not a value: left out
    }  # fmt: skip
    assert tracker_metrics(record) == {
        "train/loss": 2.5,
        "train/lr": 1e-3,
        "perf/tokens_per_s": 900.0,
        "perf/peak_memory_bytes": 7.0,
        "perf/peak_memory_bytes_per_rank/0": 7.0,
        "perf/peak_memory_bytes_per_rank/1": 5.0,
        "perf/compute_s_per_rank/0": 0.01,
        "perf/compute_s_per_rank/1": 0.03,
        "perf/wall_s": 12.5,
        "cost/usd": 0.25,
        "cost/budget_warning": 1.0,
        "checkpoint/remote_backlog": 2.0,
        "my_field": 3.0,
    }  # no step (the x axis), no None / NaN / text, no val_loss (the module logs val/loss itself)


def test_flat_config_has_dotted_section_fields() -> None:
    flat = flatten_config(RunConfig())
    assert flat["model.num_layers"] == 4 and flat["monitor.loggers"] == "" and flat["seed"] == 1337
    assert flat["model.vocab_size"] is None and not any(isinstance(v, dict) for v in flat.values())


@pytest.mark.parametrize(
    ("logger", "module", "line"),
    [
        ("mlflow", "mlflow", "monitor.loggers: mlflow is not installed: pip install 'gaudi3-scale[tracking]'"),
        ("tensorboard", "tensorboard", "monitor.loggers: tensorboard is not installed: pip install 'gaudi3-scale[tracking]'"),
        ("wandb", "wandb", "monitor.loggers: wandb is not installed: pip install wandb"),
    ],
)  # fmt: skip
def test_missing_package_names_the_install(
    logger: str, module: str, line: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # what an import of a missing package finds
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # Lightning's other TensorBoard writer
    with pytest.raises(ConfigError) as info:
        check_trackers(MonitorConfig(loggers=f"csv,{logger}"))
    assert str(info.value) == line


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="needs wandb installed")
def test_wandb_without_key_or_offline_mode_says_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with pytest.raises(
        ConfigError,
        match=r"^monitor\.loggers: wandb is not configured: set WANDB_API_KEY, or WANDB_MODE=offline",
    ):
        check_trackers(MonitorConfig(loggers="wandb"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    check_trackers(MonitorConfig(loggers="wandb"))
