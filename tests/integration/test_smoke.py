"""`gaudi3 smoke`: the real 100-step run with its checkpoint round trip, and a broken stage that must be named."""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from gaudi3_scale.checkpoint.manager import STATE_NAME, CheckpointManager
from gaudi3_scale.checkpoint.manifest import read_manifest, write_manifest
from gaudi3_scale.cli.smoke_cmd import smoke
from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.verify import smoke as smoke_lib

pytestmark = pytest.mark.integration

_MANIFEST_OWN_KEYS = {
    "format",
    "version",
    "versions",
    "created_unix_s",
    "hash",
    "files",
}  # write_manifest sets


def _search(pattern: str, text: str) -> re.Match[str]:
    found = re.search(pattern, text)
    assert found is not None, f"{pattern!r} not in:\n{text}"
    return found


def _corrupt_checkpoint(out_dir: Path) -> Path:
    """Flip bytes in the middle of the newest committed checkpoint's state file; its manifest stays as it was."""
    _, directory = CheckpointManager(out_dir / "checkpoints").committed()[-1]
    path = directory / STATE_NAME
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
    path.write_bytes(bytes(data))
    return path


def test_smoke_passes_every_stage_within_budget(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = CliRunner().invoke(smoke, ["--out", str(out)])
    assert result.exit_code == 0, result.output
    for stage in smoke_lib.STAGES:
        assert re.search(rf"^smoke: {stage} ok \(\d+\.\d s\)", result.output, re.MULTILINE), result.output
    total_s = float(_search(r"all stages ok in (\d+\.\d) s", result.output).group(1))
    assert total_s < 120
    # --out is kept: the step-100 checkpoint holds weights that an untrained model does not have.
    assert [step for step, _ in CheckpointManager(out / "checkpoints").committed()] == [100]
    assert [step for step, _ in CheckpointManager(out / "resume" / "checkpoints").committed()] == [110]
    loss = float(_search(r"reload ok .* loss (\d+\.\d+) \(untrained (\d+\.\d+)\)", result.output).group(1))
    assert loss < 3.0  # ln(65) = 4.17 untrained; 100 steps learn at least the character frequencies


def test_corrupted_checkpoint_fails_at_verify_with_exit_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def break_after_save(stage: str, out_dir: Path) -> None:
        if stage == "save":
            _corrupt_checkpoint(out_dir)

    # The real stages, with the corruption injected between save and verify.
    monkeypatch.setattr(
        smoke_lib, "run_smoke", functools.partial(smoke_lib.run_smoke, after_stage=break_after_save)
    )
    out = tmp_path / "run"
    result = CliRunner().invoke(smoke, ["--out", str(out), "--steps", "3"])
    assert result.exit_code == 1, result.output
    assert "smoke: FAILED at stage verify: " in result.stderr and STATE_NAME in result.stderr, result.stderr
    assert "smoke: verify ok" not in result.output and "smoke: save ok" in result.output
    assert out.is_dir()  # a failure keeps the run for inspection


def test_corruption_after_verify_fails_reload_and_stops(tmp_path: Path) -> None:
    seen: list[str] = []

    def break_after_verify(stage: str, out_dir: Path) -> None:
        if stage == "verify":
            _corrupt_checkpoint(out_dir)

    report = smoke_lib.run_smoke(tmp_path, steps=3, progress_print=lambda r: seen.append(r.name),
                                 after_stage=break_after_verify)  # fmt: skip
    assert not report.ok and report.failed is not None and report.failed.name == "reload"
    assert "not usable" in report.failed.detail
    assert seen == ["train", "save", "verify", "reload"]  # resume never ran
    assert not (tmp_path / "resume").exists()


def test_default_directory_is_removed_and_bad_out_is_refused(tmp_path: Path) -> None:
    result = CliRunner().invoke(smoke, ["--steps", "2"])
    assert result.exit_code == 0, result.output
    checkpoint = _search(r"save ok \(\d+\.\d s\) (\S+)", result.output).group(1)
    assert "gaudi3-smoke-" in checkpoint and not Path(checkpoint).parent.parent.exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    refused = CliRunner().invoke(smoke, ["--out", str(tmp_path / "full")])
    assert isinstance(refused.exception, UserInputError) and "not empty" in str(refused.exception)


def test_an_out_that_cannot_be_written_is_one_line_and_exit_2_before_training() -> None:
    """/sys stands in for a directory the user cannot write (root writes anywhere chmod would forbid); exit 1
    would read as a failed stage."""
    if not Path("/sys").is_dir():
        pytest.skip("needs Linux's /sys")
    proc = subprocess.run([sys.executable, "-m", "gaudi3_scale.cli", "smoke", "--out", "/sys/gaudi3-smoke"],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr == (
        "gaudi3: error: --out: '/sys/gaudi3-smoke': cannot write in /sys (Permission denied); "
        "pick a directory you can write\n"
    )


def test_help_names_every_stage_smoke_runs() -> None:
    """A stage missing from --help (and docs/reference/cli.md, made from it) is one a user cannot expect to fail."""
    proc = subprocess.run([sys.executable, "-m", "gaudi3_scale.cli", "smoke", "--help"], capture_output=True,
                          text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = " ".join(proc.stdout.split())
    assert [stage for stage in smoke_lib.STAGES if stage not in summary] == []


def test_recommitted_checkpoint_with_a_changed_weight_fails_reload(tmp_path: Path) -> None:
    """A checkpoint whose manifest is consistent passes verify; reload still compares it to the trained model."""
    changed: list[str] = []

    def change_one_weight(stage: str, out_dir: Path) -> None:
        if stage != "save":
            return
        _, directory = CheckpointManager(out_dir / "checkpoints").committed()[-1]
        path = directory / STATE_NAME
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        key = next(k for k in ckpt["state_dict"] if k.startswith("model."))
        ckpt["state_dict"][key] = ckpt["state_dict"][key] + 1e-3
        torch.save(ckpt, path)
        manifest = read_manifest(directory)
        assert manifest is not None
        metadata = {k: v for k, v in manifest.items() if k not in _MANIFEST_OWN_KEYS}
        write_manifest(directory, metadata)
        changed.append(key.removeprefix("model."))

    report = smoke_lib.run_smoke(tmp_path, steps=2, after_stage=change_one_weight)
    assert [s.name for s in report.stages if s.ok] == ["train", "save", "verify"]
    assert report.failed is not None and report.failed.name == "reload"
    assert report.failed.detail == f"checkpoint weight {changed[0]} differs from the trained model's"
