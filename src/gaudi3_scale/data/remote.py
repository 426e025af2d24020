"""A prepared dataset read from object storage (`s3://…`, `gs://…`, `file://…`, `memory://…`) through a local cache.

`RemoteDataset.open(url, …)` fetches `manifest.json` and the tokenizer into the cache directory and checks them, and
fails at once, with one line, when the URL cannot be reached or holds no prepared dataset. Shards come on demand:
`shard_path(shard)` returns a local file, downloading it first if needed — into a `.part` file, its size and SHA-256
checked while it streams, then renamed into place. `prefetch(shards)` names the shards needed next; a background
thread fetches up to `prefetch_shards` of them ahead so that `shard_path` usually returns at once — and never more
than the cache holds less one shard (`prefetch_room`), the room `shard_path` needs for a shard outside the window.

Failures: a transient storage error (refused / reset / timed-out connection, HTTP 5xx, 408 or 429) is retried with
jittered exponential backoff for up to `fetch_retry_s` (one warning per outage, one on recovery), then training
stops with one line. Every read is bounded: http(s):// and s3:// connections and reads that wait longer than
`stall_timeout_s(fetch_retry_s)` (1 to 15 s; `OPEN_STALL_S` at open) for the store fail and are retried like any
transient error; an http(s) shard is one GET (`_open_object`), so a stalled http store stops the run after about
`fetch_retry_s` (s3's client retries a timed-out request itself first; other protocols keep their backend's own
timeouts). A shard that is missing at the store (HTTP 404), or whose bytes disagree with the manifest twice in a row,
is one line at once. An outage or a bad shard seen by the prefetch thread crashes nothing and prints nothing:
`shard_path` retries when it needs the shard, and stops the prefetch thread before it reports.

A published dataset (`data.publish`) stores its files by content (`manifest.object_name`); one copied flat
(`train-00000.bin` beside `manifest.json`) reads as well.

The cache (`ShardCache`) is bounded by `cache_limit_bytes` and shared by every process on the node: one of them
downloads a shard while the others wait for it. Shards this process uses are pinned against eviction: the one
`shard_path` returned last, and those of the current prefetch window; when a `shard_path` download finds no room,
this process's own pins are dropped: first the shard returned last (it is memory-mapped already), then, if that is
not enough, the window's (prefetch pauses until the download is done, then fetches them again). A cache smaller than
`require_cache_room` asks for is refused with one line. s3 credentials and endpoint come from `storage_options` or
the environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT_URL`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.data.fetch_retry import FetchStopped, Retrier, describe_error, http_status, stall_timeout_s
from gaudi3_scale.data.manifest import MANIFEST_FILE, Manifest, Shard, load_manifest, object_name
from gaudi3_scale.data.shard_cache import ShardCache, local_name
from gaudi3_scale.data.sources import default_cache_dir
from gaudi3_scale.storage import copy_stream, open_remote, url_protocol

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

__all__ = ["RemoteDataset", "default_remote_cache_dir", "is_url", "prefetch_room", "require_cache_room"]

log = logging.getLogger(__name__)
OPEN_RETRY_S = 1.5  # at open, a few quick retries only: a wrong URL must fail fast
OPEN_STALL_S = 5.0  # at open, the longest wait for a connection or the next bytes (s3fs's connect timeout)
SHARDS_DIR = "shards"
_FETCH_BUDGET = "data.fetch_retry_s"
_REUPLOAD = "upload the directory `gaudi3 prepare` wrote again"


def is_url(spec: str) -> bool:
    """Whether `spec` names a dataset through an fsspec protocol (`s3://…`, `file://…`); a plain path does not."""
    return url_protocol(spec) is not None


def default_remote_cache_dir(url: str) -> Path:
    return default_cache_dir() / "shards" / hashlib.sha256(url.encode()).hexdigest()[:16]


class RemoteDataset:
    """A prepared dataset at `url` and its local shard cache; see the module docstring. Use `open`."""

    def __init__(
        self,
        *,
        url: str,
        fs: AbstractFileSystem,
        root: str,
        directory: Path,
        manifest: Manifest,
        cache: ShardCache,
        prefetch_shards: int,
        fetch_retry_s: float,
    ) -> None:
        self.url, self.directory, self.manifest = url, directory, manifest
        self._fs, self._root, self._cache = fs, root, cache
        self._prefetch_shards, self._fetch_retry_s = prefetch_shards, fetch_retry_s
        self._retrier = Retrier()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._window: list[Shard] = []
        self._window_pins: dict[str, int] = {}  # local name -> fd holding the pin
        self._last_pin: int | None = None  # the shard shard_path returned last
        self._skipped: set[str] = set()  # failed prefetches, not tried again until the window changes
        self._paused = 0  # shard_path calls that took the window's room: prefetch waits for them
        self._stats = {"bytes_fetched": 0, "shards_fetched": 0, "cache_hits": 0, "fetch_wait_s": 0.0}
        self._thread: threading.Thread | None = None
        os.register_at_fork(after_in_child=functools.partial(_after_fork, weakref.ref(self)))
        if prefetch_shards > 0:
            self._thread = threading.Thread(target=self._prefetch_loop, name="data-prefetch", daemon=True)
            self._thread.start()

    @classmethod
    def open(
        cls,
        url: str,
        *,
        cache_dir: str | os.PathLike[str] | None,
        cache_limit_bytes: int,
        prefetch_shards: int,
        fetch_retry_s: float,
        storage_options: dict[str, Any] | None = None,
        field: str = "data.prepared_dir",
    ) -> RemoteDataset:
        """Fetch and check the manifest and tokenizer (one `UserInputError` line, within a few seconds, when `url`
        is unreachable or not a prepared dataset); shards come later, on demand. `cache_dir` None: a directory
        under the gaudi3-scale cache keyed by the URL."""
        head, sep, rest = url.partition("://")
        url = head + sep + rest.rstrip("/")  # `s3://` stays a URL without a bucket, not `s3:`
        fs_open, root = open_remote(url, _bounded(url, storage_options, OPEN_STALL_S), field=field)
        directory = Path(cache_dir) if cache_dir is not None else default_remote_cache_dir(url)
        _make_cache_dir(directory, given=cache_dir is not None)
        _download_small(
            fs_open, url, root, MANIFEST_FILE, directory, what="not a prepared dataset (no manifest.json)"
        )
        try:
            manifest = load_manifest(directory)
        except UserInputError as e:  # name the URL, not our local copy
            local = str(directory / MANIFEST_FILE)
            message = str(e).replace(local, f"{url}/{MANIFEST_FILE}").replace(str(directory), url)
            raise UserInputError(message) from None
        require_cache_room(url, manifest, cache_limit_bytes, shards=1, what="its largest shard")
        tokenizer = object_name(manifest, manifest.tokenizer_file, manifest.tokenizer_sha256 or "")
        _download_small(fs_open, url, root, tokenizer, directory, what="tokenizer missing",
                        local_name=manifest.tokenizer_file, sha256=manifest.tokenizer_sha256)  # fmt: skip
        fs, _ = open_remote(url, _bounded(url, storage_options, stall_timeout_s(fetch_retry_s)), field=field)
        cache = ShardCache(directory / SHARDS_DIR, cache_limit_bytes)
        return cls(
            url=url, fs=fs, root=root, directory=directory, manifest=manifest, cache=cache,
            prefetch_shards=min(prefetch_shards, prefetch_room(manifest, cache_limit_bytes)),
            fetch_retry_s=fetch_retry_s,
        )  # fmt: skip

    # ---- reading ----
    def shard_path(self, shard: Shard) -> Path:
        """The local path of `shard`, downloaded and verified first if absent (blocking). It stays pinned (never
        evicted) until the next call, unless that call needs its room; open or memory-map it before then: an open
        file stays readable after an eviction (see ShardCache). One thread of a process should call it: the pin
        of "the shard returned last" is per process."""
        start_s = time.monotonic()
        with self._cond:
            if self._stop.is_set():
                raise RuntimeError(f"{self.url}: RemoteDataset is closed")
        fd = self._cache.pin_if_present(shard)
        hit = fd is not None
        took_room = False
        if fd is None:

            def make_room() -> bool:
                """This process's pins, the cheapest first: the shard returned last (it is memory-mapped already:
                see ShardCache), then the prefetch window's (whose shards would have to be fetched again)."""
                nonlocal took_room
                if self._release_last_pin():
                    return True
                if took_room:
                    return False
                self._release_pins(pause=True, last=True)
                took_room = True
                return True

            try:
                fd = self._cache.acquire(
                    shard,
                    self._downloader(shard),
                    space_wait_s=self._fetch_retry_s,
                    make_room=make_room,
                )
            except UserInputError:
                self._stop_prefetching()  # the run stops on this line: nothing may print after it
                raise
            finally:
                if took_room:
                    with self._cond:
                        self._paused -= 1
                        self._cond.notify_all()
            if fd is None:
                gib = self._cache.limit_bytes / 2**30
                raise UserInputError(
                    f"{self.url}/{shard.file}: the shard cache (data.cache_limit_gib={gib:g}) stayed full of "
                    f"shards in use for {self._fetch_retry_s:g} s; raise data.cache_limit_gib"
                )
        with self._cond:
            previous, self._last_pin = self._last_pin, fd
            self._stats["cache_hits"] += hit
            self._stats["fetch_wait_s"] += time.monotonic() - start_s
            self._skipped.clear()  # room may have been freed: failed prefetches are worth another try
            self._cond.notify_all()
        if previous is not None:
            self._cache.unpin(previous)
        return self._cache.path(shard)

    def prefetch(self, shards: Sequence[Shard]) -> None:
        """Hint the shards needed next, in order (returns at once): the first `prefetch_shards` distinct ones are
        fetched in the background and pinned; shards that leave the window are unpinned. With `prefetch_shards`
        0 there is no background thread and nothing is fetched ahead."""
        window: dict[str, Shard] = {}
        for shard in shards:
            if len(window) >= self._prefetch_shards:
                break
            window.setdefault(local_name(shard), shard)
        with self._cond:
            if list(window.values()) == self._window:
                # The loader hints every step, and the window moves only at block boundaries: waking the prefetch
                # thread for the same window made it retry its skipped shards (a cache scan each) every step.
                return
            self._window = list(window.values())
            self._skipped.clear()
            stale = [k for k in self._window_pins if k not in window]
            fds = [self._window_pins.pop(k) for k in stale]
            self._cond.notify_all()
        for fd in fds:
            self._cache.unpin(fd)

    def stats(self) -> dict[str, float]:
        """Counters since open: bytes_fetched, shards_fetched, cache_hits, fetch_wait_s (time shard_path blocked),
        retries (failed storage reads tried again) and evictions (by this process)."""
        with self._cond:
            stats: dict[str, float] = dict(self._stats)
        return {**stats, "retries": self._retrier.retries, "evictions": self._cache.evictions}

    def close(self) -> None:
        """Stop the prefetch thread (a download in flight is abandoned) and drop every pin."""
        with self._cond:
            self._stop.set()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._release_pins(pause=False, last=True)

    def __enter__(self) -> RemoteDataset:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ---- internals ----
    def _stop_prefetching(self) -> None:
        with self._cond:
            self._stop.set()
            self._cond.notify_all()

    def _release_last_pin(self) -> bool:
        """Unpin the shard `shard_path` returned last; False when there was none."""
        with self._cond:
            fd, self._last_pin = self._last_pin, None
        if fd is None:
            return False
        self._cache.unpin(fd)
        return True

    def _release_pins(self, *, pause: bool, last: bool) -> None:
        """Unpin the prefetch window's shards (and the last returned one when `last`); `pause` holds prefetching
        back until the caller's `shard_path` is done."""
        with self._cond:
            fds = list(self._window_pins.values())
            self._window_pins.clear()
            if last and self._last_pin is not None:
                fds.append(self._last_pin)
                self._last_pin = None
            if pause:
                self._paused += 1
        for fd in fds:
            self._cache.unpin(fd)

    def _after_fork_in_child(self) -> None:
        """A forked child (a DataLoader worker) shares the parent's lock files' open descriptions: keeping them
        would keep the parent's pins alive as long as the child lives. Forget them (the cache closes the child's
        copies), renew the locks a parent thread may have held at the fork, and go without the prefetch thread
        (which does not exist in the child)."""
        self._window_pins, self._last_pin, self._window = {}, None, []
        self._cond, self._thread, self._paused = threading.Condition(), None, 0
        stopped, self._stop = self._stop.is_set(), threading.Event()
        if stopped:
            self._stop.set()
        self._retrier = Retrier()
        self._cache.after_fork_in_child()

    def _prefetch_loop(self) -> None:
        while True:
            with self._cond:
                shard = self._next_prefetch()
                while shard is None and not self._stop.is_set():
                    if not self._cond.wait(timeout=1.0):  # other processes free room without telling us
                        self._skipped.clear()
                    shard = self._next_prefetch()
                if self._stop.is_set():
                    return
            assert shard is not None
            key = local_name(shard)
            try:
                fd = self._cache.acquire(shard, self._downloader(shard), space_wait_s=0.0)
            except FetchStopped:
                return
            except Exception as e:  # a hint only: shard_path fetches it again, and reports, when it is needed
                log.debug("prefetch of %s/%s failed: %s", self.url, shard.file, e)
                fd = None
            with self._cond:
                keep = fd is not None and key not in self._window_pins and shard in self._window
                keep = keep and not self._stop.is_set() and self._paused == 0
                if keep:
                    assert fd is not None
                    self._window_pins[key] = fd
                    fd = None
                elif fd is None:
                    self._skipped.add(key)
            if fd is not None:
                self._cache.unpin(fd)

    def _next_prefetch(self) -> Shard | None:
        if self._paused:
            return None
        for shard in self._window:
            key = local_name(shard)
            if key not in self._window_pins and key not in self._skipped:
                return shard
        return None

    def _downloader(self, shard: Shard) -> Callable[[Path], None]:
        return lambda part: self._download(shard, part)

    def _object(self, shard: Shard) -> str:
        """Where `shard` is stored, relative to the dataset's root."""
        return object_name(self.manifest, shard.file, shard.sha256)

    def _download(self, shard: Shard, part: Path) -> None:
        """Write `shard` into `part` (reserved at full size) and check it; a mismatch is downloaded once more,
        in case it was a damaged transfer, then reported."""
        url = f"{self.url}/{self._object(shard)}"
        for attempt in (1, 2):
            try:
                size_bytes, sha256 = self._retrier.call(
                    url, lambda: self._copy(shard, part), budget_s=self._fetch_retry_s, budget_name=_FETCH_BUDGET,
                    stop=self._stop,
                )  # fmt: skip
            except (UserInputError, FetchStopped):
                raise
            except Exception as e:
                # permanent: a status, or fsspec http's FileNotFoundError (for a failed HEAD, whatever the status)
                if isinstance(e, FileNotFoundError) or http_status(e) is not None:
                    raise _not_found(url, e, f"listed in {MANIFEST_FILE}") from None
                raise UserInputError(f"{url}: cannot be read ({describe_error(e)})") from e
            if size_bytes == shard.size_bytes and sha256 == shard.sha256:
                with self._cond:
                    self._stats["shards_fetched"] += 1
                return
            # debug only: the error line says "corrupt, twice", and a prefetch's mismatch is a hint
            log.debug("%s: does not match %s (attempt %d of 2)", url, MANIFEST_FILE, attempt)
        got = f"SHA-256 {sha256[:12]}…" if sha256 else "not read"
        raise UserInputError(
            f"{url}: corrupt, twice: {size_bytes} bytes, {got}; {MANIFEST_FILE} says {shard.size_bytes} bytes, "
            f"SHA-256 {shard.sha256[:12]}…; {_REUPLOAD}"
        )

    def _copy(self, shard: Shard, part: Path) -> tuple[int, str]:
        """(size, SHA-256) of what the store returned, written into `part`; SHA-256 "" when the object's size
        alone disagrees (listed by the store, or more bytes arrived than the manifest lists)."""
        read_bytes = 0

        def on_chunk(num_bytes: int) -> None:
            nonlocal read_bytes
            read_bytes += num_bytes
            self._retrier.heard_from_store()
            with self._cond:
                self._stats["bytes_fetched"] += num_bytes
            if self._stop.is_set():
                raise FetchStopped(shard.file)
            if read_bytes > shard.size_bytes:  # never write past the room reserved for it
                raise _TooLong

        with self._open_object(shard) as src, part.open("r+b") as dst:
            listed_bytes = getattr(src, "size", None)  # fsspec's buffered files know it from the listing
            if isinstance(listed_bytes, int) and listed_bytes != shard.size_bytes:
                return listed_bytes, ""
            try:
                result = copy_stream(src, dst, on_chunk)
            except _TooLong:
                return read_bytes, ""
            dst.truncate()
            dst.flush()
            os.fsync(dst.fileno())  # the file is trusted by its size once renamed: its bytes must be on disk
        return result

    def _open_object(self, shard: Shard) -> Any:
        """`shard`'s object, open for reading. fsspec's http `open` asks the server for the size first (a HEAD)
        unless given one, and a stalled store made each attempt wait twice the stall bound, HEAD then GET: the
        manifest knows the size, and `block_size=0` streams the body of one GET (the size only skips the HEAD)."""
        path = f"{self._root}/{self._object(shard)}"
        if url_protocol(self.url) in ("http", "https"):
            return self._fs.open(path, "rb", block_size=0, size=max(1, shard.size_bytes))
        return self._fs.open(path, "rb")


class _TooLong(Exception):
    """More bytes arrived than the manifest lists."""


def _after_fork(dataset: weakref.ref[RemoteDataset]) -> None:
    if (alive := dataset()) is not None:
        alive._after_fork_in_child()


def _not_found(url: str, error: Exception, listed: str) -> UserInputError:
    """A permanent `FileNotFoundError` or HTTP status: missing (404, 410, or no status), else what the store
    answered."""
    status = http_status(error)
    if status is None or status in (404, 410):
        return UserInputError(f"{url}: missing at the store ({listed}); {_REUPLOAD}")
    return UserInputError(f"{url}: cannot be read (HTTP {status}); check the URL and its access rights")


def _bounded(url: str, options: dict[str, Any] | None, stall_s: float) -> dict[str, Any]:
    """`options` with the stall bound as the backend's connect and read timeouts, where it takes them and the
    caller set none: aiohttp's `ClientTimeout` (fsspec's http `client_kwargs`, whose default waits 300 s for a
    whole response; sock_read bounds the wait for each next bytes, not the transfer) and botocore's
    `connect_timeout` / `read_timeout` (s3fs's `config_kwargs`)."""
    options = dict(options or {})
    protocol = url_protocol(url)
    if protocol in ("http", "https"):
        try:
            import aiohttp
        except ImportError:  # open_remote names what to install
            return options
        client = dict(options.get("client_kwargs") or {})
        client.setdefault(
            "timeout", aiohttp.ClientTimeout(total=None, sock_connect=stall_s, sock_read=stall_s)
        )
        options["client_kwargs"] = client
    elif protocol in ("s3", "s3a"):
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("connect_timeout", stall_s)
        config.setdefault("read_timeout", stall_s)
        options["config_kwargs"] = config
    return options


def _make_cache_dir(directory: Path, *, given: bool) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = next(
            (p for p in [directory, *directory.parents] if p.exists() and not p.is_dir()), directory
        )
        where = "data.cache_dir" if given else "the gaudi3-scale cache directory"
        raise UserInputError(
            f"{where}: {blocker} is a file; allowed: a directory (created if missing)"
        ) from None
    except PermissionError as e:
        where = "data.cache_dir" if given else "the gaudi3-scale cache directory (XDG_CACHE_HOME)"
        raise UserInputError(
            f"{where}: cannot create {directory}: {e.strerror}; use a writable directory"
        ) from None


def _largest(manifest: Manifest) -> Shard:
    return max(manifest.shards, key=lambda s: s.size_bytes)


def require_cache_room(
    url: str, manifest: Manifest, cache_limit_bytes: int, *, shards: int, what: str
) -> None:
    """One `UserInputError` line naming data.cache_limit_gib and its minimum when the cache cannot hold `shards` of
    the dataset's largest shards at once (`what` says what needs them)."""
    largest = _largest(manifest)
    need_bytes = shards * largest.size_bytes
    if need_bytes > cache_limit_bytes:
        times = f"{shards} × " if shards > 1 else ""
        raise UserInputError(
            f"data.cache_limit_gib={cache_limit_bytes / 2**30:g} is too small for {url}: {what} takes "
            f"{need_bytes:,} bytes ({times}{largest.file}); the minimum is data.cache_limit_gib="
            f"{_gib_at_least(need_bytes)}"
        )


def prefetch_room(manifest: Manifest, cache_limit_bytes: int) -> int:
    """The most shards worth fetching ahead: what the cache holds of the largest shard, less one kept free for a
    shard `shard_path` needs outside the window (a val shard, or the one in use past a block boundary). A window
    that used that room too would be evicted by each such read and fetched again by the prefetch thread, over and
    over. At least 1: with room for one shard only, prefetching still helps between reads."""
    return max(1, cache_limit_bytes // max(1, _largest(manifest).size_bytes) - 1)


def _gib_at_least(num_bytes: int) -> str:
    """`num_bytes` in GiB, rounded up at 3 significant digits: a limit set to it holds `num_bytes`."""
    gib = num_bytes / 2**30
    scale = 10.0 ** (2 - math.floor(math.log10(gib)))
    return f"{math.ceil(gib * scale) / scale:g}"


def _download_small(
    fs: AbstractFileSystem,
    url: str,
    root: str,
    name: str,
    directory: Path,
    *,
    what: str,
    local_name: str | None = None,
    sha256: str | None = None,
) -> None:
    """Fetch `root/name` into `directory/local_name` (default `name`; atomic replace), retrying a few seconds at
    most; its SHA-256 checked when given."""
    source = f"{url}/{name}"
    try:
        data = Retrier(quiet=True).call(
            source, lambda: fs.cat_file(f"{root}/{name}"), budget_s=OPEN_RETRY_S, budget_name="at open"
        )
    except FileNotFoundError as e:
        if http_status(e) not in (None, 404, 410):
            raise _not_found(source, e, "") from None
        raise UserInputError(f"{url}: {what}; {_REUPLOAD}, or check the URL") from None
    except UserInputError:
        raise
    except Exception as e:  # credentials, a bad request: the line names the URL and the error
        raise UserInputError(f"{source}: cannot be read ({describe_error(e)})") from e
    if sha256 is not None and (got := hashlib.sha256(data).hexdigest()) != sha256:
        raise UserInputError(
            f"{source}: SHA-256 {got[:12]}… is not the {sha256[:12]}… {MANIFEST_FILE} lists; {_REUPLOAD}"
        )
    target = directory / (local_name or name)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}-{threading.get_ident()}")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, target)
