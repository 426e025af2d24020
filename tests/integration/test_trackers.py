"""Experiment trackers on a real tiny run: TensorBoard events, the MLflow file store and the CSV file read back and
compared with metrics.jsonl; a crashed run ends FAILED in MLflow; a tracker that is missing is one line, exit 2."""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import pytest
import yaml

from gaudi3_scale.config.core import parse_overrides
from gaudi3_scale.train import GaudiTrainer, build_run_config

pytestmark = pytest.mark.integration

CliResult = tuple[int, str, str]
# micro_batch_size 6 of global 12: two micro-batches per optimizer step, so a value logged at Lightning's own batch
# count (steps × 2) instead of the optimizer step shows up as a wrong step.
TINY = ["--model.num_layers", "1", "--train.threads", "1", "--train.max_steps", "20", "--train.log_every_steps", "5",
        "--train.val_every_steps", "10", "--train.val_batches", "2", "--train.micro_batch_size", "6",
        "--optim.warmup_steps", "2", "--checkpoint.enabled", "false"]  # fmt: skip


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("tracked") / "run"
    args = ["train", "--sample-tokens", "0", "--no-progress", "--out", str(out), "--name", "tracked", *TINY,
            "--monitor.loggers", "csv,tensorboard,mlflow"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "gaudi3_scale.cli", *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    # Neither Lightning's logger connector nor MLflow / TensorBoard talk on the terminal.
    assert not [line for line in proc.stderr.splitlines() if line.strip()], proc.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return out, records


def _series(records: list[dict], field: str) -> list[tuple[int, float]]:
    return [(r["step"], r[field]) for r in records if r.get(field) is not None]


def test_tensorboard_scalars_match_metrics_jsonl(tracked_run: tuple[Path, list[dict]]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, records = tracked_run
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()

    def scalars(tag: str) -> list[tuple[int, float]]:
        return [(e.step, e.value) for e in events.Scalars(tag)]

    train = _series(records, "train_loss")
    assert [s for s, _ in train] == [5, 10, 15, 20]
    assert scalars("train/loss") == [(s, pytest.approx(v, rel=1e-6)) for s, v in train]  # float32 in the file
    assert scalars("perf/mfu") == [(s, pytest.approx(v, rel=1e-6)) for s, v in _series(records, "mfu")]
    val = _series(records, "val_loss")
    assert [s for s, _ in val] == [10, 20]
    assert scalars("val/loss") == [
        (s, pytest.approx(v, rel=1e-6)) for s, v in val
    ]  # once, at optimizer steps
    text = events.Tensors("config.yaml/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "    num_layers: 1" in text and "    loggers: csv,tensorboard,mlflow" in text
    hparams = yaml.safe_load((out / "tensorboard" / "hparams.yaml").read_text())
    assert hparams["model.num_layers"] == 1 and hparams["train.micro_batch_size"] == 6


def test_mlflow_file_store_holds_metrics_params_and_config(
    tracked_run: tuple[Path, list[dict]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    out, records = tracked_run
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # reading it back needs what writing it needed
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    client = MlflowClient((out / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("tracked")  # monitor.experiment null: the run name
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == _series(records, "train_loss")  # float64: exact
    tokens = client.get_metric_history(run.info.run_id, "perf/tokens_per_s")
    assert [(m.step, m.value) for m in tokens] == _series(records, "tokens_per_s")
    val = client.get_metric_history(run.info.run_id, "val/loss")
    assert [(m.step, m.value) for m in val] == [
        (s, pytest.approx(v, rel=1e-6)) for s, v in _series(records, "val_loss")
    ]
    params = run.data.params
    assert (
        params["model.num_layers"] == "1"
        and params["train.max_steps"] == "20"
        and params["name"] == "tracked"
    )
    assert params["monitor.loggers"] == "csv,tensorboard,mlflow"
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["config.yaml"]
    artifact = Path(run.info.artifact_uri.removeprefix("file://")) / "config.yaml"
    assert artifact.read_text() == (out / "config.yaml").read_text()


def test_csv_logger_file_matches_metrics_jsonl(tracked_run: tuple[Path, list[dict]]) -> None:
    out, records = tracked_run
    with (out / "csv" / "version_0" / "metrics.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    train = [(int(r["step"]), float(r["train/loss"])) for r in rows if r["train/loss"]]
    assert train == _series(records, "train_loss")  # the text holds Python's repr: exact
    val = [(int(r["step"]), float(r["val/loss"])) for r in rows if r["val/loss"]]
    assert val == [(s, pytest.approx(v, rel=1e-6)) for s, v in _series(records, "val_loss")]
    lr = [(int(r["step"]), float(r["train/lr"])) for r in rows if r["train/lr"]]
    assert lr == _series(records, "lr")
    assert yaml.safe_load((out / "csv" / "version_0" / "hparams.yaml").read_text())["model.num_layers"] == 1


class _CrashAtStep(pl.Callback):
    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step == 12:
            raise RuntimeError("crash for the test")


def test_crashed_run_ends_failed_in_mlflow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # set by the tracker too; restored after the test
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    out = tmp_path / "run"
    overrides = ["--out_dir", str(out), "--name", "crash", *TINY, "--monitor.loggers", "mlflow",
                 "--monitor.experiment", "crashes", "--train.val_every_steps", "0"]  # fmt: skip
    trainer = GaudiTrainer(
        build_run_config(None, parse_overrides(overrides)), callbacks=[_CrashAtStep()], progress=False
    )
    with pytest.raises(RuntimeError, match="crash for the test"):
        trainer.fit()
    client = MlflowClient((out / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("crashes")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [5, 10]


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_wandb_not_installed_is_one_line_exit_2(tmp_path: Path, gaudi3_cli: Callable[..., CliResult]) -> None:
    code, _out, err = gaudi3_cli("train", "--sample-tokens", "0", "--no-progress", "--out", str(tmp_path / "w"),
                                 *TINY, "--monitor.loggers", "csv,wandb")  # fmt: skip
    assert code == 2
    assert err.strip() == "gaudi3: error: monitor.loggers: wandb is not installed: pip install wandb"
    assert not (tmp_path / "w" / "csv").exists() and not (tmp_path / "w" / "metrics.jsonl").exists()


def test_unknown_logger_is_one_line_exit_2(tmp_path: Path, gaudi3_cli: Callable[..., CliResult]) -> None:
    code, _out, err = gaudi3_cli(
        "train", "--out", str(tmp_path / "u"), "--monitor.loggers", "tensorboard,neptune"
    )
    assert code == 2
    assert err.strip() == (
        "gaudi3: error: monitor.loggers: unknown logger(s) neptune; allowed: csv, tensorboard, mlflow, wandb "
        "(comma-separated)"
    )
    assert not (tmp_path / "u").exists()
