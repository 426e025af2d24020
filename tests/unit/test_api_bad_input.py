"""Mistakes a user plausibly makes calling the public Python API (not the CLI): each answered with one line naming
the argument and what is allowed, before any work, and nothing of theirs changed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import gaudi3_scale
from gaudi3_scale.config.errors import ConfigError
from gaudi3_scale.train.config import build_run_config

SRC = str(Path(gaudi3_scale.__file__).parents[1])


def test_fit_refuses_a_project_directory_whose_checkpoints_folder_is_another_tools(tmp_path: Path) -> None:
    from gaudi3_scale.train.trainer import GaudiTrainer

    project = tmp_path / "proj"
    (project / "checkpoints").mkdir(parents=True)
    files = {
        "config.yaml": "my own project config\n",
        "summary.json": '{"mine": 1}\n',
        "checkpoints/model.pt": "w\n",
    }
    for name, text in files.items():
        (project / name).write_text(text)
    cfg = build_run_config(
        None,
        [("name", "proj"), ("out_dir", str(project)), ("model.name", "llama-tiny"), ("train.max_steps", "2")],
    )
    with pytest.raises(ConfigError, match=r"holds config\.yaml but no gaudi3 run"):
        GaudiTrainer(cfg, progress=False).fit()
    assert {
        p.relative_to(project).as_posix(): p.read_text() for p in project.rglob("*") if p.is_file()
    } == files


def test_gaudi3_train_refuses_the_same_project_directory(tmp_path: Path) -> None:
    project = tmp_path / "proj"
    (project / "checkpoints").mkdir(parents=True)
    (project / "config.yaml").write_text("my own project config\n")
    (project / "checkpoints" / "model.pt").write_text("w\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")]))}
    argv = ["train", "--out", str(project), "--model.name", "llama-tiny", "--train.max_steps", "2"]
    done = subprocess.run([sys.executable, "-m", "gaudi3_scale.cli", *argv], capture_output=True, text=True,
                          env=env, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "holds config.yaml but no gaudi3 run" in done.stderr and "Traceback" not in done.stderr
    assert sorted(p.name for p in project.rglob("*")) == ["checkpoints", "config.yaml", "model.pt"]
    assert (project / "config.yaml").read_text() == "my own project config\n"


def test_override_values_may_be_paths_numbers_or_key_value_strings(tmp_path: Path) -> None:
    from gaudi3_scale.train.config import resolve_config

    assert resolve_config(None, [], out_dir=tmp_path / "r").out_dir == str(tmp_path / "r")
    cfg = build_run_config(None, [("out_dir", tmp_path / "a"), ("train.max_steps", 3), "optim.lr=0.5"])
    assert (cfg.out_dir, cfg.train.max_steps, cfg.optim.lr) == (str(tmp_path / "a"), 3, 0.5)
    assert (
        build_run_config(None, ["out_dir=runs/a=b=c"]).out_dir == "runs/a=b=c"
    )  # everything after the first '='


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["train.max_steps"],
            r"^overrides: expected key=value \(or a \(key, value\) pair\), got 'train.max_steps'$",
        ),
        (["=3"], r"^overrides: expected key=value .*got '=3'$"),
        ([("train.max_steps",)], r"^overrides: expected key=value .*got \('train.max_steps',\)$"),
        (
            [("train.max_steps", [3])],
            r"^train.max_steps: an override value is text, a path or a number, got \[3\]$",
        ),
        ([("train.max_steps", 2.5)], r"^train.max_steps: expected an integer, got 2.5$"),
    ],
)
def test_a_malformed_override_is_one_line_naming_it(overrides: list, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_run_config(None, overrides)


def test_export_of_a_run_directory_ships_its_tokenizer_like_its_checkpoint(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    from gaudi3_scale.artifacts.export import export_checkpoint
    from gaudi3_scale.train.trainer import GaudiTrainer

    run = tmp_path / "run"
    overrides = [("out_dir", str(run)), ("model.name", "llama-tiny"), ("train.max_steps", "1"),
                 ("train.val_every_steps", "0"), ("train.threads", "2")]  # fmt: skip
    GaudiTrainer(build_run_config(None, overrides), progress=False).fit()
    from_run = export_checkpoint(run, tmp_path / "from-run")
    from_ckpt = export_checkpoint(run / "checkpoints" / "latest", tmp_path / "from-ckpt")
    names = sorted(p.relative_to(tmp_path / "from-run").as_posix() for p in from_run)
    assert names == sorted(p.relative_to(tmp_path / "from-ckpt").as_posix() for p in from_ckpt)
    assert "tokenizer/tokenizer.json" in names
    assert (tmp_path / "from-run/tokenizer/tokenizer.json").read_bytes() == (
        run / "tokenizer/tokenizer.json"
    ).read_bytes()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_steps": 2.5}, r"^max_steps: expected an integer, got 2.5$"),
        ({"max_steps": None}, r"^max_steps: expected an integer, got None$"),
        ({"max_steps": True}, r"^max_steps: expected an integer, got True$"),
        ({"global_batch_size": "8"}, r"^global_batch_size: expected an integer, got '8'$"),
        (
            {"val_every_steps": 0, "max_steps": 3, "log_every_steps": 1.5},
            r"^log_every_steps: expected an integer",
        ),
    ],
)
def test_train_config_built_in_python_checks_types_like_yaml(kwargs: dict, message: str) -> None:
    from gaudi3_scale.train.train_config import TrainConfig

    with pytest.raises(ConfigError, match=message):
        TrainConfig(**kwargs)


def test_train_config_takes_a_whole_float_as_yaml_does() -> None:
    from gaudi3_scale.train.train_config import TrainConfig

    steps = TrainConfig(max_steps=3.0).max_steps
    assert (steps, type(steps)) == (3, int)


@pytest.mark.parametrize(
    ("source", "message"),
    [(None, r"^source: expected a string, got None$"), (3, r"^source: expected a string, got 3$")],
)
def test_data_config_source_must_be_text(source: object, message: str) -> None:
    from gaudi3_scale.data.config import DataConfig

    with pytest.raises(ConfigError, match=message):
        DataConfig(source=source)  # type: ignore[arg-type]


def test_data_config_takes_a_path_source_as_its_text(tmp_path: Path) -> None:
    from gaudi3_scale.data.config import DataConfig

    assert DataConfig(source=tmp_path / "a.txt").source == str(tmp_path / "a.txt")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("section", "value", "message"),
    [
        ("train", {"max_steps": 2}, r"^train: expected a TrainConfig, got \{'max_steps': 2\}; a mapping of fields: "
         r"build_run_config\(base=\{'train': \.\.\.\}\)$"),
        ("model", "llama-tiny", r"^model: expected a ModelConfig, got 'llama-tiny'$"),
        ("health", 5, r"^health: expected a HealthConfig, got 5$"),
    ],
)  # fmt: skip
def test_run_config_sections_must_be_their_config_classes(section: str, value: object, message: str) -> None:
    from gaudi3_scale.train.config import RunConfig

    with pytest.raises(ConfigError, match=message):
        RunConfig(**{section: value})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^seed: expected an integer, got 'x'$"):
        RunConfig(seed="x")  # type: ignore[arg-type]


def test_the_mapping_route_the_refusal_names_builds_the_preset() -> None:
    cfg = build_run_config(base={"train": {"max_steps": 2}, "model": {"name": "llama-tiny"}})
    assert (cfg.train.max_steps, cfg.model.name) == (2, "llama-tiny")


def test_gaudi_trainer_takes_a_config_files_path(tmp_path: Path) -> None:
    from gaudi3_scale.config.errors import UserInputError
    from gaudi3_scale.train.trainer import GaudiTrainer

    path = tmp_path / "run.yaml"
    path.write_text("model:\n  name: llama-tiny\ntrain:\n  max_steps: 7\n")
    for given in (path, str(path)):
        cfg = GaudiTrainer(given, progress=False).config
        assert (cfg.model.name, cfg.train.max_steps) == ("llama-tiny", 7)
    with pytest.raises(UserInputError, match=r"^GaudiTrainer takes a RunConfig or a config file's path, got "
                                             r"a dict; a mapping of fields: build_run"):  # fmt: skip
        GaudiTrainer({"train": {"max_steps": 2}})  # type: ignore[arg-type]
    with pytest.raises(UserInputError, match=r"^config file '.*no-such\.yaml' does not exist$"):
        GaudiTrainer(tmp_path / "no-such.yaml")


def test_fit_refuses_a_module_of_the_other_lightning_namespace_in_one_line() -> None:
    import pytorch_lightning
    import torch

    from gaudi3_scale.config.errors import UserInputError
    from gaudi3_scale.train.trainer import GaudiTrainer

    class Theirs(pytorch_lightning.LightningModule):
        pass

    trainer = GaudiTrainer(build_run_config(None, [("train.max_steps", "1")]), progress=False)
    with pytest.raises(UserInputError, match=r"^GaudiTrainer.fit: model Theirs derives from pytorch_lightning\."
                                             r"LightningModule, but the trainer runs lightning\.pytorch; subclass "
                                             r"lightning\.pytorch\.LightningModule instead$"):  # fmt: skip
        trainer.fit(Theirs())
    with pytest.raises(UserInputError, match=r"^GaudiTrainer.fit: model must be a lightning\.pytorch\."
                                             r"LightningModule, got Linear$"):  # fmt: skip
        trainer.fit(torch.nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(UserInputError, match=r"^GaudiTrainer.fit: datamodule DataModule derives from "
                                             r"pytorch_lightning\.LightningDataModule"):  # fmt: skip
        trainer.fit(datamodule=type("DataModule", (pytorch_lightning.LightningDataModule,), {})())
    assert trainer.trainer is None  # refused before anything was built


def test_max_steps_null_beside_max_epochs_is_left_unset(tmp_path: Path) -> None:
    """`max_epochs: 1` with `max_steps: null` (a probe's `--train.max_steps null`, or a YAML that nulls it) was
    refused as "1 and train.max_steps None are both set"; both set to numbers still is."""
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  max_epochs: 1\n  max_steps: null\n")
    cfg = build_run_config(path)
    assert cfg.train.max_epochs == 1
    assert (
        build_run_config(None, [("train.max_epochs", "2"), ("train.max_steps", "null")]).train.max_epochs == 2
    )
    with pytest.raises(ConfigError, match=r"^train.max_epochs: 1 and train.max_steps 5 are both set"):
        build_run_config(None, [("train.max_epochs", "1"), ("train.max_steps", "5")])
    with pytest.raises(ConfigError, match=r"^train.max_steps: expected an integer, got None$"):
        build_run_config(None, [("train.max_steps", "null")])
