"""Pipeline runs refused before any rank starts, as a user runs them (`gaudi3 train` in a subprocess, no
--print-config): exit 2, one `gaudi3: error:` line and nothing from torchrun; and the words of the refusals and of
the planner that used to mislead (an impossible suggestion, a cause named wrong, a list that read as one)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gaudi3_scale.cli.main import main
from gaudi3_scale.config.errors import ConfigError
from gaudi3_scale.distributed.stages import check_micro_batches

_PP2 = ["--model.name", "llama-tiny", "--model.num_layers", "4", "--train.max_steps", "3",
        "--train.val_every_steps", "0", "--train.global_batch_size", "8", "--train.micro_batch_size", "2",
        "--sample-tokens", "0", "--no-progress", "--parallel.nproc_per_node", "2", "--parallel.pp_size", "2"]  # fmt: skip


def _train(out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(out), *_PP2, *extra],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "line"),
    [
        pytest.param(
            ("--parallel.pp_schedule", "zbv", "--train.compile", "true"),
            "gaudi3: error: train.compile: compiled blocks cannot run zbv's split backward",
            id="zbv-compile",  # torch 2.13: both ranks crashed in the first backward (donated buffers)
        ),
        pytest.param(
            ("--train.precision", "16-mixed"),
            "gaudi3: error: train.precision: 16-mixed (fp16 with a loss scale) runs with parallel.strategy auto, "
            "single, ddp or deepspeed, not with parallel.pp_size 2 (FSDP2); use bf16-mixed (32-true on a GPU without "
            "bf16)",
            id="16-mixed-pipeline",  # a pipeline's backward never scales the loss: unscale_ failed at the first step
        ),
        pytest.param(
            ("--parallel.pp_size", "1", "--parallel.strategy", "ddp", "--train.precision", "16-mixed"),
            "gaudi3: error: train.precision: 16-mixed needs a GPU; on cpu use 32-true, bf16-mixed or bf16-true",
            id="16-mixed-on-cpu",  # was refused by each rank after torchrun started them
        ),
    ],
)
def test_refused_before_any_rank_starts(tmp_path: Path, extra: tuple[str, ...], line: str) -> None:
    if "ddp" in extra:
        import torch

        if torch.cuda.is_available():
            pytest.skip("16-mixed runs on this machine's GPU")
    done = _train(tmp_path / "run", *extra)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert done.stderr.startswith(line) and done.stderr.count("\n") == 1, done.stderr  # no torchrun W/E lines
    # nothing written: no config.yaml or plan.json of a run that never trained
    assert not (tmp_path / "run").exists()


def test_1f1b_suggests_a_smaller_micro_batch_only_where_there_is_one() -> None:
    with pytest.raises(ConfigError) as at_one:
        check_micro_batches("1f1b", 2, 1, micro_batch_size=1)
    assert "micro_batch_size" not in str(at_one.value)
    assert str(at_one.value).endswith(
        "allowed: a larger train.global_batch_size, or pp_schedule gpipe or zbv"
    )
    with pytest.raises(ConfigError, match=r"allowed: a smaller train\.micro_batch_size, a larger"):
        check_micro_batches("1f1b", 2, 1, micro_batch_size=4)


def test_plan_names_the_stages_apart_from_the_micro_batches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """zbv's largest rank holds stages 0 and 3 with 4 micro-batches in flight: never "stages 0, 3, 4"."""
    main(["plan", "--model.name", "llama-tiny", "--model.num_layers", "4", "--train.global_batch_size", "8",
          "--train.micro_batch_size", "2", "--parallel.nproc_per_node", "2", "--parallel.pp_size", "2",
          "--parallel.pp_schedule", "zbv", "--out", str(tmp_path / "plan.json")])  # fmt: skip
    out = capsys.readouterr().out
    assert "the largest: stages 0 and 3 with 4 micro-batches in flight" in out, out
