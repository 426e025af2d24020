"""The dashboard over odd and large run directories: one run's bad file or name never fails the others' pages, a
long metrics.jsonl costs bounded memory and bounded responses, and reading one run's file never waits for another's.

Real files and real servers on 127.0.0.1 (a request that would hang is one with a timeout)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import gaudi3_scale
from gaudi3_scale.dashboard import build_server
from gaudi3_scale.dashboard.runs import RunStore

_PADDING = "x" * 200  # about the length of a real train record's other fields


def _record(step: int, **extra: Any) -> dict[str, Any]:
    return {"step": step, "train_loss": 4.0 - step / 1e5, "tokens_per_s": 1000.0, "mfu": 0.3, "wall_s": step * 0.5,
            "time_unix": 1.7e9 + step * 0.5, "peak_memory_bytes": 2**30, "note": _PADDING, **extra}  # fmt: skip


def _write(path: Path, records: list[dict[str, Any]], mode: str = "w") -> None:
    with path.open(mode) as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))


def _run(runs: Path, name: str | bytes, records: list[dict[str, Any]], max_steps: int = 100) -> Path:
    run = Path(os.fsdecode(os.path.join(os.fsencode(runs), os.fsencode(name))))
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(
        yaml.safe_dump({"model": {"name": "tiny"}, "train": {"max_steps": max_steps}})
    )
    _write(run / "metrics.jsonl", records)
    return run


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    directory = tmp_path / "runs"
    _run(directory, "good", [_record(s) for s in (1, 2, 3)])
    return directory


def _serve(runs: Path) -> Iterator[str]:
    server = build_server(runs, "127.0.0.1", 0, None)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.port}"
    server.shutdown()
    thread.join(timeout=10)


@pytest.fixture
def served(runs: Path) -> Iterator[str]:
    yield from _serve(runs)


def _get(url: str, timeout_s: float = 20.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_an_int_too_large_for_a_float_is_one_unreadable_line(runs: Path, served: str) -> None:
    """json.loads takes 4,300 digits; float() does not: the line is unreadable, and the run list stays up (F1)."""
    huge = "1" + "0" * 400
    path = runs / "good" / "metrics.jsonl"
    with path.open("a") as f:
        f.write(f'{{"step": 4, "train_loss": 1.0, "peak_memory_bytes": {huge}}}\n')
        f.write(f'{{"step": 4, "train_loss": 1.0, "time_unix": {huge}}}\n')
    for _ in range(2):  # read once: a second request neither fails nor counts the lines again
        for url in ("/", "/api/runs", "/system", "/runs/good", "/api/runs/good/metrics?since=0"):
            assert _get(served + url)[0] == 200, url
        run = json.loads(_get(f"{served}/api/runs/good")[1])
        assert (run["lines"], run["unreadable_lines"], run["step"]) == (5, 2, 3)


_AS_OTHER_USER = """
import json, sys
from gaudi3_scale.dashboard import create_app
client = create_app(sys.argv[1]).test_client()
codes = {url: client.get(url).status_code for url in ("/", "/api/runs", "/api/runs/locked", "/runs/locked")}
print(json.dumps({"codes": codes, "runs": client.get("/api/runs").get_json()}))
"""


def test_a_metrics_file_the_server_may_not_read_is_that_runs_warning(tmp_path: Path) -> None:
    """The dashboard as an unprivileged user (root reads everything, so root's test runs it as nobody): a run
    whose metrics.jsonl it may not read is listed with the reason (F2), a directory it may not enter is named."""
    root = os.geteuid() == 0
    runs = Path(
        tempfile.mkdtemp(prefix="gaudi3-perm-", dir="/tmp" if root else tmp_path)
    )  # nobody can reach it
    try:
        runs.chmod(0o755)
        _run(runs, "good", [_record(1)])
        (_run(runs, "locked", [_record(1)]) / "metrics.jsonl").chmod(0)
        _run(runs, "closed", [_record(1)]).chmod(0)
        user = {"user": 65534, "group": 65534, "extra_groups": []} if root else {}
        env = {
            **os.environ,
            "PYTHONPATH": str(Path(gaudi3_scale.__file__).resolve().parents[1]),
            "HOME": "/tmp",
        }
        done = subprocess.run([sys.executable, "-c", _AS_OTHER_USER, str(runs)], capture_output=True, text=True,
                              env=env, timeout=120, check=False, **user)  # type: ignore[call-overload]  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(done.stdout.splitlines()[-1])
        assert set(result["codes"].values()) == {200}, result["codes"]
        locked = {r["name"]: r for r in result["runs"]["runs"]}["locked"]
        assert locked["warnings"] == ["metrics.jsonl unreadable: Permission denied"]
        assert result["runs"]["unlisted"] == [
            "closed: not listed: the dashboard may not read this directory (permission denied)"
        ]
    finally:
        (runs / "closed").chmod(0o755)
        shutil.rmtree(runs, ignore_errors=True)


def test_names_that_are_not_utf8_or_hold_a_backslash(runs: Path, served: str) -> None:
    """A name of other bytes cannot be linked: it is named as unlisted, and the pages stay up (F3). A backslash
    is a legal character: that run is listed and its pages work (F10)."""
    _run(runs, b"bad-\xff\xfe", [_record(1)])
    _run(runs, "a\\b", [_record(1)])
    for url in ("/", "/system", "/api/runs", "/api/system", "/runs/a%5Cb", "/api/runs/a%5Cb/metrics?since=0"):
        assert _get(served + url)[0] == 200, url
    listing = json.loads(_get(f"{served}/api/runs")[1])
    assert [r["name"] for r in listing["runs"]] == ["a\\b", "good"]
    assert listing["unlisted"] == ["bad-\\xff\\xfe: not listed: its name is not UTF-8"]
    assert "bad-\\xff\\xfe: not listed: its name is not UTF-8" in _get(served + "/")[1].decode()


def test_a_fifo_for_a_manifest_is_a_damaged_checkpoint_not_a_hang(runs: Path, served: str) -> None:
    """Only a regular file is opened as manifest.json: a FIFO there would block the request thread forever (F4)."""
    step = runs / "good" / "checkpoints" / "step-00000002"
    step.mkdir(parents=True)
    (step / "state.ckpt").write_bytes(b"state")
    os.mkfifo(step / "manifest.json")
    code, body = _get(f"{served}/api/runs/good/checkpoints", timeout_s=20)
    assert code == 200
    (row,) = json.loads(body)["checkpoints"]
    assert row["status"] == "damaged"
    assert row["problems"] == ["step-00000002: manifest.json is not a regular file"]


@pytest.mark.parametrize("case", ["clock", "max_steps"])
def test_a_time_out_of_range_shows_as_unknown(runs: Path, served: str, case: str) -> None:
    """A record's far-off time (or a 100-digit max_steps, through the live ETA) is "—", never a 500 (F11)."""
    records = [_record(1), _record(2, **({"time_unix": 1e20} if case == "clock" else {}))]
    _run(runs, "odd", records, max_steps=10**99 if case == "max_steps" else 100)
    for url in ("/runs/odd", "/api/runs/odd", "/api/runs/odd/metrics?since=0", "/"):
        assert _get(served + url)[0] == 200, url
    eta = json.loads(_get(f"{served}/api/runs/odd")[1])["eta"]
    assert eta["live"] is not None and "live ETA — (" in eta["text"]["live"]


def test_a_replaced_metrics_file_is_a_reset_even_when_it_is_longer(runs: Path, served: str) -> None:
    """The file's identity, not only its length, tells a poller its lines are another file's (F12)."""
    path = runs / "good" / "metrics.jsonl"
    _write(path, [_record(s, train_loss=9.0) for s in range(1, 11)])
    first = json.loads(_get(f"{served}/api/runs/good/metrics?since=0")[1])
    assert (first["next"], first["reset"]) == (10, False)
    again = json.loads(_get(f"{served}/api/runs/good/metrics?since=10&file={first['file']}")[1])
    assert (again["records"], again["reset"]) == ([], False)
    new = path.with_name("metrics.jsonl.new")
    _write(new, [_record(s, train_loss=1.0) for s in range(1, 26)])
    new.replace(path)
    polled = json.loads(_get(f"{served}/api/runs/good/metrics?since=10&file={first['file']}")[1])
    assert polled["reset"] and polled["file"] != first["file"]
    assert [r["step"] for r in polled["records"]] == list(range(1, 26))


def _rchar() -> int:
    """Bytes this process has read so far (Linux)."""
    return int(Path("/proc/self/io").read_text().split("rchar:")[1].split()[0])


@pytest.mark.skipif(not Path("/proc/self/io").is_file(), reason="reads /proc/self/io (Linux)")
def test_an_unterminated_last_line_is_read_once(tmp_path: Path) -> None:
    """A crashed writer's long last line without "\\n" is neither read again at each poll nor kept whole (F13)."""
    from gaudi3_scale.dashboard.metrics_reader import MAX_LINE_BYTES, MetricsReader

    path = tmp_path / "metrics.jsonl"
    _write(path, [_record(1)])
    with path.open("a") as f:
        f.write('{"step": 2, "note": "' + "y" * (3 * MAX_LINE_BYTES))
    reader = MetricsReader()
    assert reader.read(path).partial_last_line
    before = _rchar()
    for _ in range(5):
        view = reader.read(path)
    assert _rchar() - before < MAX_LINE_BYTES  # not 5 × 3 MiB
    with path.open("a") as f:
        f.write('"}\n' + json.dumps(_record(3)) + "\n")
    view = reader.read(path)
    assert (view.count, view.unreadable, view.partial_last_line) == (3, 1, False)
    assert [r["step"] for r in view.records(0)[0]] == [1, 3]


def _long_run(runs: Path, name: str, lines: int, spike_at: int, **extra: Any) -> Path:
    records = [_record(s, **extra) for s in range(1, lines + 1)]
    records[spike_at - 1]["train_loss"] = 50.0
    records[spike_at + 2] = {"step": spike_at + 2, "health_event": "loss_spike", "health_action": "warn",
                             "detail": "spike"}  # fmt: skip
    return _run(runs, name, records, max_steps=lines * 2)


def test_a_long_run_is_served_downsampled_then_incrementally(runs: Path, served: str) -> None:
    """The first poll of a 20,000-line run is a bounded chart of it, its spike and health mark kept; later polls
    are the new lines only (F7). A poller too far behind gets the chart again, as a reset."""
    path = _long_run(runs, "long", 20_000, spike_at=7_777) / "metrics.jsonl"
    whole = path.stat().st_size
    code, body = _get(f"{served}/api/runs/long/metrics?since=0")
    first = json.loads(body)
    assert code == 200 and first["downsampled"] and not first["reset"] and first["next"] == 20_000
    assert len(body) < whole / 10 and len(first["records"]) < 5_000
    steps = [r["step"] for r in first["records"]]
    assert steps == sorted(steps) and steps[0] == 1 and steps[-1] == 20_000
    assert max(r.get("train_loss", 0) for r in first["records"]) == 50.0
    assert [(m["step"], m["mark"]) for m in first["health_marks"]] == [(7_779, "spike")]
    _write(path, [_record(s) for s in (20_001, 20_002)], mode="a")
    later = json.loads(_get(f"{served}/api/runs/long/metrics?since=20000&file={first['file']}")[1])
    assert not later["downsampled"] and not later["reset"]
    assert later["records"] == [_record(20_001), _record(20_002)] and later["next"] == 20_002
    behind = json.loads(_get(f"{served}/api/runs/long/metrics?since=10&file={first['file']}")[1])
    assert behind["downsampled"] and behind["reset"] and behind["records"][0]["step"] == 1


def test_a_long_file_is_held_in_bounded_memory_and_forgotten_when_gone(tmp_path: Path) -> None:
    """What the reader keeps of 20,000 lines is a few MB at most, not every record; a deleted run's is dropped
    (F6)."""
    from gaudi3_scale.dashboard.metrics_reader import MetricsReader

    runs = tmp_path / "runs"
    run = _long_run(runs, "long", 20_000, spike_at=100)
    store = RunStore(runs)
    store.metrics = MetricsReader(budget_s=60.0, sweep_s=0.0)  # all in this call, though tracemalloc slows it
    tracemalloc.start()
    try:
        view = store.metrics_view(run)
        del view
        kept_bytes, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert kept_bytes < 4 * 2**20, kept_bytes  # every record as a dict: about 20 MB
    assert store.overview("long", run)["lines"] == 20_000 and len(store.metrics) == 1
    shutil.rmtree(run)
    store.metrics.read(runs / "other.jsonl")  # any read sweeps
    assert len(store.metrics) == 0


def test_reading_one_long_file_does_not_hold_up_another_runs_api(runs: Path, served: str) -> None:
    """Each file has its own lock, and the first read of a long one does not block the others (F5)."""
    per_rank = {f"compute_s_rank{rank}": 0.25 for rank in range(32)}  # a wide record: slower to parse
    _long_run(runs, "long", 20_000, spike_at=100, **per_rank)
    took: dict[str, float] = {}

    def timed(name: str) -> None:
        start = time.perf_counter()
        assert _get(f"{served}/api/runs/{name}", timeout_s=60)[0] == 200
        took[name] = time.perf_counter() - start

    long_read = threading.Thread(target=timed, args=("long",))
    long_read.start()
    time.sleep(0.05)
    timed("good")
    long_read.join()
    assert took["good"] < took["long"] / 2, took


def test_a_long_first_read_goes_on_in_the_background_and_says_so(tmp_path: Path) -> None:
    """A request reads for at most its budget; the views show what was read so far with a warning, never the
    chunk's cut-off end as an unreadable line, and then the whole file (F5)."""
    from gaudi3_scale.dashboard.metrics_reader import CHUNK_BYTES, MetricsReader

    runs = tmp_path / "runs"
    run = _long_run(runs, "long", 20_000, spike_at=100)
    old = time.time() - 600  # a stopped run: a last line without "\n" would count as truncated
    os.utime(run / "metrics.jsonl", (old, old))
    assert (run / "metrics.jsonl").stat().st_size > CHUNK_BYTES  # more than one chunk
    store = RunStore(runs)
    store.metrics = MetricsReader(budget_s=0.0)
    first = store.overview("long", run)
    assert first["unreadable_lines"] == 0 and 0 < first["lines"] < 20_000
    assert [w.split(" (")[0] for w in first["warnings"]] == ["metrics.jsonl still being read"]
    deadline = time.monotonic() + 30
    while (run_now := store.overview("long", run))["warnings"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (run_now["lines"], run_now["unreadable_lines"], run_now["warnings"]) == (20_000, 0, [])
