"""A run's checkpoints with their verification status, hashed off the request thread and cached.

Verification (`checkpoint.manifest.verify_checkpoint`) reads and hashes every file, seconds per GB. One background
worker does it; a result is kept until a file in the checkpoint changes (its names, sizes and mtimes are the cache
key). A request waits a little for fresh results, then shows the rest as "verifying" and the page polls again.
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from gaudi3_scale.checkpoint.manifest import (
    MANIFEST_NAME,
    manifest_problem,
    read_manifest,
    read_pointer,
    verify_checkpoint,
)
from gaudi3_scale.dashboard.files import OutsideRuns, first_escape, real_file, real_path

__all__ = ["CheckpointVerifier"]

_Fingerprint = tuple[tuple[str, int, int], ...]


def _fingerprint(directory: Path) -> _Fingerprint:
    files = []
    for path in directory.rglob("*"):
        try:
            if path.is_file():
                st = path.stat()
                files.append((path.relative_to(directory).as_posix(), st.st_size, st.st_mtime_ns))
        except FileNotFoundError:  # a retention policy deleted it while we looked
            continue
    return tuple(sorted(files))


class CheckpointVerifier:
    """Checkpoints of runs under the runs directory `root` (nothing outside it is read or hashed)."""

    def __init__(self, root: Path, wait_s: float = 2.0) -> None:
        self.root, self.wait_s = root, wait_s
        self._done: dict[Path, tuple[_Fingerprint, list[str]]] = {}
        self._pending: dict[Path, tuple[_Fingerprint, Future[list[str]]]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gaudi3-dashboard-verify")

    def _problems(self, directory: Path) -> Future[list[str]] | list[str]:
        """Cached problems, or the future of a verification (started here if none is running)."""
        key = _fingerprint(directory)
        with self._lock:
            done = self._done.get(directory)
            if done is not None and done[0] == key:
                return done[1]
            pending = self._pending.get(directory)
            if pending is not None and pending[0] == key:
                return pending[1]
            future = self._pool.submit(verify_checkpoint, directory)
            self._pending[directory] = (key, future)
        # Outside the lock: a future that is already done runs its callback here, in this thread, and the
        # callback takes the (non-reentrant) lock itself.
        future.add_done_callback(functools.partial(self._finish, directory, key))
        return future

    def _finish(self, directory: Path, key: _Fingerprint, future: Future[list[str]]) -> None:
        exc = future.exception()
        problems = future.result() if exc is None else [f"{directory.name}: could not be verified ({exc})"]
        with self._lock:
            pending = self._pending.get(directory)
            if pending is not None and pending[0] == key:
                del self._pending[directory]
            self._done[directory] = (key, problems)

    def list(self, run_dir: Path) -> tuple[list[dict[str, Any]], str | None]:
        """Every step-X checkpoint of the run, newest first, with its manifest facts and status: verified,
        damaged (with the problems), verifying, or uncommitted (no manifest: being written, or left by a crash);
        and a one-line problem when `checkpoints/` or its `latest` pointer is not read (a link out of the runs
        directory)."""
        from gaudi3_scale.checkpoint.manager import CheckpointManager  # imports torch: only for this view

        try:
            if real_path(self.root, run_dir / "checkpoints") is None:
                return [], None
        except OutsideRuns as exc:
            return [], str(exc)
        latest, problem = self._latest(run_dir / "checkpoints" / "latest")
        found = []
        for step, path in reversed(CheckpointManager(run_dir / "checkpoints").steps()):
            manifest, refused = self._manifest(path)
            check = self._problems(path) if manifest is not None and refused is None else None
            found.append((step, path, manifest, refused, check))
        futures = [check for *_, check in found if isinstance(check, Future)]
        if futures:
            wait(futures, timeout=self.wait_s)
        rows = []
        for step, path, manifest, refused, check in found:
            if isinstance(check, Future):
                check = check.result() if check.done() and check.exception() is None else None
            row = _row(path, step, latest, manifest)
            if refused is not None:
                row.update(status="damaged", problems=[refused])
            elif manifest is not None:
                row["status"] = "verifying" if check is None else "damaged" if check else "verified"
                row["problems"] = check or []
            rows.append(row)
        return rows, problem

    def _latest(self, pointer: Path) -> tuple[str | None, str | None]:
        """(the checkpoint name `latest` holds, why it was not read)."""
        try:
            path = real_file(self.root, pointer)
        except OutsideRuns as exc:
            return None, str(exc)
        return (read_pointer(path) if path is not None else None), None

    def _manifest(self, directory: Path) -> tuple[dict[str, Any] | None, str | None]:
        """(the committed manifest or None, why the checkpoint is not read at all): a link out of the runs
        directory anywhere in it, or a committed manifest that is malformed (`parse_manifest` refuses, among
        others, file names that leave the checkpoint)."""
        escape = first_escape(self.root, directory)
        if escape is not None:
            return None, str(escape)
        manifest = read_manifest(directory)
        # Anything by the manifest's name that is not one is damage (a FIFO there is not read: `read_manifest`).
        if manifest is None and (directory / MANIFEST_NAME).exists():
            return None, f"{directory.name}: {manifest_problem(directory)}"
        return manifest, None


def _size_bytes(files: Any) -> int | None:
    """The manifest's total size; None when its `files` is not the mapping of sizes it should be."""
    if not isinstance(files, dict):
        return None
    sizes = [f.get("size_bytes") if isinstance(f, dict) else None for f in files.values()]
    counted = [s for s in sizes if isinstance(s, int) and not isinstance(s, bool) and s >= 0]
    return sum(counted) if len(counted) == len(sizes) else None


def _row(path: Path, step: int, latest: str | None, manifest: dict[str, Any] | None) -> dict[str, Any]:
    """A checkpoint as the view lists it, before its verification is known."""
    manifest = manifest or {}
    return {
        "name": path.name,
        "step": step,
        "latest": path.name == latest,
        "status": "uncommitted",
        "problems": [],
        "tokens_seen": manifest.get("tokens_seen"),
        "val_loss": manifest.get("val_loss"),
        "world_size": manifest.get("world_size"),
        "strategy": manifest.get("strategy"),
        "size_bytes": _size_bytes(manifest.get("files")),
        "created_unix_s": manifest.get("created_unix_s"),
    }
