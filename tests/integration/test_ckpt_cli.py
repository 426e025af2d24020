"""`gaudi3 ckpt list | verify | diff` on real checkpoints, and resume skipping a corrupt latest checkpoint."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

GAUDI3 = [sys.executable, "-m", "gaudi3_scale.cli"]
TRAIN = ["train", "--sample-tokens", "0", "--no-progress", "--train.val_every_steps", "0", "--model.num_layers", "1",
         "--optim.warmup_steps", "1", "--checkpoint.every_steps", "2"]  # fmt: skip


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*GAUDI3, *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "run"
    proc = _run(*TRAIN, "--out", str(out), "--train.max_steps", "4")
    assert proc.returncode == 0, proc.stderr
    return out


def test_list_and_verify_intact_checkpoints(run_dir: Path) -> None:
    listed = _run("ckpt", "list", str(run_dir), "--verify")
    assert listed.returncode == 0, listed.stderr
    rows = [
        line for line in listed.stdout.splitlines() if "│" in line and line.split("│")[1].strip().isdigit()
    ]
    assert [r.split("│")[1].strip() for r in rows] == ["2", "4"]
    assert all(" ok " in r for r in rows) and "*" in rows[-1]
    checked = _run("ckpt", "verify", str(run_dir / "checkpoints" / "step-00000004"))
    assert checked.returncode == 0 and checked.stdout.strip().endswith(": ok")


def test_diff_reports_identical_and_the_first_difference(run_dir: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    assert _run(*TRAIN, "--out", str(again), "--train.max_steps", "4").returncode == 0
    same = _run(
        "ckpt",
        "diff",
        str(run_dir / "checkpoints" / "step-00000004"),
        str(again / "checkpoints" / "step-00000004"),
    )
    assert same.returncode == 0 and same.stdout.startswith("identical"), same.stdout + same.stderr
    other = _run(
        "ckpt",
        "diff",
        str(run_dir / "checkpoints" / "step-00000002"),
        str(run_dir / "checkpoints" / "step-00000004"),
    )
    assert other.returncode == 1 and "first difference: global_step: 2 vs 4" in other.stdout


def test_corrupt_latest_is_named_and_skipped_on_resume(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    state = out / "checkpoints" / "step-00000004" / "state.ckpt"
    data = bytearray(state.read_bytes())
    data[len(data) // 3] ^= 0x40
    state.write_bytes(bytes(data))
    checked = _run("ckpt", "verify", str(state))
    assert checked.returncode == 1 and "SHA-256 does not match the manifest" in checked.stdout
    assert _run("ckpt", "list", str(out), "--verify").returncode == 1
    resumed = _run(*TRAIN, "--out", str(out), "--train.max_steps", "6")
    assert resumed.returncode == 0, resumed.stderr
    warning = [line for line in resumed.stderr.splitlines() if "skipping checkpoint" in line]
    assert len(warning) == 1 and "step-00000004" in warning[0]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000006"
    # Training passed step 4 again: the damaged copy was set aside, not overwritten or deleted.
    assert (out / "checkpoints" / "step-00000004.damaged-1" / "state.ckpt").read_bytes() == bytes(data)
    assert _run("ckpt", "verify", str(out / "checkpoints" / "step-00000004")).returncode == 0
    damaged = out / "checkpoints" / "step-00000004.damaged-1"
    refused = _run(
        *TRAIN, "--out", str(tmp_path / "new"), "--train.max_steps", "6", "--train.resume", str(damaged)
    )
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "train.resume" in refused.stderr and "SHA-256" in refused.stderr


def test_verify_a_missing_checkpoint_is_one_line_and_exit_2(tmp_path: Path) -> None:
    proc = _run("ckpt", "verify", str(tmp_path / "nope"))
    assert (
        proc.returncode == 2
        and proc.stderr.strip() == f"gaudi3: error: checkpoint '{tmp_path / 'nope'}' does not exist"
    )
