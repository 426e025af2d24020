"""Training from a sharded dataset on a real S3 server (moto on 127.0.0.1) through a cache smaller than the data.

The streamed run must read exactly the samples the same run reads from local disk, through an object-store outage
in the middle, and end bitwise equal; a cache smaller than the prefetch window still downloads each shard once. Bad
URLs, corrupt or missing shards, bad mixtures and a cache too small for one shuffle block are one line, exit 2.
"""

from __future__ import annotations

import collections
import hashlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest

from gaudi3_scale.data import DataConfig, prepare_dataset
from gaudi3_scale.data.manifest import load_manifest
from gaudi3_scale.data.publish import OBJECTS_DIR, publish_prepared
from gaudi3_scale.data.sources import bundled_corpora
from gaudi3_scale.storage import open_remote
from gaudi3_scale.train import GaudiTrainer
from gaudi3_scale.train.config import resolve_config
from s3_server import S3Server, running_s3_server

pytestmark = pytest.mark.integration

BUCKET = "stream-tests"
# ~20 KB of text in ~90 train shards of ~200 tokens; windows of 32 tokens, 32 per step: a shuffle block of one
# shard (~170 windows) lasts some 5 steps, so a 60-step run crosses a dozen blocks, fetches ahead, evicts, and needs
# shards while the store is down.
TEXT_BYTES, SHARD_MB = 20_000, 0.0002
COMMON = ["--model.context_length=32", "--train.micro_batch_size=8", "--train.global_batch_size=32",
          "--train.max_steps=60", "--train.val_every_steps=0", "--train.log_every_steps=10",
          "--checkpoint.every_steps=60", "--data.shuffle_block_shards=1", "--data.prefetch_shards=1",
          "--train.threads=1"]  # fmt: skip


class _Record(pl.Callback):
    def __init__(self) -> None:
        self.samples: list[tuple[int, str]] = []

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *_: Any
    ) -> None:
        self.samples += [
            (trainer.global_step, hashlib.sha1(r.numpy().tobytes()).hexdigest()) for r in batch[0]
        ]


class _Outage(pl.Callback):
    """Stops the store after `at_step` and starts it again, from another thread, once training has stalled on it:
    no batch has ended for `stall_s` (the loader waits for a shard the store cannot give) and the store has been
    down for `seconds` at least. Restarting on a clock alone let a slow, contended machine train through the whole
    outage on shards it already held, and the wait it checks never happened. `give_up_s`: restarted whatever."""

    def __init__(
        self, server: S3Server, at_step: int, seconds: float, stall_s: float = 2.0, give_up_s: float = 60.0
    ) -> None:
        self.server, self.at_step, self.seconds = server, at_step, seconds
        self.stall_s, self.give_up_s = stall_s, give_up_s
        self.thread: threading.Thread | None = None
        self.last_batch_end_s = time.monotonic()

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        self.last_batch_end_s = time.monotonic()
        if trainer.global_step == self.at_step and self.thread is None:
            self.server.stop()
            self.thread = threading.Thread(target=self._restart_after_a_stall, daemon=True)
            self.thread.start()

    def _restart_after_a_stall(self) -> None:
        stopped = time.monotonic()
        while True:
            now = time.monotonic()
            stalled = now - self.last_batch_end_s >= self.stall_s and now - stopped >= self.seconds
            if stalled or now - stopped >= self.give_up_s:
                break
            time.sleep(0.05)
        self.server.start()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[S3Server, Path, str]]:
    source = tmp_path_factory.mktemp("text") / "part.txt"
    source.write_text(bundled_corpora()["tinyshakespeare"].read_text()[:TEXT_BYTES])
    local = prepare_dataset(DataConfig(source=str(source), shard_mb=SHARD_MB), tmp_path_factory.mktemp("ds"),
                            progress=False)  # fmt: skip
    with running_s3_server(BUCKET) as (server, _options):
        mp = pytest.MonkeyPatch()
        for key, value in {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{server.port}", "AWS_ACCESS_KEY_ID": "testing",
                           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "eu-west-1"}.items():  # fmt: skip
            mp.setenv(key, value)
        url = publish_prepared(local, f"s3://{BUCKET}/tiny")
        yield server, local, url
        mp.undo()


def _train(out: Path, source: str, *extra: str, callbacks: list[pl.Callback]) -> dict[str, Any]:
    config = resolve_config(None, [f"--out_dir={out}", f"--data.source={source}", *COMMON, *extra])
    return GaudiTrainer(config, callbacks=callbacks, progress=False).fit()


def test_streamed_training_reads_the_local_stream_through_a_small_cache_and_an_outage(
    store: tuple[S3Server, Path, str], tmp_path: Path
) -> None:
    from gaudi3_scale.checkpoint.inspect import first_difference
    from gaudi3_scale.checkpoint.reader import read_checkpoint
    from gaudi3_scale.cli.ckpt_cmd import DIFF_KEYS

    server, local, url = store
    manifest = load_manifest(local)
    shard_bytes = max(s.size_bytes for s in manifest.shards)
    local_run, streamed = _Record(), _Record()
    reference = _train(tmp_path / "local", str(local), callbacks=[local_run])
    cache_gib = (
        6 * shard_bytes / 2**30
    )  # the block in use, the next one, and the val shards: far below the data
    outage = _Outage(server, at_step=5, seconds=3.0)
    summary = _train(tmp_path / "s3", url, f"--data.cache_limit_gib={cache_gib}",
                     f"--data.cache_dir={tmp_path / 'cache'}", callbacks=[streamed, outage])  # fmt: skip
    assert outage.thread is not None
    outage.thread.join()
    assert streamed.samples == local_run.samples and len(local_run.samples) == 60 * 32
    diff = first_difference(
        *(read_checkpoint(Path(s["checkpoint"])) for s in (reference, summary)), keys=DIFF_KEYS
    )
    assert diff is None
    cache = summary["data_cache"]
    # It waited for the store (the outage lasted until training stalled on it) and evicted.
    assert cache["shards_fetched"] > 8 and cache["evictions"] > 0 and cache["fetch_wait_s"] > 1.0, cache
    cached = sum(p.stat().st_size for p in (tmp_path / "cache").rglob("*.bin"))
    assert cached <= cache_gib * 2**30 < sum(s.size_bytes for s in manifest.shards)


def _cli_train(out: Path, source: str, *extra: str) -> dict[str, Any]:
    """`gaudi3 train` in a subprocess with a timeout: a run that stalls fails the test instead of hanging it."""
    cmd = [sys.executable, "-m", "gaudi3_scale.cli", "train", "--out", str(out), "--no-progress", "--resume", "never",
           f"--data.source={source}", *COMMON, *extra]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return summary


def test_a_cache_smaller_than_the_prefetch_window_downloads_each_shard_once(
    store: tuple[S3Server, Path, str], tmp_path: Path
) -> None:
    """Room for 2 shards under a window of 4 (the block in use, the next one, 2 ahead), and a final validation
    that reads every one of ~37 val shards: the run reads the local stream, evicts, and never downloads a shard
    twice (a val read must not evict the window, which the prefetch thread would fetch again, and so on)."""
    from gaudi3_scale.checkpoint.inspect import first_difference
    from gaudi3_scale.checkpoint.reader import read_checkpoint
    from gaudi3_scale.cli.ckpt_cmd import DIFF_KEYS

    server, _, _ = store
    source = tmp_path / "part.txt"
    source.write_text(bundled_corpora()["tinyshakespeare"].read_text()[:TEXT_BYTES])
    local = prepare_dataset(DataConfig(source=str(source), shard_mb=2.5 * SHARD_MB), tmp_path / "ds",
                            progress=False)  # fmt: skip
    manifest = load_manifest(local)
    assert sum(s.num_tokens > 32 for s in manifest.shards_of("val")) > 20  # each val shard holds a window
    url = publish_prepared(local, f"s3://{BUCKET}/small-cache")
    cache_bytes = 2 * max(s.size_bytes for s in manifest.shards)
    extra = ["--data.prefetch_shards=2"]
    reference = _cli_train(tmp_path / "local", str(local), *extra)
    first_request = len(server.requests)
    summary = _cli_train(tmp_path / "s3", url, *extra, f"--data.cache_limit_gib={cache_bytes / 2**30}",
                         f"--data.cache_dir={tmp_path / 'cache'}")  # fmt: skip
    diff = first_difference(
        *(read_checkpoint(Path(s["checkpoint"])) for s in (reference, summary)), keys=DIFF_KEYS
    )
    assert diff is None and summary["val_loss"] == reference["val_loss"]
    prefix = "/" + url.removeprefix("s3://") + "/"
    gets = collections.Counter(
        path
        for method, path in server.requests[first_request:]
        if method == "GET" and path.startswith(prefix)
    )
    shard_gets = {path: n for path, n in gets.items() if path.endswith(".bin")}
    assert len(shard_gets) > 30 and max(shard_gets.values()) == 1, sorted(
        shard_gets.items(), key=lambda x: -x[1]
    )[:5]
    cache = summary["data_cache"]
    assert cache["evictions"] > 0 and cache["shards_fetched"] == len(shard_gets), cache
    cached = sum(p.stat().st_size for p in (tmp_path / "cache").rglob("*.bin"))
    assert cached <= cache_bytes


def test_a_cache_smaller_than_one_shuffle_block_is_one_line(
    store: tuple[S3Server, Path, str], tmp_path: Path, gaudi3_cli: Any
) -> None:
    _, local, url = store
    largest = max(s.size_bytes for s in load_manifest(local).shards)
    code, _, err = gaudi3_cli("train", "--out", str(tmp_path / "run"), "--no-progress", f"--data.source={url}",
                              *COMMON, "--data.shuffle_block_shards=4", "--train.max_steps=1",
                              f"--data.cache_limit_gib={3 * largest / 2**30}",
                              f"--data.cache_dir={tmp_path / 'cache'}")  # fmt: skip
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert (
        lines[0].startswith("gaudi3: error: data.cache_limit_gib=")
        and "data.shuffle_block_shards" in lines[0]
    )
    minimum = float(lines[0].rsplit("the minimum is data.cache_limit_gib=", 1)[1].split()[0].rstrip(",;"))
    assert int(minimum * 2**30) >= 4 * largest > int(minimum * 2**30) - largest // 10, lines[0]


def test_a_resume_whose_checkpoint_block_outgrows_the_cache_is_one_line(
    store: tuple[S3Server, Path, str], tmp_path: Path, gaudi3_cli: Any
) -> None:
    """data.shuffle_block_shards left null: a resume adopts the checkpoint's block (5 shards, from a larger cache),
    which the smaller cache it resumes with must hold, as a fresh run's block must."""
    _, local, url = store
    largest = max(s.size_bytes for s in load_manifest(local).shards)
    args = ["train", "--out", str(tmp_path / "run"), "--no-progress", f"--data.source={url}",
            *(a for a in COMMON if not a.startswith("--data.shuffle_block_shards")), "--train.max_steps=1",
            "--checkpoint.every_steps=1", f"--data.cache_dir={tmp_path / 'cache'}"]  # fmt: skip
    code, _, err = gaudi3_cli(*args, f"--data.cache_limit_gib={12 * largest / 2**30}")  # a block of 5
    assert code == 0, err
    code, _, err = gaudi3_cli(*args, "--train.max_steps=2", f"--data.cache_limit_gib={3 * largest / 2**30}")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert (
        lines[0].startswith("gaudi3: error: data.cache_limit_gib=")
        and "checkpoint's shuffle block of 5" in lines[0]
    )
    assert "new --out directory" in lines[0]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*")) == ["step-00000001"]


def _corrupt(url: str, name: str, data: bytes | None) -> None:
    fs, root = open_remote(url, field="test")
    if data is None:
        fs.rm(f"{root}/{name}")
    else:
        fs.pipe_file(f"{root}/{name}", data)


@pytest.mark.parametrize("damage", ["checksum", "missing"])
def test_a_damaged_shard_at_the_store_is_one_line(
    store: tuple[S3Server, Path, str], tmp_path: Path, damage: str, gaudi3_cli: Any
) -> None:
    _, local, _ = store
    url = publish_prepared(local, f"s3://{BUCKET}/damaged-{damage}")
    names = [s.file for s in load_manifest(local).shards_of("train")]
    for shard in load_manifest(local).shards_of("train"):  # whichever shard the run reads first is damaged
        stored = f"{OBJECTS_DIR}/{shard.sha256}-{shard.file}"  # published files are stored by content
        _corrupt(url, stored, b"\x00" * 64 if damage == "checksum" else None)
    code, _, err = gaudi3_cli("train", "--out", str(tmp_path / "run"), "--no-progress", f"--data.source={url}",
                                *COMMON, f"--data.cache_dir={tmp_path / 'cache'}", "--data.fetch_retry_s=1")  # fmt: skip
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and any(name in lines[0] for name in names), err
    assert (
        ("SHA-256" in lines[0])
        if damage == "checksum"
        else ("missing" in lines[0] or "not found" in lines[0])
    )


def test_unreachable_store_at_start_is_one_line(tmp_path: Path, gaudi3_cli: Any, monkeypatch: Any) -> None:
    from s3_server import free_port

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    code, _, err = gaudi3_cli("train", "--out", str(tmp_path / "run"), "--no-progress",
                              f"--data.source=s3://{BUCKET}/nowhere", *COMMON)  # fmt: skip
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and f"s3://{BUCKET}/nowhere" in lines[0], err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_bad_mixtures_are_one_line(
    store: tuple[S3Server, Path, str], tmp_path: Path, gaudi3_cli: Any
) -> None:
    _, local, _ = store
    unknown = json.dumps(
        [{"source": str(local), "weight": 1}, {"source": str(tmp_path / "nope"), "weight": 1}]
    )
    zero = json.dumps([{"source": str(local), "weight": 0}])
    for mixture, expected in ((unknown, "nope"), (zero, "sum")):
        code, _, err = gaudi3_cli("train", "--out", str(tmp_path / "run"), "--no-progress",
                                  f"--data.mixture={mixture}", *COMMON)  # fmt: skip
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and expected in lines[0], err


def test_prepare_publishes_to_a_url_manifest_last_and_reuploads_nothing(
    store: tuple[S3Server, Path, str], tmp_path: Path, gaudi3_cli: Any
) -> None:
    server, _, _ = store
    source = tmp_path / "part.txt"
    source.write_text(bundled_corpora()["tinyshakespeare"].read_text()[:5_000])
    url = f"s3://{BUCKET}/cli"
    code, out, err = gaudi3_cli("prepare", str(source), "--shard-mb", "0.002", "--out", url)
    assert code == 0, err
    assert out.strip() == url
    fs, root = open_remote(url, field="test")
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root)) == ["manifest.json", "objects"]
    manifest = json.loads(fs.cat_file(f"{root}/manifest.json"))
    objects = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{root}/objects"))
    listed = [(s["sha256"], s["file"]) for s in manifest["shards"]] + [
        (manifest["tokenizer_sha256"], "tokenizer.json")
    ]
    assert objects == sorted(f"{sha256}-{name}" for sha256, name in listed)  # stored by content
    assert len(manifest["shards"]) > 2
    puts = len([r for r in server.requests if r[0] == "PUT"])
    assert gaudi3_cli("prepare", str(source), "--shard-mb", "0.002", "--out", url)[0] == 0
    new_puts = [r for r in server.requests if r[0] == "PUT"][puts:]
    assert [path.rsplit("/", 1)[-1] for _, path in new_puts] == ["manifest.json"]  # only the commit point


def test_prepared_dir_url_prepares_publishes_and_trains_from_the_store(
    store: tuple[S3Server, Path, str], tmp_path: Path
) -> None:
    source = tmp_path / "part.txt"
    source.write_text(bundled_corpora()["tinyshakespeare"].read_text()[:8_000])
    url = f"s3://{BUCKET}/prepared-dir"
    summary = _train(tmp_path / "run", str(source), f"--data.prepared_dir={url}", "--train.max_steps=3",
                     "--data.shard_mb=0.002", f"--data.cache_dir={tmp_path / 'cache'}", callbacks=[])  # fmt: skip
    assert summary["steps"] == 3 and summary["data_cache"]["shards_fetched"] >= 1
    fs, root = open_remote(url, field="test")
    assert (
        fs.exists(f"{root}/manifest.json")
        and len(json.loads(fs.cat_file(f"{root}/manifest.json"))["shards"]) > 2
    )
