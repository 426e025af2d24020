"""The light checkpoint tier (checkpoint.light_every_steps) in a real tiny run on CPU: when light checkpoints are
written, what they hold, their own retention, and that a resume never takes one while export does."""

from __future__ import annotations

import errno
import io
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from rich.console import Console

from gaudi3_scale.checkpoint.contents import CONFIG_KEY, EPOCH_KEY, GLOBAL_STEP_KEY, META_KEY, STATE_DICT_KEY
from gaudi3_scale.checkpoint.manifest import verify_checkpoint
from gaudi3_scale.config.core import parse_overrides
from gaudi3_scale.config.errors import ConfigError
from gaudi3_scale.train import GaudiTrainer, build_run_config
from gaudi3_scale.train.resume import resume_checkpoint
from gaudi3_scale.train.step import at_step_boundary

pytestmark = pytest.mark.integration

# Full checkpoints at 4, 8 and 10 (the end), keep 2; light ones at every other step, keep 2.
RUN = ["--train.threads", "1", "--model.num_layers", "1", "--optim.warmup_steps", "2", "--train.max_steps", "10",
       "--checkpoint.every_steps", "4", "--checkpoint.keep_last", "2",
       "--checkpoint.light_every_steps", "1", "--checkpoint.light_keep_last", "2"]  # fmt: skip
LIGHT_STEPS = [1, 2, 3, 5, 6, 7, 9]


def _config(out: Path, *extra: str) -> Any:
    return build_run_config(None, parse_overrides(["--out_dir", str(out), *RUN, *extra]))


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("step-*"))


class _Watch(pl.Callback):
    """After each optimizer step (and its saves: callbacks given to GaudiTrainer run after its own), which
    checkpoints exist; and the weights at step 9."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.seen: list[tuple[int, list[str], list[str]]] = []
        self.weights_at_9: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not at_step_boundary(pl_module):
            return
        trainer.strategy.checkpoint_io.wait()  # type: ignore[attr-defined]  # asynchronous saves: the commit
        step = trainer.global_step
        self.seen.append((step, _names(self.out / "light_checkpoints"), _names(self.out / "checkpoints")))
        if step == 9:
            self.weights_at_9 = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


@pytest.fixture(scope="module")
def light_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, _Watch]:
    out = tmp_path_factory.mktemp("light") / "run"
    watch = _Watch(out)
    GaudiTrainer(_config(out), progress=False, callbacks=[watch]).fit()
    return out, watch


def test_light_checkpoints_fall_on_their_steps_unless_a_full_one_does_and_keep_their_own_retention(
    light_run: tuple[Path, _Watch],
) -> None:
    out, watch = light_run
    ever = sorted({name for _, light, _ in watch.seen for name in light})
    assert ever == [f"step-{step:08d}" for step in LIGHT_STEPS]  # 4 and 8 are full steps: the full one wins
    assert all(len(light) <= 2 for _, light, _ in watch.seen)  # light_keep_last, applied at every commit
    assert _names(out / "light_checkpoints") == ["step-00000007", "step-00000009"]
    assert (out / "light_checkpoints" / "latest").read_text() == "step-00000009\n"
    # The full tier's own retention (keep_last 2), untouched by seven light commits.
    assert [full for step, _, full in watch.seen if step == 9] == [["step-00000004", "step-00000008"]]
    assert _names(out / "checkpoints") == ["step-00000008", "step-00000010"]
    assert (out / "checkpoints" / "latest").read_text() == "step-00000010\n"


def test_a_light_checkpoint_holds_the_weights_of_its_step_and_nothing_a_resume_needs(
    light_run: tuple[Path, _Watch],
) -> None:
    out, watch = light_run
    light = out / "light_checkpoints" / "step-00000009"
    assert verify_checkpoint(light) == []
    ckpt = torch.load(light / "state.ckpt", map_location="cpu", weights_only=True)
    assert set(ckpt) == {
        EPOCH_KEY,
        GLOBAL_STEP_KEY,
        STATE_DICT_KEY,
        CONFIG_KEY,
        META_KEY,
    }  # no optimizer/RNG/sampler
    assert ckpt[GLOBAL_STEP_KEY] == 9 and ckpt[CONFIG_KEY]["checkpoint"]["light_every_steps"] == 1
    assert ckpt[STATE_DICT_KEY].keys() == watch.weights_at_9.keys()
    assert all(torch.equal(ckpt[STATE_DICT_KEY][k], v) for k, v in watch.weights_at_9.items())
    manifest = json.loads((light / "manifest.json").read_text())
    assert manifest["tier"] == "light" and manifest["step"] == 9 and manifest["tokens_seen"] == 9 * 12 * 64
    full = json.loads((out / "checkpoints" / "step-00000010" / "manifest.json").read_text())
    assert "tier" not in full and full["step"] == 10
    full_size = (out / "checkpoints" / "step-00000010" / "state.ckpt").stat().st_size
    assert (light / "state.ckpt").stat().st_size < full_size / 2  # AdamW keeps two moments per weight


def test_resume_takes_the_newest_full_checkpoint_and_refuses_a_light_one(
    light_run: tuple[Path, _Watch], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    shutil.copytree(light_run[0], out)
    shutil.rmtree(out / "checkpoints" / "step-00000010")  # a run that died before its final save
    assert (
        resume_checkpoint(_config(out)) == out / "checkpoints" / "step-00000008" / "state.ckpt"
    )  # not light 9
    for named in (out / "light_checkpoints", out / "light_checkpoints" / "step-00000009"):
        with pytest.raises(ConfigError) as caught:
            resume_checkpoint(_config(out, "--train.resume", str(named)))
        message = str(caught.value)
        assert message.startswith("train.resume: ") and "light checkpoint" in message and "\n" not in message


def test_export_reads_a_light_checkpoint_with_the_runs_tokenizer(
    light_run: tuple[Path, _Watch], tmp_path: Path, gaudi3_cli: Callable[..., tuple[int, str, str]]
) -> None:
    from gaudi3_scale.artifacts.export import load_exported

    out, watch = light_run
    code, _, err = gaudi3_cli("ckpt", "export", str(out / "light_checkpoints"), "--out", str(tmp_path / "x"))
    assert code == 0, err
    model = load_exported(tmp_path / "x")  # the newest light checkpoint (step 9), with the run's tokenizer
    weights = {k.removeprefix("model."): v for k, v in watch.weights_at_9.items()}
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert (tmp_path / "x" / "tokenizer" / "tokenizer.json").is_file()


def test_a_sharded_strategy_with_light_checkpoints_is_one_line_and_exit_2(
    tmp_path: Path, gaudi3_cli: Callable[..., tuple[int, str, str]]
) -> None:
    code, _, err = gaudi3_cli("train", "--out", str(tmp_path), "--sample-tokens", "0", "--no-progress", *RUN,
                              "--parallel.strategy", "fsdp")  # fmt: skip
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "checkpoint.light_every_steps: light checkpoints are one file" in lines[0] and "fsdp" in lines[0]


def test_a_failed_light_save_warns_and_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_save = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:  # a full disk, under light step 2 only
        if "light_checkpoints/step-00000002" in str(getattr(f, "name", f)):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    console = io.StringIO()
    cfg = _config(tmp_path, "--train.max_steps", "3", "--checkpoint.every_steps", "0")  # async save (default)
    summary = GaudiTrainer(cfg, progress=False, console=Console(file=console, width=400)).fit()
    warning = " ".join(console.getvalue().split())
    assert "light_checkpoints/step-00000002 was not saved ([Errno 28] No space left on device)" in warning
    assert summary["steps"] == 3 and _names(tmp_path / "checkpoints") == ["step-00000003"]
    assert _names(tmp_path / "light_checkpoints") == ["step-00000001"]  # nothing partial left of step 2
    assert (tmp_path / "light_checkpoints" / "latest").read_text() == "step-00000001\n"
