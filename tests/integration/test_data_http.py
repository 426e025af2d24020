"""A prepared dataset read over plain http:// from a misbehaving store (`http_store`, on 127.0.0.1), and the checks a
URL dataset gets at open (file://): transient 5xx and 429 retried and told apart from a missing (404) or refused
(403) file, stalled reads bounded by the retry budget, a corrupt shard as one line with nothing printed around it, the
manifest's shard entries and vocabulary checked as for a local directory, and a publish that fails part-way leaving
the dataset already at the URL whole.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gaudi3_scale.config.errors import ConfigError, UserInputError
from gaudi3_scale.data import DataConfig, load_manifest, prepare_dataset
from gaudi3_scale.data.fetch_retry import Retrier
from gaudi3_scale.data.inputs import open_training_data
from gaudi3_scale.data.publish import publish_prepared
from gaudi3_scale.data.remote import OPEN_STALL_S, RemoteDataset
from gaudi3_scale.data.sources import bundled_corpora
from http_store import HttpStore, running_http_store

pytestmark = pytest.mark.integration
pytest.importorskip("aiohttp", reason="http:// needs fsspec's http backend (aiohttp)")

LIMIT_BYTES = 1 << 30


def _prepare(root: Path, start: int, num_chars: int) -> Path:
    text = root / f"corpus-{start}.txt"
    text.write_text(
        bundled_corpora()["tinyshakespeare"].read_text(encoding="utf-8")[start : start + num_chars]
    )
    cfg = DataConfig(source=str(text), tokenizer="byte", shard_mb=0.004)
    return prepare_dataset(cfg, root / f"out-{start}", progress=False)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~20 kB of bytes: 5 train + 5 val shards of ~4 kB."""
    return _prepare(tmp_path_factory.mktemp("prepared"), 0, 20_000)


@pytest.fixture
def store(prepared: Path, tmp_path: Path) -> Iterator[HttpStore]:
    shutil.copytree(prepared, tmp_path / "www" / "ds")
    with running_http_store(tmp_path / "www") as server:
        yield server


def _open(url: str, cache: Path, **kw: Any) -> RemoteDataset:
    settings: dict[str, Any] = {"cache_limit_bytes": LIMIT_BYTES, "prefetch_shards": 0, "fetch_retry_s": 10.0}
    return RemoteDataset.open(url, cache_dir=cache, **{**settings, **kw})


def _gets(store: HttpStore, name: str) -> int:
    return sum(1 for method, path in store.requests if method == "GET" and path.endswith(name))


def test_a_5xx_on_a_shard_is_retried_then_served(store: HttpStore, prepared: Path, tmp_path: Path) -> None:
    train = load_manifest(prepared).shards_of("train")[1]
    store.behave(train.file, "status:503", times=2)
    with _open(f"{store.url}/ds", tmp_path / "cache") as dataset:
        path = dataset.shard_path(train)
        assert path.read_bytes() == (prepared / train.file).read_bytes()
        assert dataset.stats()["retries"] >= 1


def test_a_lasting_5xx_is_unreachable_and_a_404_is_missing(
    store: HttpStore, prepared: Path, tmp_path: Path
) -> None:
    train, val = load_manifest(prepared).shards_of("train")[0], load_manifest(prepared).shards_of("val")[0]
    store.behave(train.file, "status:500")
    store.behave(val.file, "status:404")
    url = f"{store.url}/ds"
    with _open(url, tmp_path / "a", fetch_retry_s=1.0) as dataset, pytest.raises(UserInputError) as info:
        dataset.shard_path(train)
    message = str(info.value)
    assert message.startswith(f"{url}/{train.file}: unreachable, retried for ") and "HTTP 500" in message, (
        message
    )
    assert _gets(store, train.file) >= 2  # retried, not "missing" at the first answer
    with _open(url, tmp_path / "b", fetch_retry_s=30.0) as dataset, pytest.raises(UserInputError) as info:
        start_s = time.monotonic()
        dataset.shard_path(val)
    assert time.monotonic() - start_s < 5, "a 404 is not retried"
    assert str(info.value).startswith(f"{url}/{val.file}: missing at the store")


def test_a_403_is_refused_at_once_and_a_429_burst_is_retried(
    store: HttpStore, prepared: Path, tmp_path: Path
) -> None:
    """The status rule shared with the checkpoint mirror (`storage.is_transient_error`), on the data path."""
    train, val = load_manifest(prepared).shards_of("train")[1], load_manifest(prepared).shards_of("val")[1]
    store.behave(train.file, "status:403")
    store.behave(val.file, "status:429", times=2)
    url = f"{store.url}/ds"
    with _open(url, tmp_path / "a", fetch_retry_s=30.0) as dataset, pytest.raises(UserInputError) as info:
        start_s = time.monotonic()
        dataset.shard_path(train)
    assert time.monotonic() - start_s < 5 and _gets(store, train.file) == 1, "a 403 is not retried"
    expected = f"{url}/{train.file}: cannot be read (HTTP 403); check the URL and its access rights"
    assert str(info.value) == expected
    with _open(url, tmp_path / "b", fetch_retry_s=30.0) as dataset:
        assert dataset.shard_path(val).read_bytes() == (prepared / val.file).read_bytes()
        assert dataset.stats()["retries"] >= 1  # the 429s were answered, and retried


def test_a_stalled_shard_read_gives_up_after_about_the_retry_budget(
    store: HttpStore, prepared: Path, tmp_path: Path
) -> None:
    """aiohttp's default waits 300 s for a whole response, and a stalled first attempt did not count against the
    budget: a run waited 10 minutes (and ignored SIGTERM meanwhile). The stall bound is a quarter of the budget (at
    least 1 s), and the outage dates back to the stall's start."""
    train = load_manifest(prepared).shards_of("train")[2]
    store.behave(train.file, "stall")
    url = f"{store.url}/ds"
    with _open(url, tmp_path / "cache", fetch_retry_s=2.0) as dataset:
        start_s = time.monotonic()
        with pytest.raises(UserInputError) as info:
            dataset.shard_path(train)
        took_s = time.monotonic() - start_s
    assert str(info.value).startswith(f"{url}/{train.file}: unreachable, retried for "), info.value
    assert "data.fetch_retry_s=2" in str(info.value)
    assert 2.0 <= took_s < 6.0, took_s


def test_a_stalled_first_attempt_counts_against_the_budget(
    store: HttpStore, prepared: Path, tmp_path: Path
) -> None:
    """A budget (0.5 s) shorter than the stall bound (1 s): the outage began when the stalled read started, so it
    is over when that read fails; it used to begin only then, buying a second stalled attempt."""
    train = load_manifest(prepared).shards_of("train")[3]
    store.behave(train.file, "stall")
    with (
        _open(f"{store.url}/ds", tmp_path / "cache", fetch_retry_s=0.5) as dataset,
        pytest.raises(UserInputError, match=r"unreachable, retried for 1\.\d s"),
    ):
        dataset.shard_path(train)
    assert _gets(store, train.file) == 1


def test_a_store_that_answers_nothing_is_waited_on_once_per_attempt(
    store: HttpStore, prepared: Path, tmp_path: Path
) -> None:
    """A store that hangs before its headers, a HEAD's too: fsspec's http `open` sent a HEAD for the size, then the
    GET, each waiting the stall bound (1 s here), so a 2 s budget ran ~4.5 s and the line said ~3.5 s. The size
    comes from the manifest (no HEAD), and the outage is dated from the first attempt's start."""
    train = load_manifest(prepared).shards_of("train")[4]
    store.behave(train.file, "hang")
    with _open(f"{store.url}/ds", tmp_path / "cache", fetch_retry_s=2.0) as dataset:
        start_s = time.monotonic()
        with pytest.raises(UserInputError) as info:
            dataset.shard_path(train)
        took_s = time.monotonic() - start_s
    assert not [path for method, path in store.requests if method == "HEAD" and path.endswith(train.file)]
    said = re.search(r"unreachable, retried for ([0-9.]+) s \(data\.fetch_retry_s=2\)", str(info.value))
    assert said is not None, info.value
    said_s = float(said.group(1))
    assert said_s >= 2.0 and took_s < 3.5 and took_s - said_s < 0.3, (said_s, took_s)


def test_an_outage_is_dated_from_when_the_store_last_answered_the_attempt() -> None:
    """An attempt may hold several waits (a HEAD, then a GET): all of them count, from the attempt's start (it was
    dated at most one stall bound back, and retried), or from the last bytes it delivered (a long transfer cut off
    at its end is retried, not charged in full)."""
    silent_attempts = 0

    def silent() -> None:
        nonlocal silent_attempts
        silent_attempts += 1
        time.sleep(0.3)
        raise TimeoutError("read timed out")

    with pytest.raises(UserInputError, match=r"x: unreachable, retried for 0\.\d s \(b=0\.2\)"):
        Retrier(first_backoff_s=0.05).call("x", silent, budget_s=0.2, budget_name="b")
    assert silent_attempts == 1

    retrier = Retrier(first_backoff_s=0.05)
    transfers = 0

    def cut_off_then_served() -> str:
        nonlocal transfers
        transfers += 1
        if transfers == 2:
            return "served"
        time.sleep(0.3)
        retrier.heard_from_store()
        time.sleep(0.05)
        raise ConnectionResetError("reset by peer")

    assert retrier.call("x", cut_off_then_served, budget_s=0.2, budget_name="b") == "served"
    assert retrier.retries == 1


def test_a_manifest_that_stalls_fails_at_open_within_seconds(store: HttpStore, tmp_path: Path) -> None:
    store.behave("manifest.json", "stall")
    start_s = time.monotonic()
    with pytest.raises(UserInputError, match=r"manifest\.json: unreachable, retried for"):
        _open(f"{store.url}/ds", tmp_path / "cache")
    assert time.monotonic() - start_s < OPEN_STALL_S + 3


def test_a_missing_shard_read_by_a_loader_worker_is_the_same_one_line(
    store: HttpStore, prepared: Path, tmp_path: Path
) -> None:
    """`gaudi3 train` with `data.loader_workers 1`: torch re-raised the worker's error with its traceback as the
    message, which the one-line error squeezed and cut in the middle, where the shard's URL was."""
    store.behave(".bin", "status:404")
    cmd = [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(tmp_path / "run"), "--no-progress",
           f"--data.source={store.url}/ds", "--data.loader_workers=1", "--data.prefetch_shards=0",
           f"--data.cache_dir={tmp_path / 'cache'}", "--model.num_layers=1", "--model.context_length=32",
           "--train.micro_batch_size=2", "--train.global_batch_size=2", "--train.max_steps=2",
           "--train.val_every_steps=0", "--sample-tokens=0", "--train.threads=1"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    shards = [f"{store.url}/ds/{s.file}" for s in load_manifest(prepared).shards]
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr[-3000:]
    said = re.fullmatch(
        r"gaudi3: error: (\S+): missing at the store \(listed in manifest\.json\); .*\n", done.stderr
    )
    assert said is not None and said.group(1) in shards, done.stderr


def test_a_corrupt_shard_is_one_error_and_nothing_printed_around_it(
    store: HttpStore, prepared: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Shards answered by an HTML page: the prefetch thread's failures are hints (silent), `shard_path` reports
    once, and the prefetch thread is stopped before the error reaches the user."""
    store.behave(".bin", "html")
    train = load_manifest(prepared).shards_of("train")
    with (
        caplog.at_level(logging.DEBUG, logger="gaudi3_scale"),
        _open(f"{store.url}/ds", tmp_path / "cache", prefetch_shards=2) as dataset,
    ):
        dataset.prefetch(train)
        time.sleep(0.5)  # the prefetch thread fails on the first ones
        with pytest.raises(UserInputError, match=r"train-00000\.bin: corrupt, twice: 69 bytes"):
            dataset.shard_path(train[0])
        assert dataset._thread is not None
        dataset._thread.join(timeout=5)
        assert not dataset._thread.is_alive(), "the prefetch thread goes on after the error"
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def _url_copy(prepared: Path, tmp_path: Path, edit: Any) -> str:
    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    data = json.loads((copy / "manifest.json").read_text())
    edit(data)
    (copy / "manifest.json").write_text(json.dumps(data))
    return copy.as_uri()


def test_a_url_datasets_tokenizer_is_checked_against_its_vocab_size(prepared: Path, tmp_path: Path) -> None:
    url = _url_copy(prepared, tmp_path, lambda m: m.update(vocab_size=40))
    cfg = DataConfig(source=url, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(UserInputError) as info:
        open_training_data(cfg, progress=False)
    assert str(info.value).startswith(f"{url}: its tokenizer has 256 ids but the manifest's vocab_size is 40")


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            lambda m: m["shards"][0].update(num_tokens=m["shards"][0]["num_tokens"] // 2),
            "disagrees with num_tokens",
        ),
        (
            lambda m: m["shards"][0].update(sha256="../../../escape/" + "0" * 48),
            "is not 64 lowercase hex digits",
        ),
    ],
)
def test_a_url_manifests_shard_entries_are_checked_at_open(
    prepared: Path, tmp_path: Path, edit: Any, expected: str
) -> None:
    url = _url_copy(prepared, tmp_path, edit)
    with pytest.raises(UserInputError) as info:
        _open(url, tmp_path / "a" / "b" / "c" / "cache")
    assert str(info.value).startswith(f"{url}/manifest.json: shards[0]") and expected in str(info.value)
    assert not (tmp_path / "escape").exists()


def test_a_cache_dir_that_is_a_file_and_a_url_without_bucket_are_one_line(
    prepared: Path, tmp_path: Path
) -> None:
    (tmp_path / "a.txt").write_text("x")
    cfg = DataConfig(source=prepared.as_uri(), cache_dir=str(tmp_path / "a.txt"))
    with pytest.raises(UserInputError) as info:
        open_training_data(cfg, progress=False)
    assert (
        str(info.value)
        == f"data.cache_dir: {tmp_path / 'a.txt'} is a file; allowed: a directory (created if missing)"
    )
    pytest.importorskip("s3fs", reason="needs the `remote` extra")
    with pytest.raises(ConfigError, match=r"^data\.source: 's3://' names no bucket or path"):
        _open("s3://", tmp_path / "cache", field="data.source")


def test_a_failed_publish_leaves_the_dataset_already_at_the_url_whole(prepared: Path, tmp_path: Path) -> None:
    """Shards are stored by content: dataset B's cannot overwrite A's (same names, train-00000.bin …), and A's
    manifest stays until B's replaces it, last."""
    url = (tmp_path / "pub").as_uri()
    publish_prepared(prepared, url)
    other = _prepare(tmp_path, 30_000, 32_000)
    b = load_manifest(other)
    assert {s.file for s in b.shards} >= {s.file for s in load_manifest(prepared).shards}  # the names clash
    last = b.shards_of("train")[-1]
    assert last.file not in {s.file for s in load_manifest(prepared).shards}
    # B's publish fails there, after uploading its other shards: a directory where its last shard would go (stored
    # by content, and, as earlier versions named it, flat beside the manifest: those overwrote A's shards first)
    (tmp_path / "pub" / "objects" / f"{last.sha256}-{last.file}" / "blocker").mkdir(parents=True)
    (tmp_path / "pub" / last.file / "blocker").mkdir(parents=True)
    with pytest.raises(UserInputError, match=r"^--out: cannot publish to .*IsADirectoryError"):
        publish_prepared(other, url, field="--out")

    def read_all(cache: Path) -> dict[str, bytes]:
        with _open(url, cache) as dataset:
            return {s.file: dataset.shard_path(s).read_bytes() for s in dataset.manifest.shards}

    assert read_all(tmp_path / "cache-a") == {
        s.file: (prepared / s.file).read_bytes() for s in load_manifest(prepared).shards
    }
    shutil.rmtree(tmp_path / "pub" / "objects" / f"{last.sha256}-{last.file}")
    publish_prepared(other, url)
    assert read_all(tmp_path / "cache-b") == {s.file: (other / s.file).read_bytes() for s in b.shards}
