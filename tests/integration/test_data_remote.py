"""A prepared dataset read from object storage: a real S3 server (moto, over HTTP on 127.0.0.1), file:// and memory://.

On-demand fetch with verification; the bounded cache evicting the least recently used shard; two processes sharing
one download; a corrupted or missing object and an unreachable URL as one line; an outage the fetch retries through
(server stopped, then started again on the same port) without touching the global RNG; a retry budget running out.

The prepared corpus fits one shard per split (train-00000.bin, val-00000.bin): the eviction tests use those two.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import random
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.data import DataConfig, load_manifest, prepare_dataset
from gaudi3_scale.data.manifest import Manifest, Shard
from gaudi3_scale.data.remote import RemoteDataset, is_url
from gaudi3_scale.data.sources import bundled_corpora
from gaudi3_scale.storage import open_remote
from s3_server import S3Server, free_port, running_s3_server, s3_options

pytestmark = pytest.mark.integration

BUCKET = "data"
LIMIT_BYTES = 1 << 30


@pytest.fixture(scope="module")
def s3() -> Iterator[tuple[S3Server, dict[str, Any]]]:
    with running_s3_server(BUCKET) as server_and_options:
        yield server_and_options


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~200 KB of train tokens (uint16 char ids) and ~22 KB of val."""
    root = tmp_path_factory.mktemp("prepared")
    text = root / "corpus.txt"
    text.write_text(bundled_corpora()["tinyshakespeare"].read_text(encoding="utf-8")[:120_000])
    return prepare_dataset(DataConfig(source=str(text), tokenizer="char"), root / "out", progress=False)


def _upload(prepared: Path, url: str, options: dict[str, Any] | None = None) -> None:
    fs, root = open_remote(url, options, field="test")
    manifest = load_manifest(prepared)
    if url.startswith("file://"):
        fs.makedirs(root, exist_ok=True)
    for name in ["manifest.json", manifest.tokenizer_file, *(s.file for s in manifest.shards)]:
        fs.put_file(str(prepared / name), f"{root}/{name}")


def _s3_dataset(prepared: Path, options: dict[str, Any]) -> str:
    url = f"s3://{BUCKET}/ds-{uuid.uuid4().hex[:8]}"
    _upload(prepared, url, options)
    return url


def _open(url: str, cache: Path, options: dict[str, Any] | None = None, **kw: Any) -> RemoteDataset:
    settings: dict[str, Any] = {"cache_limit_bytes": LIMIT_BYTES, "prefetch_shards": 0, "fetch_retry_s": 10.0}
    return RemoteDataset.open(url, cache_dir=cache, storage_options=options, **{**settings, **kw})


def _gets(server: S3Server, url: str, shard: Shard) -> int:
    path = "/" + url.removeprefix("s3://") + "/" + shard.file
    return sum(1 for method, p in server.requests if method == "GET" and p == path)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _cached_bytes(dataset: RemoteDataset) -> int:
    return sum(
        p.stat().st_size for p in (dataset.directory / "shards").iterdir() if not p.name.endswith(".lock")
    )


def test_fetch_on_demand_verified_then_cached(
    s3: tuple[S3Server, dict[str, Any]], prepared: Path, tmp_path: Path
) -> None:
    server, options = s3
    url = _s3_dataset(prepared, options)
    with _open(url, tmp_path / "cache", options) as dataset:
        assert dataset.url == url and dataset.manifest == load_manifest(prepared)
        assert (dataset.directory / dataset.manifest.tokenizer_file).read_bytes() == (
            prepared / dataset.manifest.tokenizer_file
        ).read_bytes()
        assert not list((dataset.directory / "shards").glob("*.bin"))  # nothing fetched at open
        train = dataset.manifest.shards_of("train")[0]
        path = dataset.shard_path(train)
        assert path.read_bytes() == (prepared / train.file).read_bytes()
        assert _gets(server, url, train) == 1
        assert dataset.shard_path(train) == path  # verified files are trusted by size: no second download
        assert _gets(server, url, train) == 1
        stats = dataset.stats()
        assert (stats["shards_fetched"], stats["cache_hits"], stats["retries"]) == (1, 1, 0)
        assert stats["bytes_fetched"] == train.size_bytes
    # A second open (another run) finds the cached shard.
    with _open(url, tmp_path / "cache", options) as again:
        assert again.shard_path(train) == path and again.stats()["shards_fetched"] == 0


@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_cache_stays_under_its_limit_evicting_least_recently_used(
    scheme: str, prepared: Path, tmp_path: Path
) -> None:
    url = prepared.as_uri() if scheme == "file" else f"memory://ds-{uuid.uuid4().hex[:8]}"
    if scheme == "memory":
        _upload(prepared, url)
    manifest = load_manifest(prepared)
    train, val = manifest.shards_of("train")[0], manifest.shards_of("val")[0]
    limit = train.size_bytes + val.size_bytes - 1  # both never fit together
    with _open(url, tmp_path / "cache", cache_limit_bytes=limit) as dataset:
        for shard in (train, val, train, val):
            assert _sha256(dataset.shard_path(shard)) == shard.sha256
            assert _cached_bytes(dataset) <= limit
        stats = dataset.stats()
        assert (stats["shards_fetched"], stats["evictions"], stats["cache_hits"]) == (4, 3, 0)
    with _open(url, tmp_path / "cache2", cache_limit_bytes=limit) as dataset:
        dataset.shard_path(val)
        dataset.shard_path(val)
        assert dataset.stats()["cache_hits"] == 1


def test_a_shard_larger_than_the_cache_limit_fails_at_open(prepared: Path, tmp_path: Path) -> None:
    with pytest.raises(UserInputError) as info:
        _open(prepared.as_uri(), tmp_path / "cache", cache_limit_bytes=1000)
    message = str(info.value)
    assert (
        message.startswith("data.cache_limit_gib=") and "train-00000.bin" in message and "\n" not in message
    )


def test_prefetch_fetches_ahead_in_the_background(prepared: Path, tmp_path: Path) -> None:
    manifest = load_manifest(prepared)
    train, val = manifest.shards_of("train")[0], manifest.shards_of("val")[0]
    with _open(prepared.as_uri(), tmp_path / "cache", prefetch_shards=2) as dataset:
        dataset.prefetch([train, val, train])
        deadline = time.monotonic() + 10
        while dataset.stats()["shards_fetched"] < 2:
            assert time.monotonic() < deadline, "prefetch did not fetch"
            time.sleep(0.01)
        assert dataset.shard_path(val).read_bytes() == (prepared / val.file).read_bytes()
        assert dataset.shard_path(train).read_bytes() == (prepared / train.file).read_bytes()
        assert dataset.stats()["cache_hits"] == 2
        thread = dataset._thread
    assert thread is not None and not thread.is_alive()  # close() stopped it


def _fetch_in_child(
    url: str, cache: str, options: dict[str, Any], shard: Shard, barrier: Any, out: Any
) -> None:
    with _open(url, Path(cache), options) as dataset:
        barrier.wait(timeout=20)
        path = dataset.shard_path(shard)
        out.put((_sha256(path), dataset.stats()["shards_fetched"]))
        barrier.wait(
            timeout=20
        )  # both keep their pin until both have the shard: a pin must not block the other


def test_two_processes_share_one_download(
    s3: tuple[S3Server, dict[str, Any]], prepared: Path, tmp_path: Path
) -> None:
    server, options = s3
    url = _s3_dataset(prepared, options)
    train = load_manifest(prepared).shards_of("train")[0]
    context = multiprocessing.get_context("fork")
    barrier, out = context.Barrier(2), context.Queue()
    args = (url, str(tmp_path / "cache"), options, train, barrier, out)
    children = [context.Process(target=_fetch_in_child, args=args) for _ in range(2)]
    for child in children:
        child.start()
    results = [out.get(timeout=30) for _ in children]
    for child in children:
        child.join(timeout=10)
        assert child.exitcode == 0
    assert [digest for digest, _ in results] == [train.sha256] * 2
    assert sorted(fetched for _, fetched in results) == [0, 1]
    assert _gets(server, url, train) == 1


def test_corrupt_object_is_one_line_after_one_retry(
    s3: tuple[S3Server, dict[str, Any]], prepared: Path, tmp_path: Path
) -> None:
    server, options = s3
    url = _s3_dataset(prepared, options)
    train = load_manifest(prepared).shards_of("train")[0]
    fs, root = open_remote(url, options, field="test")
    data = bytearray(fs.cat_file(f"{root}/{train.file}"))
    data[len(data) // 2] ^= 0x01
    fs.pipe_file(f"{root}/{train.file}", bytes(data))
    gets_before = _gets(server, url, train)
    with _open(url, tmp_path / "cache", options) as dataset:
        with pytest.raises(UserInputError) as info:
            dataset.shard_path(train)
        assert (
            _gets(server, url, train) - gets_before == 2
        )  # one retry: the first could be a damaged transfer
        left = [p.name for p in (dataset.directory / "shards").iterdir() if not p.name.endswith(".lock")]
        assert left == []  # neither the .part nor a bad file
    message = str(info.value)
    assert message.startswith(f"{url}/{train.file}: corrupt") and train.sha256[:12] in message
    assert hashlib.sha256(data).hexdigest()[:12] in message and "\n" not in message


def test_missing_object_is_one_line(
    s3: tuple[S3Server, dict[str, Any]], prepared: Path, tmp_path: Path
) -> None:
    _, options = s3
    url = _s3_dataset(prepared, options)
    val = load_manifest(prepared).shards_of("val")[0]
    fs, root = open_remote(url, options, field="test")
    fs.rm_file(f"{root}/{val.file}")
    with _open(url, tmp_path / "cache", options, fetch_retry_s=30.0) as dataset:
        start_s = time.monotonic()
        with pytest.raises(UserInputError, match=r"val-00000\.bin: missing at the store") as info:
            dataset.shard_path(val)
        assert time.monotonic() - start_s < 5, "a missing object is not retried"
    assert str(info.value).startswith(f"{url}/{val.file}: ")


def test_unreachable_or_wrong_url_fails_fast_at_open(
    s3: tuple[S3Server, dict[str, Any]], prepared: Path, tmp_path: Path
) -> None:
    _, options = s3
    dead = s3_options(free_port())
    start_s = time.monotonic()
    with pytest.raises(UserInputError) as info:
        _open(f"s3://{BUCKET}/ds", tmp_path / "a", dead)
    assert time.monotonic() - start_s < 5
    assert str(info.value).startswith(f"s3://{BUCKET}/ds/manifest.json: unreachable")

    empty = f"s3://{BUCKET}/nothing-{uuid.uuid4().hex[:8]}"
    with pytest.raises(UserInputError, match="not a prepared dataset") as info:
        _open(empty, tmp_path / "b", options)
    assert str(info.value).startswith(empty)
    with pytest.raises(ConfigError, match=r"^data\.source: unknown protocol 'nosuch'"):
        RemoteDataset.open(
            "nosuch://x", cache_dir=tmp_path, cache_limit_bytes=1, prefetch_shards=0, fetch_retry_s=1,
            field="data.source",
        )  # fmt: skip
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "manifest.json").write_text("[1]")
    with pytest.raises(UserInputError, match="expected a JSON object") as info:
        _open((tmp_path / "junk").as_uri(), tmp_path / "c")
    assert str(info.value).startswith((tmp_path / "junk").as_uri() + "/manifest.json")


def test_outage_is_retried_through_and_leaves_the_global_rng_alone(
    s3: tuple[S3Server, dict[str, Any]], prepared: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server, options = s3
    url = _s3_dataset(prepared, options)
    train = load_manifest(prepared).shards_of("train")[0]
    python_rng = random.getstate()
    result: list[Any] = []
    with _open(url, tmp_path / "cache", options, fetch_retry_s=30.0) as dataset:
        server.stop()
        try:
            with caplog.at_level(logging.WARNING, logger="gaudi3_scale.data.fetch_retry"):
                thread = threading.Thread(target=lambda: result.append(dataset.shard_path(train)))
                thread.start()
                time.sleep(2.0)
                assert not result, "returned while the server was down"
                server.start()
                thread.join(timeout=20)
        finally:
            if not server.running:
                server.start()
        assert result and _sha256(result[0]) == train.sha256
        assert dataset.stats()["retries"] >= 1
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings  # once per outage, not per retry; then the recovery
    assert url in warnings[0] and "retrying" in warnings[0] and "reachable again" in warnings[1]
    assert random.getstate() == python_rng, "the backoff jitter drew from the global random"


def test_retry_budget_exhausted_is_one_line(
    s3: tuple[S3Server, dict[str, Any]], prepared: Path, tmp_path: Path
) -> None:
    server, options = s3
    url = _s3_dataset(prepared, options)
    val = load_manifest(prepared).shards_of("val")[0]
    with _open(url, tmp_path / "cache", options, fetch_retry_s=1.0) as dataset:
        server.stop()
        try:
            with pytest.raises(UserInputError) as info:
                dataset.shard_path(val)
        finally:
            server.start()
    message = str(info.value)
    assert (
        message.startswith(f"{url}/{val.file}: unreachable, retried for ")
        and "data.fetch_retry_s=1" in message
    )


def test_is_url() -> None:
    assert all(is_url(u) for u in ("s3://b/p", "gs://b", "file:///tmp/x", "memory://x", "S3://b"))
    assert not any(
        is_url(p) for p in ("/data/prepared", "data/x", "relative", "C:\\data", "hf:name", "synthetic:5")
    )


def test_manifest_type_is_the_local_one(prepared: Path, tmp_path: Path) -> None:
    with _open(prepared.as_uri(), tmp_path / "cache") as dataset:
        assert isinstance(dataset.manifest, Manifest)
        assert load_manifest(dataset.directory) == dataset.manifest


def test_prefetch_through_an_outage_crashes_nothing_and_close_returns(
    s3: tuple[S3Server, dict[str, Any]], prepared: Path, tmp_path: Path
) -> None:
    server, options = s3
    url = _s3_dataset(prepared, options)
    manifest = load_manifest(prepared)
    train, val = manifest.shards_of("train")[0], manifest.shards_of("val")[0]
    dataset = _open(url, tmp_path / "cache", options, prefetch_shards=2, fetch_retry_s=30.0)
    server.stop()
    try:
        dataset.prefetch([train, val])
        deadline = time.monotonic() + 10
        while dataset.stats()["retries"] < 1:
            assert time.monotonic() < deadline, "the prefetch thread did not try"
            time.sleep(0.01)
        server.start()
        assert _sha256(dataset.shard_path(val)) == val.sha256
        assert _sha256(dataset.shard_path(train)) == train.sha256
        server.stop()
        dataset.prefetch([val])  # present: no fetch, so no retry while the server is down
        start_s = time.monotonic()
        dataset.close()
        assert time.monotonic() - start_s < 2, "close() waited for the retries"
    finally:
        if not server.running:
            server.start()
        dataset.close()
    assert dataset.stats()["shards_fetched"] == 2


def test_a_shard_another_process_uses_is_not_evicted(prepared: Path, tmp_path: Path) -> None:
    """Two instances on one cache directory behave as two processes (flock locks belong to open files)."""
    manifest = load_manifest(prepared)
    train, val = manifest.shards_of("train")[0], manifest.shards_of("val")[0]
    limit = max(train.size_bytes, val.size_bytes)  # room for one shard
    cache = tmp_path / "cache"
    holder = _open(prepared.as_uri(), cache, cache_limit_bytes=limit)
    other = _open(prepared.as_uri(), cache, cache_limit_bytes=limit, fetch_retry_s=0.3)
    with holder, other:
        path = holder.shard_path(train)  # pinned while holder uses it
        with pytest.raises(
            UserInputError, match=r"val-00000\.bin: the shard cache \(data\.cache_limit_gib=.*stayed full"
        ):
            other.shard_path(val)
        assert _sha256(path) == train.sha256
        assert (
            other.shard_path(train) == path and other.stats()["cache_hits"] == 1
        )  # shared, not fetched again
        holder.close()
        other.shard_path(val)  # now train may go: other's own pin on it is dropped to make room
        assert not path.exists() and other.stats()["evictions"] == 1


def test_a_forked_child_does_not_keep_the_parents_pins(prepared: Path, tmp_path: Path) -> None:
    """DataLoader workers are forked: the pins' lock files must not stay locked through the child's copies."""
    manifest = load_manifest(prepared)
    train, val = manifest.shards_of("train")[0], manifest.shards_of("val")[0]
    limit, cache = max(train.size_bytes, val.size_bytes), tmp_path / "cache"
    holder = _open(prepared.as_uri(), cache, cache_limit_bytes=limit, prefetch_shards=1)
    holder.prefetch([train])
    holder.shard_path(train)
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(10,))
    child.start()
    try:
        holder.close()
        with _open(prepared.as_uri(), cache, cache_limit_bytes=limit, fetch_retry_s=0.3) as other:
            assert _sha256(other.shard_path(val)) == val.sha256  # train was evicted: nobody pins it any more
    finally:
        child.terminate()
        child.join()


@pytest.mark.parametrize("change", ["truncated", "longer"])
def test_object_of_the_wrong_size_is_one_line(change: str, prepared: Path, tmp_path: Path) -> None:
    """fsspec's files know the object's size from the listing: a wrong one is refused before any byte is read."""
    url = f"memory://ds-{uuid.uuid4().hex[:8]}" if change == "truncated" else (tmp_path / "store").as_uri()
    _upload(prepared, url)
    val = load_manifest(prepared).shards_of("val")[0]
    fs, root = open_remote(url, None, field="test")
    data = fs.cat_file(f"{root}/{val.file}")
    fs.pipe_file(f"{root}/{val.file}", data[:-2] if change == "truncated" else data + b"\0" * (3 << 20))
    with _open(url, tmp_path / "cache") as dataset, pytest.raises(UserInputError) as info:
        dataset.shard_path(val)
    expected_bytes = val.size_bytes - 2 if change == "truncated" else val.size_bytes + (3 << 20)
    assert str(info.value).startswith(f"{url}/{val.file}: corrupt, twice: ")
    assert f"{val.size_bytes} bytes, SHA-256 {val.sha256[:12]}" in str(info.value)
    assert f"corrupt, twice: {expected_bytes} bytes, not read;" in str(info.value)
    assert list((tmp_path / "cache" / "shards").glob("*.part")) == []


def test_missing_backend_names_the_package_and_the_field(tmp_path: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed here")
    with pytest.raises(ConfigError, match=r"^data\.prepared_dir: 'gs://bucket/ds' needs .*gcsfs"):
        _open("gs://bucket/ds", tmp_path)


def test_shard_path_takes_the_room_of_its_own_prefetch_window(prepared: Path, tmp_path: Path) -> None:
    manifest = load_manifest(prepared)
    train, val = manifest.shards_of("train")[0], manifest.shards_of("val")[0]
    limit = max(train.size_bytes, val.size_bytes)  # room for one shard
    with _open(prepared.as_uri(), tmp_path / "cache", cache_limit_bytes=limit, prefetch_shards=1) as dataset:
        dataset.prefetch([val])
        deadline = time.monotonic() + 10
        while dataset.stats()["shards_fetched"] < 1:
            assert time.monotonic() < deadline, "prefetch did not fetch"
            time.sleep(0.01)
        start_s = time.monotonic()
        assert _sha256(dataset.shard_path(train)) == train.sha256  # not in the window: val's pin gives way
        assert time.monotonic() - start_s < 2, "waited for room its own prefetch held"
        assert dataset.stats()["evictions"] == 1 and _cached_bytes(dataset) <= limit
