"""A size-bounded local cache of verified shard files, shared by every process on the node (ranks, workers).

Layout, in one directory: `<sha256[:16]>-<name>` is a verified shard (named by content, so a dataset re-prepared
under the same URL never reuses a stale file), `<…>.part` the download in progress, `<…>.lock` and `<…>.fetch.lock`
its two lock files, and `.cache.lock` the lock taken to count bytes and evict.

Locks are `flock`s, which belong to an open file description: they exclude threads of one process as well as other
processes, and the kernel drops them when a process dies.
  * `<…>.lock` held shared = a *pin*: the holder uses the file, so it is never evicted (eviction takes it
    exclusively, without waiting, and skips the shard when it cannot). A file is looked up under this pin.
  * `<…>.fetch.lock` held exclusively = a download: one process fetches the shard while the others wait on the lock,
    then find the verified file present. A `.part` file exists only while its fetch lock is held, so one whose lock
    can be taken was left by a dead process and is deleted.
Two locks, because a pin may last as long as training reads the shard: a process that finds the shard absent must
wait for a download in progress, never for the pins of processes that already use it.
A verified file is trusted by its size afterwards (never re-hashed): it is renamed into place only after its size
and SHA-256 matched the manifest.

Eviction takes the least recently used files (mtime, touched on each use) whose lock it can take exclusively
without waiting, until the new shard fits in `limit_bytes`; `.part` files count at their full size, reserved before
the download starts. Deleting a file that another process has memory-mapped is safe on Linux: the mapping stays valid
and the disk space is freed when it is unmapped (so disk use can briefly exceed the limit by such files).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import posixpath
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from gaudi3_scale.data.manifest import Shard

__all__ = ["ShardCache", "local_name"]

_CACHE_LOCK = ".cache.lock"
_SPACE_POLL_S = 0.2


def local_name(shard: Shard) -> str:
    return f"{shard.sha256[:16]}-{posixpath.basename(shard.file)}"


def _lock(fd: int, mode: int) -> bool:
    """flock `fd`; False when `mode` has LOCK_NB and another holder has it. Blocking waits release the GIL."""
    try:
        fcntl.flock(fd, mode)
    except BlockingIOError:
        return False
    return True


class ShardCache:
    """The cache directory's files and locks; `acquire` returns a pinned, verified local copy of a shard."""

    def __init__(self, directory: Path, limit_bytes: int) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.limit_bytes = limit_bytes
        self._evictions = 0
        self._count_lock = threading.Lock()
        self._fds: set[int] = set()  # every lock file descriptor open now, whichever thread opened it

    @property
    def evictions(self) -> int:
        return self._evictions

    def unpin(self, fd: int) -> None:
        self._close(fd)

    def after_fork_in_child(self) -> None:
        """Close the child's copies of every lock descriptor (pins held, or being taken by another thread of the
        parent at the fork): a flock lives as long as any copy, so they would pin or block for the parent."""
        self._count_lock = threading.Lock()  # another thread of the parent may have held it at the fork
        fds, self._fds = self._fds, set()
        for fd in fds:
            os.close(fd)

    def _close(self, fd: int) -> None:
        with self._count_lock:
            self._fds.discard(fd)
            os.close(fd)  # under the lock: a number closed and reused by another thread is never confused

    def path(self, shard: Shard) -> Path:
        return self.directory / local_name(shard)

    def _open_lock(self, name: str, suffix: str = ".lock") -> int:
        with self._count_lock:  # opened under the lock, so a fork never separates an fd from its record
            fd = os.open(self.directory / f"{name}{suffix}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            self._fds.add(fd)
        return fd

    def _present(self, shard: Shard) -> bool:
        try:
            return self.path(shard).stat().st_size == shard.size_bytes
        except FileNotFoundError:
            return False

    def _pin(self, shard: Shard) -> int:
        fd = self._open_lock(local_name(shard))
        _lock(fd, fcntl.LOCK_SH)  # waits at most for an eviction in progress: evictions never wait themselves
        return fd

    def pin_if_present(self, shard: Shard) -> int | None:
        """A pin (an fd holding the shared lock; `unpin` it) when the verified file is here, else None."""
        fd = self._pin(shard)
        if self._present(shard):
            os.utime(self.path(shard))  # the LRU clock
            return fd
        self._close(fd)
        return None

    def acquire(
        self,
        shard: Shard,
        download: Callable[[Path], None],
        *,
        space_wait_s: float,
        make_room: Callable[[], bool] | None = None,
    ) -> int | None:
        """A pin on the verified local copy of `shard`, downloading it (`download(part_path)` writes and verifies,
        or raises) when absent; None when pinned files leave no room for it for `space_wait_s`. While there is no
        room, `make_room` is called first: it drops one more of the caller's own pins each call (e.g. its prefetch
        window's) and returns False when it has none left to drop; only then does the cache wait."""
        # The pin is held from here on: the file cannot be evicted between its download and its use.
        pin = self._pin(shard)
        try:
            if not self._present(shard):
                fetch = self._open_lock(local_name(shard), ".fetch.lock")
                try:
                    _lock(fetch, fcntl.LOCK_EX)  # waits while another thread or process downloads it
                    if not self._present(shard):
                        if not self._reserve_waiting(shard, space_wait_s, make_room):
                            self._close(pin)
                            return None
                        self._fill(shard, download)
                finally:
                    self._close(fetch)
            os.utime(self.path(shard))
        except BaseException:
            self._close(pin)
            raise
        return pin

    def _reserve_waiting(self, shard: Shard, wait_s: float, make_room: Callable[[], bool] | None) -> bool:
        deadline = time.monotonic() + wait_s
        while not self._reserve(shard):
            if make_room is not None and make_room():
                continue
            if time.monotonic() >= deadline:
                return False
            time.sleep(_SPACE_POLL_S)
        return True

    def _fill(self, shard: Shard, download: Callable[[Path], None]) -> None:
        part = self.directory / f"{local_name(shard)}.part"
        try:
            download(part)
            os.rename(part, self.path(shard))  # only verified bytes ever carry the final name
        finally:
            with contextlib.suppress(FileNotFoundError):
                part.unlink()

    def _reserve(self, shard: Shard) -> bool:
        """Under the cache lock: evict until `shard` fits, then hold its room with a full-size `.part` file."""
        with self._cache_locked():
            used_bytes, candidates = self._usage()
            for _, name, size_bytes in sorted(candidates):  # least recently used first
                if used_bytes + shard.size_bytes <= self.limit_bytes:
                    break
                if self._evict(name):
                    used_bytes -= size_bytes
            if used_bytes + shard.size_bytes > self.limit_bytes:
                return False
            with open(self.directory / f"{local_name(shard)}.part", "wb") as f:
                f.truncate(shard.size_bytes)
            return True

    @contextlib.contextmanager
    def _cache_locked(self) -> Iterator[None]:
        fd = self._open_lock(_CACHE_LOCK, "")
        try:
            _lock(fd, fcntl.LOCK_EX)
            yield
        finally:
            self._close(fd)

    def _usage(self) -> tuple[int, list[tuple[int, str, int]]]:
        """Bytes held (shards + reserved downloads) and the shards as (mtime_ns, name, size) eviction candidates."""
        used_bytes, candidates = 0, []
        for entry in os.scandir(self.directory):
            name = entry.name
            if name.startswith(".") or name.endswith(".lock"):
                continue
            try:
                stat = entry.stat()
            except FileNotFoundError:
                continue
            if name.endswith(".part") and self._remove_if_abandoned(name[: -len(".part")], entry.path):
                continue
            used_bytes += stat.st_size
            if not name.endswith(".part"):
                candidates.append((stat.st_mtime_ns, name, stat.st_size))
        return used_bytes, candidates

    def _remove_if_abandoned(self, name: str, part_path: str) -> bool:
        fd = self._open_lock(name, ".fetch.lock")
        try:
            if not _lock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB):
                return False  # a live download
            with contextlib.suppress(FileNotFoundError):
                os.unlink(part_path)
            return True
        finally:
            self._close(fd)

    def _evict(self, name: str) -> bool:
        fd = self._open_lock(name)
        try:
            if not _lock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB):
                return False  # pinned, or being fetched
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.directory / name)
            with self._count_lock:
                self._evictions += 1
            return True
        finally:
            self._close(fd)
