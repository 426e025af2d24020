"""What the training sampler costs per 2,048 samples: one file vs the same tokens in shards, blocks, a mixture.

Every setting holds the same total tokens (--shards shards of random sizes, or one file of their sum), so the
Feistel domain is the same and the ratios show what sharding, block shuffling and mixing add. Steps are asked for
in increasing order, one global batch of 2,048 samples per call, as the loader does (best of --repeats). Results
are printed as µs per call and as a ratio to the one-file sampler, and saved as JSON with machine info.

    python benchmarks/bench_sampler.py
    python benchmarks/bench_sampler.py --shards 100000 --calls 50
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from gaudi3_scale.bench.result import write_json_atomic
from gaudi3_scale.data.mixture import MixtureSampler
from gaudi3_scale.data.sampler import WindowSampler
from gaudi3_scale.monitor.environment import environment_info

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_args import positive_int

GLOBAL_BATCH = 2048
MICRO = 8
CONTEXT = 2048


def time_calls(steps_starts: Any, calls: int, repeats: int) -> float:
    """Best-of-`repeats` µs per `steps_starts(step, 1)` over `calls` consecutive steps."""
    steps_starts(0, 1)
    best = float("inf")
    for repeat in range(repeats):
        first = 1 + repeat * calls
        start = time.perf_counter()
        for step in range(first, first + calls):
            steps_starts(step, 1)
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shards", type=positive_int, default=300)
    parser.add_argument("--calls", type=positive_int, default=100)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "sampler.json")
    args = parser.parse_args()

    shard_tokens = np.random.default_rng(0).integers(0, 2_000_000, args.shards).tolist()
    kw: dict[str, Any] = {"global_batch_size": GLOBAL_BATCH, "micro_batch_size": MICRO, "seed": 1}
    settings: dict[str, Any] = {"one file": WindowSampler(sum(shard_tokens), CONTEXT, **kw).steps_starts}
    for block_shards in (None, 8, 1):
        sampler = WindowSampler(shard_tokens, CONTEXT, block_shards=block_shards, **kw)
        settings[f"{args.shards} shards, blocks of {sampler.block_shards}"] = sampler.steps_starts
    thirds = [shard_tokens[i::3] for i in range(3)]
    members = [WindowSampler(t, CONTEXT, block_shards=8, **kw) for t in thirds]
    mixture = MixtureSampler(
        members, [0.5, 0.3, 0.2], ["a", "b", "c"], global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO
    )
    settings["mixture of 3 (0.5/0.3/0.2), blocks of 8"] = mixture.steps_starts

    rows = []
    for name, steps_starts in settings.items():
        rows.append(
            {"setting": name, "us_per_2048_samples": time_calls(steps_starts, args.calls, args.repeats)}
        )
    base = rows[0]["us_per_2048_samples"]
    for row in rows:
        row["ratio_to_one_file"] = row["us_per_2048_samples"] / base
        print(f"{row['setting']:>42}: {row['us_per_2048_samples']:8.1f} us  {row['ratio_to_one_file']:5.2f}x")

    result = {
        "machine": environment_info(),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "results": rows,
    }
    write_json_atomic(args.out, result)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
