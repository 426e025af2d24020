"""Mirror committed checkpoints to any fsspec URL (`s3://`, `gs://`, `az://`, `file://`, `memory://`) and back.

The remote layout and `fetch_latest` (resume on a fresh machine) live in `checkpoint/storage.py`.

Per checkpoint the uploader writes every payload file, then `manifest.json` (the remote commit), then reads the
whole copy back (sizes, SHA-256 of the bytes the store returns, against the manifest) and only then moves the
remote `latest` pointer. Only a checkpoint that passed that read-back is "verified"; retention must keep the local
copy until `is_verified` says so.

One background thread uploads, in submission order, so training never waits on the network. A transient storage
error (`storage.is_transient_error`: refused connection, timeout, throttling, HTTP 5xx, 408 or 429, a read-back
mismatch) is retried *indefinitely* with exponential backoff capped at `max_backoff_s`: a retry limit would turn a
long outage into checkpoints that are never mirrored, while retrying only costs local disk for the unverified
backlog. `warn` is called once when an outage begins (URL + error) and once when it ends; `status()` has the numbers
for metrics. An error that retrying cannot fix (HTTP 403 access denied, 404 no such bucket, missing credentials)
stops the mirror at its first attempt: one `warn` line names the URL and the error, training goes on, and every
checkpoint stays on local disk (retention keeps what is not verified remotely). A problem with the *local*
checkpoint (deleted or modified after its commit) is not retried: that checkpoint is skipped with a warning.

URL checks: no protocol, an unknown protocol or a missing backend package (e.g. s3fs) raise `ConfigError` at once.
Storage that is unreachable at start only warns (the first outage) and uploads retry: storage that is briefly down
must not stop a training job.
"""

from __future__ import annotations

import functools
import hashlib
import os
import posixpath
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gaudi3_scale.checkpoint.manifest import MANIFEST_NAME, ManifestError, parse_manifest, read_manifest
from gaudi3_scale.checkpoint.storage import (
    LATEST_NAME,
    STEP_NAME,
    Warn,
    copy_stream,
    default_warn,
    fetch_latest,
    is_local_filesystem,
    open_remote,
    read_remote_bytes,
    read_remote_pointer,
    remote_problems,
)
from gaudi3_scale.storage import is_missing_bucket, is_transient_error

# fetch_latest and open_remote are re-exported: the mirror and the resume path are used together.
__all__ = ["MirrorStatus", "RemoteMirror", "fetch_latest", "open_remote"]


@dataclass(frozen=True)
class MirrorStatus:
    url: str
    backlog: int  # checkpoints submitted and not yet verified remotely (the one uploading included)
    outage: bool  # the last attempt failed and none has succeeded since
    consecutive_failures: int
    last_error: str | None  # "ExceptionType: message" of the latest failure
    uploaded_bytes: int  # bytes written to the store since start, retries included
    verified: int  # checkpoints verified remotely since start

    def as_metrics(self) -> dict[str, float]:
        return {
            "checkpoint/remote_backlog": float(self.backlog),
            "checkpoint/remote_outage": float(self.outage),
            "checkpoint/remote_consecutive_failures": float(self.consecutive_failures),
            "checkpoint/remote_uploaded_bytes": float(self.uploaded_bytes),
        }


class _LocalCheckpointError(Exception):
    """The local checkpoint cannot be mirrored as committed (gone, or changed since): skipped, not retried."""


class _Abandoned(Exception):
    """close() ran out of time: stop uploading."""


class _Refused(Exception):
    """The store gave an error that retrying cannot fix: stop uploading."""


@dataclass
class _Job:
    step_name: str
    directory: Path | None  # None: delete the remote copy
    uploaded: set[str] = field(default_factory=set)  # files already written whole in an earlier attempt
    reupload: bool = False  # the read-back failed: write everything again


class RemoteMirror:
    """Uploads committed checkpoints in the background; see the module docstring for order and failure handling.

    `storage_options` go to fsspec (for s3: `key`, `secret`, `client_kwargs={"endpoint_url": …}`, …). After a
    failure the next attempt waits `initial_backoff_s`, doubling up to `max_backoff_s`. `warn` receives the outage
    and recovery messages (default: `warnings.warn`). Call `close()` or use it as a context manager: it waits for
    the backlog, up to `timeout_s`; if the program ends without it, the thread still finishes the queue unless
    the storage is failing.
    """

    def __init__(
        self,
        url: str,
        *,
        storage_options: dict[str, Any] | None = None,
        initial_backoff_s: float = 1.0,
        max_backoff_s: float = 60.0,
        warn: Warn | None = None,
    ) -> None:
        if not 0 < initial_backoff_s <= max_backoff_s:
            raise ValueError(
                f"need 0 < initial_backoff_s <= max_backoff_s, got {initial_backoff_s}, {max_backoff_s}"
            )
        self.url = url.rstrip("/")
        self._fs, self._root = open_remote(url, storage_options)
        self._initial_backoff_s, self._max_backoff_s = initial_backoff_s, max_backoff_s
        self._warn = warn or default_warn
        self._lock = threading.Condition()
        self._jobs: deque[_Job] = deque()
        # resolved directory -> SHA-256 of the manifest whose remote copy was verified
        self._verified: dict[Path, str] = {}
        self._newest_verified_step = -1
        self._outage_since_s: float | None = None
        self._failures = 0
        self._last_error: str | None = None
        self._uploaded_bytes = 0
        self._verified_count = 0
        self._closing = False
        self._worker_done = False
        self._stop = threading.Event()
        # Not a daemon: an upload in flight at interpreter exit finishes (a daemon would be killed mid-write).
        self._thread = threading.Thread(target=self._run, name="checkpoint-remote-mirror")
        self._thread.start()

    # ---- called from training ----
    def submit(self, directory: str | os.PathLike[str]) -> None:
        """Queue a committed checkpoint directory for upload; returns at once."""
        directory = Path(directory)
        if not STEP_NAME.fullmatch(directory.name) or read_manifest(directory) is None:
            raise ValueError(f"{directory} is not a committed step-N checkpoint directory")
        self._enqueue(_Job(directory.name, directory))

    def delete_remote(self, step_name: str) -> None:
        """Queue deleting the remote copy of `step_name` (after the uploads queued before it); never the `latest`."""
        if not STEP_NAME.fullmatch(step_name):
            raise ValueError(f"{step_name!r} is not a step-N checkpoint name")
        self._enqueue(_Job(step_name, None))

    def is_verified(self, directory: str | os.PathLike[str]) -> bool:
        """True once the remote copy of this very checkpoint (same manifest) was read back and matched."""
        directory = Path(directory).resolve()
        with self._lock:
            digest = self._verified.get(directory)
        try:
            return digest == hashlib.sha256((directory / MANIFEST_NAME).read_bytes()).hexdigest()
        except OSError:
            return False

    def status(self) -> MirrorStatus:
        with self._lock:
            return MirrorStatus(
                url=self.url,
                backlog=sum(job.directory is not None for job in self._jobs),
                outage=self._outage_since_s is not None,
                consecutive_failures=self._failures,
                last_error=self._last_error,
                uploaded_bytes=self._uploaded_bytes,
                verified=self._verified_count,
            )

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the queue is empty (True) or `timeout_s` passed (False)."""
        with self._lock:
            self._lock.wait_for(lambda: not self._jobs or self._worker_done, timeout_s)
            return not self._jobs

    def close(self, timeout_s: float | None = None) -> None:
        """Drain the queue for up to `timeout_s` (None: until done), then stop; what is left is named in a warning."""
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        self.wait(timeout_s)
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> RemoteMirror:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the uploader thread ----
    def _enqueue(self, job: _Job) -> None:
        with self._lock:
            if self._closing:
                raise RuntimeError(f"the mirror to {self.url} is closed")
            self._jobs.append(job)
            self._lock.notify_all()

    def _next_job(self) -> _Job | None:
        with self._lock:
            while not (self._jobs or self._closing):
                if not threading.main_thread().is_alive():
                    return None  # the program ended without close(): do not keep it alive
                self._lock.wait(timeout=0.5)
            return self._jobs[0] if self._jobs else None

    def _run(self) -> None:
        try:
            self._attempt(self._probe)
            while (job := self._next_job()) is not None:
                delay_s = self._initial_backoff_s
                while not self._attempt(functools.partial(self._perform, job)):
                    # Give up only when close() ran out of time, or the program ended without calling close().
                    if self._stop.wait(delay_s) or not threading.main_thread().is_alive():
                        raise _Abandoned
                    delay_s = min(2 * delay_s, self._max_backoff_s)
                with self._lock:
                    self._jobs.popleft()
                    self._lock.notify_all()
        except _Refused as e:
            self._warn(str(e))
        except _Abandoned:
            with self._lock:
                left = [job.step_name for job in self._jobs if job.directory is not None]
            if left:
                self._warn(
                    f"{len(left)} checkpoint(s) not mirrored to {self.url}, kept locally: {', '.join(left)}"
                )
        finally:
            with self._lock:
                self._worker_done = True
                self._lock.notify_all()

    def _attempt(self, action: Callable[[], None]) -> bool:
        """Run one attempt; False means a transient storage failure to retry, `_Refused` one that is not."""
        try:
            action()
        except _Abandoned:
            raise
        except _LocalCheckpointError as e:
            self._warn(f"not mirroring a checkpoint to {self.url}: {e}")
            return True
        except Exception as e:  # a storage error: counted, kept in status; retried and warned once per outage
            self._record_failure(e, retrying=is_transient_error(e))
            return False
        self._record_success()
        return True

    def _record_failure(self, error: Exception, *, retrying: bool) -> None:
        with self._lock:
            self._failures += 1
            self._last_error = last_error = " ".join(f"{type(error).__name__}: {error}".split())
            starts = self._outage_since_s is None
            if starts:
                self._outage_since_s = time.monotonic()
            backlog = sum(job.directory is not None for job in self._jobs)
        if not retrying:
            raise _Refused(
                f"remote checkpoint storage {self.url} refuses the upload ({last_error}), which retrying cannot "
                f"fix: not mirroring; training continues and its checkpoints stay on local disk ({backlog} "
                "queued); fix checkpoint.remote_url or the store's credentials"
            ) from error
        if starts:
            self._warn(
                f"remote checkpoint storage {self.url} is failing ({last_error}); training continues, "
                f"{backlog} checkpoint(s) stay on local disk until their upload is verified; "
                f"retrying with backoff up to {self._max_backoff_s:g} s"
            )

    def _record_success(self) -> None:
        with self._lock:
            since_s, failures = self._outage_since_s, self._failures
            self._outage_since_s, self._failures = None, 0
            backlog = sum(job.directory is not None for job in self._jobs)
        if since_s is not None:
            self._warn(
                f"remote checkpoint storage {self.url} is reachable again after {failures} failed attempt(s) "
                f"in {time.monotonic() - since_s:.0f} s; {backlog} checkpoint(s) in the upload backlog"
            )

    def _count(self, num_bytes: int) -> None:
        with self._lock:
            self._uploaded_bytes += num_bytes

    def _progress(self, num_bytes: int) -> None:
        self._count(num_bytes)
        if self._stop.is_set():
            raise _Abandoned

    def _probe(self) -> None:
        try:
            self._fs.ls(self._root, detail=False)
        except FileNotFoundError as e:  # reachable, nothing uploaded yet; unless the bucket itself is missing
            if is_missing_bucket(e):
                raise

    def _perform(self, job: _Job) -> None:
        if job.directory is None:
            self._delete(job.step_name)
        else:
            self._upload(job, job.directory)

    def _upload(self, job: _Job, directory: Path) -> None:
        try:
            manifest_bytes = (directory / MANIFEST_NAME).read_bytes()
            files: dict[str, Any] = parse_manifest(manifest_bytes)["files"]
        except (OSError, ManifestError) as e:
            raise _LocalCheckpointError(f"{directory}: manifest unreadable ({e})") from e
        remote_dir = f"{self._root}/{job.step_name}"
        remote_manifest = f"{remote_dir}/{MANIFEST_NAME}"
        existing = read_remote_bytes(self._fs, remote_manifest)
        # An identical remote manifest: submitted again (after a restart, say), so only verify.
        if job.reupload or existing != manifest_bytes:
            if existing is not None:
                self._fs.rm(remote_manifest)  # uncommit a different copy before overwriting its files
            for name in sorted(set(files) - job.uploaded):
                self._put(directory / name, f"{remote_dir}/{name}", files[name])
                job.uploaded.add(name)
            self._write(remote_manifest, manifest_bytes)  # the remote commit, after every payload file
        problems = remote_problems(self._fs, remote_dir, files)
        if read_remote_bytes(self._fs, remote_manifest) != manifest_bytes:
            problems.append(f"{MANIFEST_NAME}: differs from the local one")
        if problems:
            job.uploaded.clear()
            job.reupload = True
            raise OSError(f"{self.url}/{job.step_name} does not verify after upload: {problems[0]}")
        self._move_latest(job.step_name)
        with self._lock:
            self._verified[directory.resolve()] = hashlib.sha256(manifest_bytes).hexdigest()
            self._verified_count += 1

    def _put(self, local: Path, remote: str, entry: dict[str, Any]) -> None:
        try:
            src = local.open("rb")
        except OSError as e:
            raise _LocalCheckpointError(f"{local}: {e}") from e
        with src:
            if is_local_filesystem(self._fs):
                self._fs.makedirs(posixpath.dirname(remote), exist_ok=True)
            with self._fs.open(remote, "wb") as dst:
                size_bytes, sha256 = copy_stream(src, dst, self._progress)
        if (size_bytes, sha256) != (entry["size_bytes"], entry["sha256"]):
            raise _LocalCheckpointError(
                f"{local} changed after its commit (size or SHA-256 differs from the manifest)"
            )

    def _write(self, path: str, data: bytes) -> None:
        if is_local_filesystem(self._fs):
            self._fs.makedirs(posixpath.dirname(path), exist_ok=True)
        self._fs.pipe_file(path, data)
        self._count(len(data))

    def _move_latest(self, step_name: str) -> None:
        step = int(step_name.removeprefix("step-"))
        if step < self._newest_verified_step:
            return  # an older checkpoint submitted again: the pointer never moves back
        path, data = f"{self._root}/{LATEST_NAME}", f"{step_name}\n".encode()
        if is_local_filesystem(self._fs):
            self._write(path + ".tmp", data)
            self._fs.mv(path + ".tmp", path)  # a rename: atomic on POSIX
        else:
            self._write(path, data)  # one PUT: object stores replace an object atomically
        self._newest_verified_step = step

    def _delete(self, step_name: str) -> None:
        if read_remote_pointer(self._fs, self._root) == step_name:
            self._warn(f"not deleting {self.url}/{step_name}: the remote `{LATEST_NAME}` points at it")
            return
        remote_dir = f"{self._root}/{step_name}"
        for path, recursive in ((f"{remote_dir}/{MANIFEST_NAME}", False), (remote_dir, True)):
            try:  # the manifest first: a half-deleted copy never looks committed
                self._fs.rm(path, recursive=recursive)
            except FileNotFoundError:
                continue
        self._fs.invalidate_cache(remote_dir)
