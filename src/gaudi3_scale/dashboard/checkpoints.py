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

from gaudi3_scale.checkpoint.manifest import read_manifest, verify_checkpoint

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
    def __init__(self, wait_s: float = 2.0) -> None:
        self.wait_s = wait_s
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
            if pending is None or pending[0] != key:
                future = self._pool.submit(verify_checkpoint, directory)
                future.add_done_callback(functools.partial(self._finish, directory, key))
                pending = self._pending[directory] = (key, future)
            return pending[1]

    def _finish(self, directory: Path, key: _Fingerprint, future: Future[list[str]]) -> None:
        exc = future.exception()
        problems = future.result() if exc is None else [f"{directory.name}: could not be verified ({exc})"]
        with self._lock:
            pending = self._pending.get(directory)
            if pending is not None and pending[0] == key:
                del self._pending[directory]
            self._done[directory] = (key, problems)

    def list(self, run_dir: Path) -> list[dict[str, Any]]:
        """Every step-X checkpoint of the run, newest first, with its manifest facts and status:
        verified, damaged (with the problems), verifying, or uncommitted (no manifest: being written, or left
        by a crash)."""
        from gaudi3_scale.checkpoint.manager import CheckpointManager  # imports torch: only for this view

        manager = CheckpointManager(run_dir / "checkpoints")
        pointer = manager.directory / "latest"
        latest = pointer.read_text().strip() if pointer.is_file() else None
        committed = {path for _, path in manager.committed()}
        checks = {path: self._problems(path) for path in committed}
        futures = [c for c in checks.values() if isinstance(c, Future)]
        if futures:
            wait(futures, timeout=self.wait_s)
        rows = []
        for step, path in reversed(manager.steps()):
            manifest = read_manifest(path) or {}
            check = checks.get(path)
            if isinstance(check, Future):
                check = check.result() if check.done() and check.exception() is None else None
            problems: list[str] = []
            if path not in committed:
                status = "uncommitted"
            elif check is None:
                status = "verifying"
            else:
                status, problems = ("damaged" if check else "verified"), check
            files = manifest.get("files") or {}
            rows.append({
                "name": path.name,
                "step": step,
                "latest": path.name == latest,
                "status": status,
                "problems": problems,
                "tokens_seen": manifest.get("tokens_seen"),
                "val_loss": manifest.get("val_loss"),
                "world_size": manifest.get("world_size"),
                "strategy": manifest.get("strategy"),
                "size_bytes": sum(int(f.get("size_bytes", 0)) for f in files.values() if isinstance(f, dict)),
                "created_unix_s": manifest.get("created_unix_s"),
            })  # fmt: skip
        return rows
