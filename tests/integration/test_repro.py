"""`gaudi3 repro` trains the default model twice in real `gaudi3 train` subprocesses and diffs the results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest

from gaudi3_scale.cli.ckpt_cmd import DIFF_KEYS
from gaudi3_scale.cli.main import cli, main
from gaudi3_scale.verify.repro import MODES, compare_runs

pytestmark = pytest.mark.integration

FAST = ["--train.val_every_steps", "0", "--train.val_batches", "2", "--train.threads", "2"]


def _repro(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`gaudi3 repro …` in this process (its training runs are subprocesses): exit code, stdout, stderr."""
    try:
        main(["repro", *args])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def _report(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "repro.json").read_text())


@pytest.fixture(scope="module")
def twice(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = tmp_path_factory.mktemp("repro") / "twice"
    # checkpoint.enabled false, as a config may have it: repro turns checkpoints on in its runs (it compares the last)
    args = ["repro", "--steps", "6", "--out", str(out), "--keep", *FAST, "--checkpoint.enabled", "false"]
    proc = subprocess.run([sys.executable, "-m", "gaudi3_scale.cli", *args], capture_output=True, text=True)
    return out, proc


def test_twice_mode_is_bitwise_identical_and_reported(
    twice: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    out, proc = twice
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "first differing step │ none" in proc.stdout and "identical (weights" in proc.stdout
    assert "run A (from scratch): steps 1-6 done" in proc.stderr
    report = _report(out)
    assert report["verdict"] == "identical" and report["mode"] == "twice" and report["seed"] == 1337
    comparison = report["comparison"]
    assert comparison["steps_compared"] == [1, 6] and comparison["checkpoint_keys"] == list(DIFF_KEYS)
    assert comparison["checkpoints"] == [str(out / f"run-{r}/checkpoints/step-00000006") for r in "ab"]
    assert [run["name"] for run in report["runs"]] == ["A", "B"]
    assert all(run["exit_code"] == 0 and " train --out " in run["command"] for run in report["runs"])
    assert "--train.max_steps=6" in report["runs"][0]["command"]
    assert report["environment"]["packages"]["torch"]
    # --keep: both runs stay, with one metrics record per step.
    losses = [json.loads(line) for line in (out / "run-b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in losses if "train_loss" in r] == [1, 2, 3, 4, 5, 6]


def test_comparison_finds_the_first_difference_between_two_seeds(
    twice: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    out, _ = twice
    other = tmp_path / "seed-7"
    train = [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(other), "--sample-tokens", "0",
             "--no-progress", "--seed", "7", "--train.max_steps", "6", "--train.log_every_steps", "1",
             "--checkpoint.every_steps", "0", *FAST]  # fmt: skip
    proc = subprocess.run(train, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = compare_runs(out / "run-a", other, first_step=1, last_step=6, keys=DIFF_KEYS)
    assert not found.identical
    assert found.metrics is not None and (found.metrics.step, found.metrics.field) == (1, "train_loss")
    assert found.metrics.a != found.metrics.b and found.metrics.describe().startswith("step 1: train_loss ")
    assert found.checkpoint is not None and found.checkpoint.key.startswith("state_dict.")
    same = compare_runs(out / "run-a", out / "run-b", first_step=1, last_step=6, keys=DIFF_KEYS)
    assert same.identical


def test_resume_mode_with_dropout_is_identical(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Dropout masks are reseeded from (seed, step) every step, so the checkpoint's RNG state matches too.
    out = tmp_path / "resume"
    code, stdout, stderr = _repro(capsys, "--mode", "resume", "--steps", "6", "--out", str(out), "--model.dropout",
                                  "0.1", *FAST)  # fmt: skip
    assert code == 0, stdout + stderr
    assert "run B (resumed from step 3): steps 4-6 done" in stderr
    report = _report(out)
    assert report["verdict"] == "identical" and report["comparison"]["steps_compared"] == [4, 6]
    assert "--resume " + str(out / "run-a" / "checkpoints" / "step-00000003") in report["runs"][1]["command"]
    assert "step-3 checkpoint" in report["note"]
    assert sorted(p.name for p in out.iterdir()) == ["repro.json"]  # identical, no --keep: runs removed


def test_resume_mode_without_dropout_is_identical_including_the_global_rng(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without dropout nothing reseeds the global torch RNG during training, so any draw from it that the resumed
    run makes and the continuous run does not (e.g. a DataLoader iterator's base seed drawn after the RNG state was
    restored) shows up as a difference in `gaudi3_rng.per_rank[0].torch` at the final checkpoint. Our loaders use
    their own generator, so the two checkpoints match bit for bit, RNG states included.
    """
    out = tmp_path / "nodrift"
    code, stdout, stderr = _repro(capsys, "--mode", "resume", "--steps", "6", "--out", str(out), *FAST)
    assert code == 0, stdout + stderr
    report = _report(out)
    assert report["verdict"] == "identical"
    assert report["comparison"]["checkpoint_first_difference"] is None


def test_a_failing_run_is_one_line_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Valid config, but no Gaudi here: run A itself fails; run B never starts.
    out = tmp_path / "fail"
    code, _, stderr = _repro(capsys, "--steps", "2", "--out", str(out), "--train.device", "hpu", *FAST)
    assert code == 2 and stderr.count("\n") == 1, stderr
    assert stderr.startswith("gaudi3: error: run A (from scratch) failed with exit 2: ")
    assert "HPU" in stderr and f"(log: {out / 'run-a' / 'train.log'})" in stderr
    assert _report(out)["verdict"] == "failed" and not (out / "run-b").exists()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--mode", "bogus"], "Invalid value for '--mode': 'bogus' is not one of 'twice', 'resume'"),
        (["--mode", "resume", "--steps", "1"], "--steps: resume mode needs at least 2 steps, got 1"),
        (["--steps", "0"], "--steps: must be a positive integer, got 0"),
        (["--model.nope", "1"], "model.nope: unknown field in model"),
        (
            ["--train.global_batch_size", "5", "--nproc-per-node", "2"],
            "train.global_batch_size: 5 is not divisible",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    args: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, stdout, stderr = _repro(capsys, "--out", str(tmp_path / "none"), *args)
    assert code == 2 and stderr.startswith("gaudi3: error: ") and stderr.count("\n") == 1, stderr
    assert needle in stderr and stdout == ""
    assert not (tmp_path / "none").exists()  # nothing created before the input is known good


def test_out_must_be_new_or_empty(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    code, _, stderr = _repro(capsys, "--out", str(tmp_path / "taken"))
    assert code == 2 and "is not empty; pick a new or empty directory" in stderr


def test_an_out_that_cannot_be_written_is_one_line_and_exit_2_not_1() -> None:
    """/sys stands in for a directory the user cannot write (root writes anywhere chmod would forbid); exit 1
    would read as "the runs differ"."""
    if not Path("/sys").is_dir():
        pytest.skip("needs Linux's /sys")
    args = ["repro", "--steps", "1", "--out", "/sys/gaudi3-repro"]
    proc = subprocess.run([sys.executable, "-m", "gaudi3_scale.cli", *args], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr == (
        "gaudi3: error: --out: '/sys/gaudi3-repro': cannot write in /sys (Permission denied); "
        "pick a directory you can write\n"
    )


def test_mode_choices_match_the_library() -> None:
    option = next(p for p in cli.commands["repro"].params if p.name == "mode")
    assert isinstance(option.type, click.Choice) and tuple(option.type.choices) == MODES
