"""What a pipeline run (`parallel.pp_size` > 1) refuses before any rank starts or any file is written: a single-file
checkpoint to resume (its stages cannot load one whole-model state dict), and a user's own LightningModule (stages
are cut from the registry model only). One line each, exit 2; the run directory stays as it was."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from gaudi3_scale.config.core import parse_overrides
from gaudi3_scale.config.errors import ConfigError
from gaudi3_scale.train import GaudiTrainer, build_run_config

pytestmark = pytest.mark.integration

GAUDI3 = [sys.executable, "-m", "gaudi3_scale.cli", "train"]
COMMON = ["--model.name=llama-tiny", "--model.num_layers=4", "--train.val_every_steps=0",
          "--train.global_batch_size=8", "--train.micro_batch_size=2", "--checkpoint.every_steps=2",
          "--sample-tokens=0", "--no-progress"]  # fmt: skip
PP2 = ["--parallel.nproc_per_node=2", "--parallel.pp_size=2"]
REFUSAL = "gaudi3: error: parallel.pp_size: the checkpoint "


@pytest.fixture(scope="module")
def single_file_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-process run of 2 steps: its checkpoint is a single `state.ckpt`."""
    out = tmp_path_factory.mktemp("single") / "run"
    args = [*GAUDI3, f"--out={out}", *COMMON, "--train.max_steps=2", "--train.threads=2"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "checkpoints/step-00000002/state.ckpt").is_file()
    return out


def _refused(proc: subprocess.CompletedProcess[str], checkpoint: Path) -> None:
    assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr  # no rank launched: no torchrun or rank lines, no traceback
    assert lines[0].startswith(
        f"{REFUSAL}{checkpoint} is a single file (layout single-file, written by one process)"
    )
    assert "allowed: resume it with parallel.pp_size 1" in lines[0] and "model.init_from" in lines[0]


def test_a_single_file_checkpoint_named_to_resume_under_a_pipeline_is_refused_before_launch(
    single_file_run: Path, tmp_path: Path
) -> None:
    checkpoint = single_file_run / "checkpoints/step-00000002"
    out = tmp_path / "pp"
    args = [*GAUDI3, f"--out={out}", *COMMON, "--train.max_steps=4", f"--resume={checkpoint}", *PP2]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    _refused(proc, checkpoint)
    assert not out.exists()


def test_a_run_of_one_process_resumed_in_place_under_a_pipeline_keeps_its_files(
    single_file_run: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    shutil.copytree(single_file_run, run)

    def files() -> dict[Path, bytes]:  # the lock holds the pid of whichever process held the directory last
        return {
            path: path.read_bytes() for path in run.rglob("*") if path.is_file() and path.suffix != ".lock"
        }

    before = files()
    args = [*GAUDI3, f"--out={run}", *COMMON, "--train.max_steps=4", *PP2]  # train.resume auto
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    _refused(proc, run / "checkpoints/step-00000002")
    assert files() == before  # config.yaml first: it still says the run is one process's


def test_fit_refuses_a_single_file_checkpoint_under_a_pipeline_in_every_process(
    single_file_run: Path, tmp_path: Path
) -> None:
    """Without the launcher (a rank of the user's own torchrun): the same line from `fit`, before any data work."""
    checkpoint = single_file_run / "checkpoints/step-00000002"
    out = tmp_path / "pp"
    overrides = [
        f"--out_dir={out}",
        *COMMON[:-2],
        "--train.max_steps=4",
        f"--train.resume={checkpoint}",
        *PP2,
    ]
    cfg = build_run_config(None, parse_overrides(overrides))
    with pytest.raises(ConfigError) as refused:
        GaudiTrainer(cfg, progress=False).fit()
    assert str(refused.value).startswith(f"parallel.pp_size: the checkpoint {checkpoint} is a single file")
    assert not out.exists()


class _Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_model(self) -> None:
        pass  # parallelizes nothing: under a pipeline each rank would train its own copy

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_fit_refuses_a_users_own_module_under_a_pipeline(tmp_path: Path) -> None:
    out = tmp_path / "own"
    cfg = build_run_config(
        base={
            "out_dir": str(out),
            "model": {"name": "llama-tiny", "num_layers": 4},
            "train": {"max_steps": 3, "val_every_steps": 0, "global_batch_size": 8, "micro_batch_size": 2},
            "parallel": {"nproc_per_node": 2, "pp_size": 2},
        }
    )
    with pytest.raises(ConfigError) as refused:
        GaudiTrainer(cfg, progress=False).fit(_Regression())
    assert str(refused.value) == (
        "parallel.pp_size: 2 splits the registry model (model.name) into pipeline stages; a module of your own "
        "(_Regression) trains without stages, under parallel.strategy auto, ddp, fsdp, fsdp_grad_op, "
        "deepspeed_zero2, deepspeed_zero3; set parallel.pp_size 1"
    )
    assert not out.exists()
    assert not torch.distributed.is_initialized()


class _Data(pl.LightningDataModule):
    def train_dataloader(self) -> torch.utils.data.DataLoader:
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))  # 2 steps an epoch
        y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


class _Wider(_Regression):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)  # the checkpoint's weight is [1, 4]: its load fails


def test_a_resume_whose_checkpoint_fails_to_load_keeps_the_runs_config(tmp_path: Path) -> None:
    """config.yaml (and plan.json) of a resumed run are written once the checkpoint is restored, not before."""

    def config(max_steps: int) -> object:
        train = {"max_steps": max_steps, "val_every_steps": 0, "global_batch_size": 8, "micro_batch_size": 8}
        return build_run_config(
            base={"out_dir": str(tmp_path), "train": train, "checkpoint": {"every_steps": 2}}
        )

    GaudiTrainer(config(2), progress=False).fit(_Regression(), _Data())
    saved = (tmp_path / "config.yaml").read_bytes()
    assert b"max_steps: 2\n" in saved
    with pytest.raises(RuntimeError, match="size mismatch"):
        GaudiTrainer(config(4), progress=False).fit(_Wider(), _Data())
    assert (tmp_path / "config.yaml").read_bytes() == saved
    summary = GaudiTrainer(config(4), progress=False).fit(
        _Regression(), _Data()
    )  # restored: now it is written
    assert summary["steps"] == 4 and b"max_steps: 4\n" in (tmp_path / "config.yaml").read_bytes()
