"""benchmarks/bench_stream.py measures streaming through a cache that has to evict: a shape whose cache would hold a
quarter or more of what its runs read is refused before anything trains, and each streamed run it measures records
its evictions, shards and bytes fetched and fetch wait beside tokens/s (a small shape of the default config here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_stream.py"
# ~400 shards of <= 242 bytes (63-121 tokens), a 1,100-byte cache (4 shards): 60 steps of 12 windows read ~28.
SHAPE = ["--corpus-mb", "0.02", "--shard-mb", "0.00008", "--cache-mib", "0.00105", "--repeats", "1"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)


def test_a_shape_whose_cache_would_not_evict_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "stream.json"
    done = _run(*SHAPE, "--steps", "20", "--out", str(out))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "default: 20 steps read " in done.stderr and "nothing would have to be evicted" in done.stderr
    assert not out.exists()


def test_streamed_runs_evict_and_record_it(tmp_path: Path) -> None:
    out = tmp_path / "stream.json"
    done = _run(*SHAPE, "--steps", "60", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    default = result["throughput"]["default"]
    reads = default["reads"]
    assert reads["cache_limit_bytes"] == result["dataset"]["cache_limit_bytes"] == int(0.00105 * 2**20)
    assert reads["bytes"] >= 4 * reads["cache_limit_bytes"] and reads["block_shards"] == 1
    (local,), (stream,) = default["runs"]["local"], default["runs"]["stream"]
    cache = stream["data_cache"]
    assert local["data_cache"] is None and cache["evictions"] > 0 and cache["fetch_wait_s"] > 0, cache
    # every shard read was fetched at least once (the window fetches a few more ahead)
    assert (
        cache["shards_fetched"] >= reads["train_shards"] + reads["val_shards"]
        and cache["bytes_fetched"] >= reads["bytes"]
    )
    assert default["stream_cache"] == {
        k: cache[k] for k in ("evictions", "shards_fetched", "bytes_fetched", "fetch_wait_s")
    }
    assert default["same_train_loss"] and stream["tokens_per_s"] > 0
    assert default["pair_ratios"] == [stream["tokens_per_s"] / local["tokens_per_s"]]
    assert "default #0 stream: " in done.stdout  # a line per finished run where no bar shows
