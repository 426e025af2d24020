"""`train.device auto` on a Gaudi node, and hpu refused once before any rank starts where habana_frameworks is
absent. A fresh interpreter each (as a rank starts); the Gaudi node is a stand-in: a `habana_frameworks` package
that fails when imported (so the test proves it is found, not imported, before the Habana environment is set) and
device files named through `device.select.HPU_DEVICE_FILES`. Not yet validated on Gaudi hardware."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def _stand_in(tmp_path: Path) -> dict[str, str]:
    package = tmp_path / "site" / "habana_frameworks"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('habana_frameworks imported')\n")
    path = [str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p), "CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.parametrize(("device_files", "expected"), [(("accel0",), "hpu"), ((), "cpu")])
def test_auto_is_hpu_on_a_gaudi_node_without_importing_habana(
    tmp_path: Path, device_files: tuple[str, ...], expected: str
) -> None:
    for name in device_files:
        (tmp_path / name).touch()
    code = (
        "import sys; import gaudi3_scale.device.select as select\n"
        f"select.HPU_DEVICE_FILES = ({str(tmp_path / 'accel[0-9]*')!r},)\n"
        "print(select.resolve_device('auto'))\n"
        "assert 'habana_frameworks' not in sys.modules\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_stand_in(tmp_path)
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == expected


def test_multi_rank_hpu_without_habana_is_refused_once_before_any_rank(tmp_path: Path) -> None:
    args = ["--model.name=llama-tiny", "--model.num_layers=1", "--train.threads=1", "--train.max_steps=2",
            "--train.global_batch_size=4", "--nproc-per-node", "2", "--train.device=hpu", "--out", "run"]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "gaudi3_scale.cli", "train", *args], capture_output=True,
                          text=True, cwd=tmp_path, env={**os.environ, "GAUDI3_CACHE": str(tmp_path / "cache")})  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr == (
        "gaudi3: error: train.device: Gaudi (HPU) was requested but habana_frameworks (Intel's Gaudi PyTorch) is "
        "not installed here; allowed here: auto, cpu\n"
    ), done.stderr


def test_compile_with_hpu_graphs_is_refused_before_anything_runs(tmp_path: Path) -> None:
    # Habana's support matrix: torch.compile runs in eager mode only, HPU graphs in lazy mode only.
    args = ["--model.name=llama-tiny", "--train.device=hpu", "--train.compile=true", "--train.hpu_graphs=true",
            "--out", "run"]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "gaudi3_scale.cli", "train", *args], capture_output=True,
                          text=True, cwd=tmp_path, env={**os.environ, "GAUDI3_CACHE": str(tmp_path / "cache")})  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr == (
        "gaudi3: error: train.compile: torch.compile on Gaudi runs in eager mode, train.hpu_graphs in lazy mode; "
        "allowed: one of them\n"
    )
    assert not (tmp_path / "run").exists()
