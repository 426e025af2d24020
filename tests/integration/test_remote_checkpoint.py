"""Remote checkpoint mirror against a real S3 server (moto, over HTTP on 127.0.0.1), and file:// / memory://.

Upload + read-back verification + remote `latest`; resume from the remote copy alone on a "fresh machine"; a storage
outage in the middle of an upload (the server is stopped, then started again on the same port), whose retries leave
the Python RNG that checkpoints record untouched; a burst of 503s retried, a 403 or a missing bucket refused at once;
a corrupted remote copy skipped by name; bad URLs as one clear error.
"""

from __future__ import annotations

import hashlib
import random
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gaudi3_scale.checkpoint.manifest import MANIFEST_NAME, verify_checkpoint, write_manifest
from gaudi3_scale.checkpoint.remote import RemoteMirror, fetch_latest, open_remote
from gaudi3_scale.config.errors import ConfigError, UserInputError
from s3_server import S3Server, free_port, running_s3_server, s3_options

pytestmark = pytest.mark.integration

BUCKET = "ckpt"
FAST_RETRY = {"initial_backoff_s": 0.05, "max_backoff_s": 0.2}


@pytest.fixture(scope="module")
def s3() -> Iterator[tuple[S3Server, dict[str, Any]]]:
    with running_s3_server(BUCKET) as server_and_options:
        yield server_and_options


def _unique_s3_url() -> str:
    return f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}"


def _make_checkpoint(checkpoints: Path, step: int, num_files: int = 2, file_bytes: int = 256 * 1024) -> Path:
    """A committed checkpoint as the manager writes it: tensors via torch.save, a sharded subdirectory, manifest."""
    directory = checkpoints / f"step-{step:08d}"
    (directory / "model").mkdir(parents=True)
    generator = torch.Generator().manual_seed(step)
    torch.save(
        {"step": step, "w": torch.randn(file_bytes // 4, generator=generator)}, directory / "state.ckpt"
    )
    for i in range(num_files - 1):
        shard = torch.randn(file_bytes // 4, generator=generator)
        torch.save(shard, directory / "model" / f"shard-{i:02d}.pt")
    write_manifest(directory, {"step": step})
    (checkpoints / "latest").write_text(directory.name + "\n")
    return directory


def _digests(directory: Path) -> dict[str, str]:
    return {
        p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _until(condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_upload_verifies_then_moves_remote_latest_and_deletes_superseded(
    s3: tuple[S3Server, dict[str, Any]], tmp_path: Path
) -> None:
    _, options = s3
    url = _unique_s3_url()
    first, second = _make_checkpoint(tmp_path, 100), _make_checkpoint(tmp_path, 200)
    warnings: list[str] = []
    with RemoteMirror(url, storage_options=options, warn=warnings.append, **FAST_RETRY) as mirror:
        mirror.submit(first)
        mirror.submit(second)
        assert mirror.wait(timeout_s=20)
        assert mirror.is_verified(first) and mirror.is_verified(second)
        status = mirror.status()
        assert (status.backlog, status.outage, status.verified) == (0, False, 2)
        total_bytes = sum(p.stat().st_size for d in (first, second) for p in d.rglob("*") if p.is_file())
        assert status.uploaded_bytes >= total_bytes
        assert status.as_metrics()["checkpoint/remote_backlog"] == 0.0

        fs, root = open_remote(url, options)
        fs.invalidate_cache()
        assert fs.cat_file(f"{root}/latest") == b"step-00000200\n"
        for directory in (first, second):
            for name, digest in _digests(directory).items():
                remote = fs.cat_file(f"{root}/{directory.name}/{name}")
                assert hashlib.sha256(remote).hexdigest() == digest

        mirror.delete_remote(second.name)  # the remote `latest`: refused
        mirror.delete_remote(first.name)
        assert mirror.wait(timeout_s=20)
    fs.invalidate_cache()
    assert not fs.exists(f"{root}/{first.name}")
    assert fs.exists(f"{root}/{second.name}/{MANIFEST_NAME}")
    assert warnings == [f"not deleting {url}/step-00000200: the remote `latest` points at it"]


def test_fresh_machine_resumes_from_the_remote_copy_alone(
    s3: tuple[S3Server, dict[str, Any]], tmp_path: Path
) -> None:
    _, options = s3
    url = _unique_s3_url()
    trained = _make_checkpoint(tmp_path / "machine-a", 300)
    with RemoteMirror(url, storage_options=options, **FAST_RETRY) as mirror:
        mirror.submit(trained)
    assert mirror.is_verified(trained)

    fresh = tmp_path / "machine-b" / "checkpoints"
    assert not fresh.exists()
    warnings: list[str] = []
    fetched = fetch_latest(url, fresh, storage_options=options, warn=warnings.append)
    assert fetched == fresh / "step-00000300"
    assert verify_checkpoint(fetched) == []
    assert _digests(fetched) == _digests(trained)
    assert warnings == []
    assert [p.name for p in fresh.iterdir()] == ["step-00000300"]  # no temporary directory left behind
    # Fetching again uses the verified local copy.
    assert fetch_latest(url, fresh, storage_options=options) == fetched


def test_outage_mid_upload_keeps_local_copy_warns_once_and_recovers(
    s3: tuple[S3Server, dict[str, Any]], tmp_path: Path
) -> None:
    server, options = s3
    url = _unique_s3_url()
    big = _make_checkpoint(tmp_path, 400, num_files=12, file_bytes=2 * 2**20)
    before = _digests(big)
    total_bytes = sum(p.stat().st_size for p in big.rglob("*") if p.is_file())
    warnings: list[str] = []
    python_rng = random.getstate()  # what checkpoints record (gaudi3_rng): retries must not draw from it
    mirror = RemoteMirror(url, storage_options=options, warn=warnings.append, **FAST_RETRY)
    try:
        mirror.submit(big)
        _until(lambda: mirror.status().uploaded_bytes > 0)
        server.stop()
        assert mirror.status().uploaded_bytes < total_bytes, "the upload finished before the server stopped"
        _until(lambda: mirror.status().consecutive_failures >= 3)

        status = mirror.status()
        assert status.outage and status.backlog == 1 and status.last_error
        assert not mirror.is_verified(big)
        assert not mirror.wait(timeout_s=0.1)
        assert len(warnings) == 1, warnings  # once per outage, not per retry
        assert url in warnings[0] and "stay on local disk" in warnings[0]
        assert _digests(big) == before and verify_checkpoint(big) == []

        server.start()
        fs, root = open_remote(url, options)
        fs.invalidate_cache()
        assert fs.exists(BUCKET), "moto lost its state across the restart"
        assert mirror.wait(timeout_s=30)
        status = mirror.status()
        assert (status.outage, status.consecutive_failures, status.backlog) == (False, 0, 0)
        assert mirror.is_verified(big)
        assert len(warnings) == 2 and "reachable again" in warnings[1] and url in warnings[1]
        assert random.getstate() == python_rng, "botocore's retry jitter drew from the global random"
    finally:
        if not server.running:
            server.start()  # never leave the module's server down for the next test
        mirror.close(timeout_s=0)
    fs.invalidate_cache()
    assert fs.cat_file(f"{root}/latest") == b"step-00000400\n"
    fetched = fetch_latest(url, tmp_path / "fresh", storage_options=options)
    assert fetched is not None and _digests(fetched) == before


def test_corrupted_remote_copy_is_skipped_by_name(
    s3: tuple[S3Server, dict[str, Any]], tmp_path: Path
) -> None:
    _, options = s3
    url = _unique_s3_url()
    older, newer = _make_checkpoint(tmp_path, 500), _make_checkpoint(tmp_path, 600)
    with RemoteMirror(url, storage_options=options, **FAST_RETRY) as mirror:
        mirror.submit(older)
        mirror.submit(newer)
    fs, root = open_remote(url, options)
    remote_state = f"{root}/{newer.name}/state.ckpt"
    data = bytearray(fs.cat_file(remote_state))
    data[len(data) // 2] ^= 0x01
    fs.pipe_file(remote_state, bytes(data))

    warnings: list[str] = []
    fetched = fetch_latest(url, tmp_path / "fresh", storage_options=options, warn=warnings.append)
    assert fetched == tmp_path / "fresh" / older.name
    assert _digests(fetched) == _digests(older)
    assert len(warnings) == 1
    assert f"{url}/{newer.name}" in warnings[0] and "SHA-256 does not match" in warnings[0]
    assert not (tmp_path / "fresh" / newer.name).exists()

    # Submitted again (a new run), the damaged copy fails the read-back and is uploaded again.
    warnings.clear()
    with RemoteMirror(url, storage_options=options, warn=warnings.append, **FAST_RETRY) as mirror:
        mirror.submit(newer)
    assert mirror.is_verified(newer)
    fs.invalidate_cache()
    assert fs.cat_file(remote_state) == (newer / "state.ckpt").read_bytes()
    assert len(warnings) == 2 and "does not verify after upload" in warnings[0], warnings


@pytest.mark.parametrize("refusal", ["403 access denied", "404 no such bucket"])
def test_a_store_that_refuses_fails_at_once_and_loses_nothing(
    s3: tuple[S3Server, dict[str, Any]], tmp_path: Path, refusal: str
) -> None:
    """A wrong permission or bucket is one line at the first attempt, for the mirror and for a resume: no retrying
    that backoff would stretch forever; the local checkpoints and what the store already held stay whole."""
    server, options = s3
    url = _unique_s3_url()
    saved = _make_checkpoint(tmp_path / "earlier", 800)
    with RemoteMirror(url, storage_options=options, **FAST_RETRY) as mirror:
        mirror.submit(saved)
    assert mirror.is_verified(saved)
    ckpt = _make_checkpoint(tmp_path / "now", 900)
    before = _digests(ckpt)
    if refusal.startswith("403"):
        target, expected = url, "AccessDenied"
        server.answer(403, "AccessDenied")
    else:
        target, expected = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run", "bucket does not exist"
    warnings: list[str] = []
    served = len(server.requests)
    try:
        start_s = time.monotonic()
        mirror = RemoteMirror(target, storage_options=options, warn=warnings.append, **FAST_RETRY)
        mirror.submit(ckpt)
        assert not mirror.wait(timeout_s=10)  # the uploader stopped: nothing left to wait for
        mirror_s = time.monotonic() - start_s
        mirror.close(timeout_s=0)
        with pytest.raises(UserInputError) as info:
            fetch_latest(target, tmp_path / "fresh", storage_options=options)
        attempts = len(server.requests) - served
    finally:
        server.reset()
    # FAST_RETRY would retry every 0.2 s for ever: one attempt each, in far less than the wait above
    assert mirror_s < 5 and attempts <= 4, (mirror_s, server.requests[served:])
    status = mirror.status()
    assert status.consecutive_failures == 1 and status.outage and status.backlog == 1
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    line = warnings[0]
    assert line.startswith(f"remote checkpoint storage {target} refuses the upload (") and expected in line
    assert "checkpoint.remote_url" in line
    message = str(info.value)
    assert message.startswith(f"checkpoint.remote_url: cannot fetch a checkpoint to resume from {target!r}")
    assert expected in message and "\n" not in message
    assert not (tmp_path / "fresh" / saved.name).exists()
    # nothing lost: the local checkpoint is whole and unverified (retention keeps it), the store's copy still resumes
    assert not mirror.is_verified(ckpt) and _digests(ckpt) == before and verify_checkpoint(ckpt) == []
    fetched = fetch_latest(url, tmp_path / "resumed", storage_options=options)
    assert fetched is not None and fetched.name == saved.name and _digests(fetched) == _digests(saved)


def test_a_burst_of_503s_is_retried_and_the_upload_verifies(
    s3: tuple[S3Server, dict[str, Any]], tmp_path: Path
) -> None:
    server, options = s3
    url, ckpt = _unique_s3_url(), _make_checkpoint(tmp_path, 1000)
    warnings: list[str] = []
    server.answer(503, "ServiceUnavailable", times=4)
    try:
        with RemoteMirror(url, storage_options=options, warn=warnings.append, **FAST_RETRY) as mirror:
            mirror.submit(ckpt)
            assert mirror.wait(timeout_s=30)
    finally:
        server.reset()
    assert mirror.is_verified(ckpt)
    assert len(warnings) == 2, warnings
    assert "is failing" in warnings[0] and "ServiceUnavailable" in warnings[0] and "retrying" in warnings[0]
    assert "reachable again" in warnings[1]
    status = mirror.status()
    assert (status.outage, status.consecutive_failures, status.verified) == (False, 0, 1)


def test_storage_unreachable_at_start_only_warns(tmp_path: Path) -> None:
    pytest.importorskip("s3fs", reason="needs the `remote` extra")
    url, ckpt = _unique_s3_url(), _make_checkpoint(tmp_path, 700)
    warnings: list[str] = []
    mirror = RemoteMirror(url, storage_options=s3_options(free_port()), warn=warnings.append, **FAST_RETRY)
    mirror.submit(ckpt)
    _until(lambda: mirror.status().outage)
    mirror.close(timeout_s=0.2)  # gives up on the backlog and names it
    assert len(warnings) == 2 and url in warnings[0] and "failing" in warnings[0]
    assert "not mirrored" in warnings[1] and ckpt.name in warnings[1]
    assert not mirror.is_verified(ckpt) and verify_checkpoint(ckpt) == []


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_memory_and_file_urls(scheme: str, tmp_path: Path) -> None:
    url = f"memory://ckpt-{uuid.uuid4().hex[:8]}" if scheme == "memory" else (tmp_path / "remote").as_uri()
    first, second = _make_checkpoint(tmp_path / "local", 10), _make_checkpoint(tmp_path / "local", 20)
    with RemoteMirror(url, **FAST_RETRY) as mirror:
        mirror.submit(first)
        mirror.submit(second)
        mirror.delete_remote(first.name)
    assert mirror.is_verified(first) and mirror.is_verified(second)
    fs, root = open_remote(url)
    assert fs.cat_file(f"{root}/latest") == b"step-00000020\n"
    assert not fs.exists(f"{root}/{first.name}")
    if scheme == "file":
        assert not (tmp_path / "remote" / "latest.tmp").exists()
    fetched = fetch_latest(url, tmp_path / "fresh")
    assert fetched is not None and fetched.name == second.name
    assert _digests(fetched) == _digests(second)


def test_local_checkpoint_changed_after_commit_is_skipped_not_retried(tmp_path: Path) -> None:
    url = f"memory://ckpt-{uuid.uuid4().hex[:8]}"
    ckpt = _make_checkpoint(tmp_path, 30)
    state = ckpt / "state.ckpt"
    state.write_bytes(state.read_bytes()[:-1])
    warnings: list[str] = []
    with RemoteMirror(url, warn=warnings.append, **FAST_RETRY) as mirror:
        mirror.submit(ckpt)
    assert not mirror.is_verified(ckpt)
    assert mirror.status().consecutive_failures == 0
    assert len(warnings) == 1 and "changed after its commit" in warnings[0] and str(state) in warnings[0]
    fs, root = open_remote(url)
    assert not fs.exists(f"{root}/{ckpt.name}/{MANIFEST_NAME}") and not fs.exists(f"{root}/latest")


def test_a_newer_checkpoint_is_only_what_the_remote_latest_names(tmp_path: Path) -> None:
    """`newer_than` (a node on its own disk that holds a checkpoint already): the remote `latest` when it is newer,
    never a higher step beside it, which a rollback may have abandoned."""
    url = (tmp_path / "remote").as_uri()
    older, abandoned = _make_checkpoint(tmp_path / "local", 20), _make_checkpoint(tmp_path / "local", 30)
    with RemoteMirror(url, **FAST_RETRY) as mirror:
        mirror.submit(older)
        mirror.submit(abandoned)
    fs, root = open_remote(url)
    # the remote latest back at step 20, as after a rollback to it
    fs.pipe_file(f"{root}/latest", b"step-00000020\n")
    fetched = fetch_latest(url, tmp_path / "node1", newer_than=10)
    assert fetched is not None and fetched.name == older.name and _digests(fetched) == _digests(older)
    assert fetch_latest(url, tmp_path / "node1b", newer_than=20) is None
    assert not (tmp_path / "node1b" / abandoned.name).exists()


def test_empty_remote_fetches_nothing(tmp_path: Path) -> None:
    assert fetch_latest(f"memory://empty-{uuid.uuid4().hex[:8]}", tmp_path) is None


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("nosuchproto://bucket/run", "unknown protocol 'nosuchproto'"),
        ("bucket/run", "has no protocol"),
    ],
)
def test_bad_url_is_one_clear_error(url: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        RemoteMirror(url)
    message = str(info.value)
    assert message.startswith("checkpoint.remote_url: ") and expected in message
    assert "s3://" in message and "\n" not in message


def test_missing_backend_names_the_package() -> None:
    import importlib.util

    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed here")
    with pytest.raises(ConfigError, match="gcsfs"):
        fetch_latest("gs://bucket/run", Path("unused"))


def test_training_mirrors_to_s3_and_a_fresh_machine_resumes_from_it(
    s3: tuple[S3Server, dict[str, Any]], tmp_path: Path
) -> None:
    """`gaudi3 train --checkpoint.remote_url s3://…` end to end; credentials and endpoint from the environment."""
    import json
    import os
    import subprocess
    import sys

    server, _ = s3
    url = _unique_s3_url()
    env = {**os.environ, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{server.port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "eu-west-1"}  # fmt: skip

    def train(out: Path, steps: int) -> None:
        proc = subprocess.run(
            [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(out), "--no-progress",
             "--sample-tokens", "0", "--train.threads", "2", "--train.max_steps", str(steps),
             "--train.log_every_steps", "1", "--train.val_every_steps", "0", "--checkpoint.every_steps", "4",
             "--checkpoint.keep_last", "1", "--checkpoint.remote_url", url],
            capture_output=True, text=True, env=env, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]

    first = tmp_path / "machine-a"
    train(first, 8)
    fs, root = open_remote(url, s3_options(server.port))
    # Retention ran on both sides once step 8's upload was verified: only step 8 is left, and `latest` names it.
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root)) == ["latest", "step-00000008"]
    assert fs.cat_file(f"{root}/latest").decode().strip() == "step-00000008"
    records = [json.loads(line) for line in (first / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if "train_loss" in r]  # the last line is the final validation's
    assert "checkpoint/remote_backlog" in train_records[-1] and "val_loss" in records[-1]
    fresh = tmp_path / "machine-b"  # nothing local: the run starts from the remote copy
    train(fresh, 12)
    records = [json.loads(line) for line in (fresh / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train_loss" in r] == [9, 10, 11, 12]
    # its forecast (written before the download) starts where the remote copy does
    assert json.loads((fresh / "plan.json").read_text())["run"]["start_step"] == 8
    assert verify_checkpoint(fresh / "checkpoints" / "step-00000012") == []
    assert fs.cat_file(f"{root}/latest").decode().strip() == "step-00000012"
