"""Where `gaudi3 plan` writes, run as users run it (a subprocess): `--out /dev/null` (a device) and a FIFO are written
through and stay what they are, a symbolic link writes its target; an `--out` that cannot be written, or the default
<out_dir>/plan.json of a run that is training or was stopped, is one line and exit 2 with an empty stdout — checked
before a probe or a peak measurement, so the calibration store is not touched. A damaged calibration store is one
note from `gaudi3 train`, which trains on without a forecast."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from test_plan_cli import _plan  # the subprocess `gaudi3 plan`, with its own calibration store under tmp_path

from gaudi3_scale.forecast.calibration import CalibrationStore
from gaudi3_scale.train.run_lock import run_directory_lock

TINY = ("--model.num_layers", "1")  # a forecast in a second or two


def _refused(done: subprocess.CompletedProcess[str], *parts: str) -> None:
    assert done.returncode == 2, done.stderr
    assert done.stdout == "" and len(done.stderr.strip().splitlines()) == 1, done.stderr
    line = done.stderr.strip()
    assert line.startswith("gaudi3: error: ") and all(p in line for p in parts), line


def _snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `root`: its bytes and its mtime."""
    return {
        str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _char_device(tmp_path: Path) -> Path:
    """A character device like /dev/null (major 1, minor 3) in tmp_path when this process may make one (root),
    else /dev/null itself."""
    node = tmp_path / "null"
    try:
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        return Path("/dev/null")
    return node


def test_out_to_a_character_device_writes_through_and_leaves_it_a_device(tmp_path: Path) -> None:
    device = _char_device(tmp_path)
    assert stat.S_ISCHR(os.stat(device).st_mode) and stat.S_ISCHR(os.stat("/dev/null").st_mode)
    done = _plan(tmp_path, *TINY, "--out", str(device))
    assert done.returncode == 0, done.stderr
    assert f"wrote {device}" in done.stdout and "per-rank peak memory:" in done.stdout
    assert stat.S_ISCHR(os.stat(device).st_mode) and stat.S_ISCHR(os.stat("/dev/null").st_mode)
    assert not list(device.parent.glob(f".{device.name}.*.tmp"))


def test_out_to_a_fifo_writes_the_forecast_through_it(tmp_path: Path) -> None:
    fifo = tmp_path / "plan.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader first: the writer's open does not wait
    try:
        done = _plan(tmp_path, *TINY, "--out", str(fifo))
        assert done.returncode == 0, done.stderr
        received = os.read(reader, 1 << 20)
    finally:
        os.close(reader)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert json.loads(received)["run"]["world_size"] == 1


def test_out_through_a_symlink_writes_its_target_and_keeps_the_link(tmp_path: Path) -> None:
    target, link = tmp_path / "keep.json", tmp_path / "link.json"
    target.write_text('{"keep": 1}\n')
    link.symlink_to(target)
    done = _plan(tmp_path, *TINY, "--out", "link.json")
    assert done.returncode == 0, done.stderr
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert json.loads(target.read_text())["run"]["world_size"] == 1
    dangling = tmp_path / "dangling.json"  # a link to a file not there yet: the file is made, the link kept
    dangling.symlink_to(tmp_path / "new.json")
    assert _plan(tmp_path, *TINY, "--out", "dangling.json").returncode == 0
    assert dangling.is_symlink() and "predicted_step_time_s" in (tmp_path / "new.json").read_text()


@pytest.mark.parametrize(
    ("args", "parts"),
    [
        (
            ["--out", "/sys/plan.json"],
            ("--out: '/sys/plan.json'", "cannot write in /sys", "writable directory"),
        ),
        (
            ["--out", "/proc/version"],
            ("--out: '/proc/version'", "cannot write in /proc", "writable directory"),
        ),
        (["--out_dir", "/sys/run"], ("out_dir: '/sys/run/plan.json'", "cannot write in /sys")),
        (["--out", "/proc/version", "--refresh-peak"], ("--out: '/proc/version'", "cannot write in /proc")),
    ],
)
def test_an_out_that_cannot_be_written_is_one_line_before_any_work(
    tmp_path: Path, args: list[str], parts: tuple[str, ...]
) -> None:
    """/sys and /proc stand in for a read-only mount (root writes anywhere chmod would forbid)."""
    if not Path("/sys").is_dir() or not Path("/proc/version").is_file():
        pytest.skip("needs Linux's /sys and /proc")
    _refused(_plan(tmp_path, *TINY, *args), *parts)
    assert not (tmp_path / "cache" / "calibration").exists()  # no peak measured, nothing stored


def _killed_run(run: Path) -> None:
    """What a run stopped by `kill -9` leaves: its lock file (released by the kernel), config and forecast, its
    metrics so far; no summary.json."""
    run.mkdir()
    (run / ".run.lock").write_text("123456\n")
    (run / "config.yaml").write_text("name: killed\n")
    (run / "plan.json").write_text('{"machine": "cpu"}\n')
    (run / "metrics.jsonl").write_text('{"step": 1}\n')


def test_the_default_out_is_refused_over_a_run_that_was_stopped_or_is_training(tmp_path: Path) -> None:
    killed = tmp_path / "killed"
    _killed_run(killed)
    before = _snapshot(killed)
    _refused(_plan(tmp_path, *TINY, "--out_dir", "killed"),
             "out_dir: 'killed' holds a run that started and did not finish", "--out FILE")  # fmt: skip
    assert _snapshot(killed) == before
    live = tmp_path / "live"
    with run_directory_lock(live):  # the real lock a training run holds (this process stands in for the run)
        (live / "plan.json").write_text('{"machine": "cpu"}\n')
        before = _snapshot(live)
        _refused(
            _plan(tmp_path, *TINY, "--out_dir", "live"), "holds a run that is training now", "--out FILE"
        )
        assert _snapshot(live) == before
    before = _snapshot(killed)  # --out elsewhere is the way: the run's files stay as they were
    assert _plan(tmp_path, *TINY, "--out_dir", "killed", "--out", "other.json").returncode == 0
    assert _snapshot(killed) == before and (tmp_path / "other.json").is_file()


def test_the_default_out_replaces_an_earlier_plans_forecast(tmp_path: Path) -> None:
    """A plan.json alone is `gaudi3 plan`'s own (a run writes config.yaml and holds its lock): planning again
    replaces it."""
    first = _plan(tmp_path, *TINY, "--out_dir", "next")
    assert first.returncode == 0, first.stderr
    again = _plan(tmp_path, *TINY, "--out_dir", "next", "--train.max_steps", "7")
    assert again.returncode == 0, again.stderr
    assert json.loads((tmp_path / "next" / "plan.json").read_text())["run"]["max_steps"] == 7


@pytest.mark.parametrize("flag", ["--probe", "--refresh-peak"])
def test_a_refused_default_out_comes_before_the_probe_and_the_peak(tmp_path: Path, flag: str) -> None:
    assert _plan(tmp_path, *TINY, "--out", "first.json").returncode == 0  # the store, with this CPU's peak
    trained = tmp_path / "trained"
    trained.mkdir()
    (trained / "summary.json").write_text('{"steps": 1}\n')
    (trained / "plan.json").write_text('{"machine": "cpu"}\n')
    store, run = _snapshot(tmp_path / "cache"), _snapshot(trained)
    done = _plan(tmp_path, *TINY, "--out_dir", "trained", flag)
    _refused(done, "out_dir: 'trained' holds a run that has trained", "--out FILE")
    assert _snapshot(tmp_path / "cache") == store and _snapshot(trained) == run


def _store_path(tmp_path: Path) -> Path:
    (path,) = (tmp_path / "cache" / "calibration").glob("*.json")
    return path


def test_a_damaged_store_is_one_note_and_the_run_trains_on(tmp_path: Path) -> None:
    assert _plan(tmp_path, *TINY, "--out", "first.json").returncode == 0
    path = _store_path(tmp_path)
    text = path.read_text()
    path.write_text(text[: len(text) // 2])  # cut short, as by a full disk
    damaged = path.read_bytes()
    planned = _plan(tmp_path, *TINY, "--out", "second.json")
    _refused(planned, f"{path}: damaged calibration store, not JSON", "delete it to start a new one")
    env = {**os.environ, "GAUDI3_CACHE": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", "run", "--sample-tokens", "0",
               "--no-progress", "--train.max_steps", "2", "--train.val_every_steps", "0", *TINY]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    notes = [line for line in done.stderr.splitlines() if line.startswith("gaudi3: note: no forecast")]
    assert len(notes) == 1, done.stderr
    assert notes[0].startswith(
        f"gaudi3: note: no forecast for this run ({path}: damaged calibration store, not JSON"
    )
    assert notes[0].endswith("delete it to start a new one)")
    assert (tmp_path / "run" / "summary.json").is_file() and not (tmp_path / "run" / "plan.json").exists()
    assert path.read_bytes() == damaged  # the store is the user's to delete


def test_the_store_says_damaged_for_this_machine_and_foreign_for_another(tmp_path: Path) -> None:
    from gaudi3_scale.config.errors import UserInputError

    store = CalibrationStore(tmp_path / "m.json", machine="m")
    store.set_peak("cpu-1-threads", 1e10)
    text = (tmp_path / "m.json").read_text()
    (tmp_path / "m.json").write_text(text[: len(text) // 2])
    with pytest.raises(
        UserInputError, match=r"damaged calibration store, not JSON \(.*delete it to start a new"
    ):
        CalibrationStore(tmp_path / "m.json", machine="m")
    (tmp_path / "m.json").write_text(text)
    with pytest.raises(
        UserInputError,
        match=r"not a calibration store of this machine \(format .*machine 'm'; this machine is 'another'\)",
    ):
        CalibrationStore(tmp_path / "m.json", machine="another")
    (tmp_path / "m.json").write_text(json.dumps({**json.loads(text), "probes": {"k": {"key": "k"}}}))
    with pytest.raises(UserInputError, match=r"damaged calibration store \(.*missing"):
        CalibrationStore(tmp_path / "m.json", machine="m")
    (tmp_path / "m.json").write_bytes(text.encode()[:-3] + "é".encode()[:1])  # cut inside a UTF-8 character
    with pytest.raises(UserInputError, match="damaged calibration store, not JSON"):
        CalibrationStore(tmp_path / "m.json", machine="m")
    (tmp_path / "m.json").write_text("[]")
    with pytest.raises(UserInputError, match=r"damaged calibration store \(a JSON list, not an object\)"):
        CalibrationStore(tmp_path / "m.json", machine="m")
