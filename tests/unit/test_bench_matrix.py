"""What a benchmark matrix's cells run: a cell is a short run made to measure, under its label (model, strategy,
ranks, micro-batch, precision, and the matrix's data, batch and steps). A `base` that would change that is one line
naming the matrix key; what every cell sets anyway, or what a cell honours, loads. No cell trains here."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml

from gaudi3_scale.bench.cell import cell_of_config
from gaudi3_scale.bench.matrix import load_matrix
from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.device.select import gaudi_present
from gaudi3_scale.train.config import build_run_config, config_dict

Cli = Callable[..., tuple[int, str, str]]


def _matrix(tmp_path: Path, base: object, **keys: object) -> Path:
    matrix = {"name": "m", "models": ["llama-tiny"], "strategies": ["ddp"], "world_sizes": [1],
              "micro_batch_sizes": [4], "precisions": ["32-true"], "data": "synthetic:256", "warmup_steps": 1,
              "measure_steps": 2, **keys, "base": base}  # fmt: skip
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(matrix, sort_keys=False))
    return path


def _one_line(code: int, out: str, err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and out == "" and len(lines) == 1 and "Traceback" not in err, (code, out, err)
    return lines[0]


def test_a_base_rollback_policy_makes_every_cell_warn(tmp_path: Path, gaudi3_cli: Cli) -> None:
    """A cell saves no checkpoint to roll back to: it watches for spikes and warns, as a tuning trial does, rather
    than being refused for a `checkpoint.enabled` the user never set."""
    path = _matrix(tmp_path, {"health": {"spike_policy": "rollback", "spike_threshold_mads": 5.0}})
    _, (cell,) = load_matrix(path)
    health = cell.config.health
    assert (health.spike_policy, health.spike_threshold_mads, cell.config.checkpoint.enabled) == (
        "warn",
        5.0,
        False,
    )
    code, out, err = gaudi3_cli(
        "benchmark", "run", "--matrix", str(path), "--out", str(tmp_path / "o"), "--dry-run"
    )
    assert code == 0 and "1 cells (dry run: nothing run)" in out, (code, out, err)


@pytest.mark.parametrize("layout", [{"tp_size": 2}, {"pp_size": 2}])
def test_tensor_and_pipeline_parallel_in_base_keep_the_matrixs_accumulation(
    tmp_path: Path, layout: dict[str, int]
) -> None:
    """2 ranks in one tensor-parallel group (or pipeline) are one data-parallel rank: the step is micro-batch ×
    accumulation, not twice the matrix's accumulation."""
    path = _matrix(tmp_path, {"parallel": layout}, strategies=["fsdp"], world_sizes=[2], accumulation=2)
    _, (cell,) = load_matrix(path)
    batch = cell.config.batch_plan()
    assert (batch.data_parallel_size, batch.accumulation, batch.global_batch_size) == (1, 2, 8)
    recorded = cell_of_config(cell.config, precision="32-true")
    assert (recorded["accumulation"], recorded["global_batch_size"], recorded["world_size"]) == (2, 8, 2)


def test_what_every_cell_sets_anyway_may_stay_in_base(tmp_path: Path) -> None:
    """A tuned config's nulls (and a shape field equal to the preset's) change nothing a cell runs: they load, and
    the cell runs its preset, unprofiled, by steps, without a budget."""
    base = {"train": {"max_epochs": None, "global_batch_tokens": None, "profile_start_step": None, "threads": 1},
            "cost": {"budget_usd": None}, "data": {"mixture": None}, "checkpoint": {"enabled": False},
            "model": {"num_layers": 2, "init_from": None}}  # fmt: skip
    _, (cell,) = load_matrix(_matrix(tmp_path, base))
    train = cell.config.train
    assert (train.max_epochs, train.global_batch_tokens, train.profile_start_step, train.max_steps) == (
        None,
        None,
        None,
        3,
    )
    assert (cell.config.cost.budget_usd, cell.config.data.mixture, cell.config.model.num_layers) == (
        None,
        None,
        2,
    )


def test_a_whole_config_as_base_names_every_field_the_cells_own_in_one_line(
    tmp_path: Path, gaudi3_cli: Cli
) -> None:
    """`gaudi3 train --print-config` (or tune's best.yaml) as base, over two presets: one refusal names the fields,
    so a user edits once; llama-tiny's shape is refused, as gpt2-124m's cells would run it under gpt2-124m's name."""
    whole = config_dict(build_run_config(None, [("model.name", "llama-tiny")]))
    path = _matrix(tmp_path, whole, models=["llama-tiny", "gpt2-124m"])
    with pytest.raises(UserInputError) as info:
        load_matrix(path)
    message = str(info.value)
    assert message.startswith(f"{path}: base.name: set in every cell (a cell is named by its id); leave it out of "
                              "base; also refused in base: model.{name, arch, num_layers, num_heads, ")  # fmt: skip
    for named in (
        "data.source",
        "train.{precision, micro_batch_size, global_batch_size, max_steps, log_every_steps",
        "checkpoint.enabled",
    ):
        assert named in message, named
    assert "budget_usd" not in message and "max_epochs" not in message  # null in the config: as in every cell
    _one_line(*gaudi3_cli("benchmark", "run", "--matrix", str(path), "--out", str(tmp_path / "o")))
    assert not (tmp_path / "o").exists()


_CPU_ONLY = pytest.mark.skipif(
    torch.cuda.is_available() or gaudi_present(), reason="16-mixed trains on a GPU"
)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        pytest.param({"precisions": ["32-true", "16-mixed"]},
                     "precisions: 16-mixed needs a GPU; on cpu use 32-true, bf16-mixed or bf16-true",
                     marks=_CPU_ONLY),
        ({"base": {"train": {"max_epochs": 1}}},
         "base.train.max_epochs: set by the matrix: `warmup_steps` + `measure_steps` (set those)"),
    ],
    ids=["16-mixed-on-a-cpu", "max-epochs"],
)  # fmt: skip
def test_a_cell_that_would_fail_at_launch_is_refused_before_anything_runs(
    tmp_path: Path, gaudi3_cli: Cli, keys: dict[str, object], message: str
) -> None:
    """`gaudi3 benchmark run` refuses, as one line naming the matrix key, a cell whose `gaudi3 train` would refuse
    it at launch; nothing is written. Its dry run checks what holds on any machine (a matrix is validated on a
    laptop before it goes to the GPU nodes): it lists the cells this host cannot train in."""
    path = _matrix(tmp_path, keys.get("base", {}), **{k: v for k, v in keys.items() if k != "base"})
    out = tmp_path / "o"
    proc = subprocess.run([sys.executable, "-m", "gaudi3_scale.cli", "benchmark", "run", "--matrix", str(path),
                           "--out", str(out)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert _one_line(proc.returncode, proc.stdout, proc.stderr) == f"gaudi3: error: {path}: {message}"
    assert not out.exists()
    code, stdout, stderr = gaudi3_cli(
        "benchmark", "run", "--matrix", str(path), "--out", str(out), "--dry-run"
    )
    if "precisions" in keys:  # this host's limit, not the matrix's
        assert code == 0 and "16-mixed" in stdout and "(dry run: nothing run)" in stdout, (
            code,
            stdout,
            stderr,
        )
    else:
        assert _one_line(code, stdout, stderr) == f"gaudi3: error: {path}: {message}"
    assert not out.exists()
