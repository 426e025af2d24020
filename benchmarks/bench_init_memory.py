"""Per-rank memory of building a model for FSDP: whole-then-shard (every rank builds the full fp32 model, then
shards it) against meta-then-materialise (`distributed.parallelize`: shapes on meta, shard, each rank allocates
and initialises only its shards). Both on CPU with gloo, 2 ranks by default, on the llama3.2-1b shape.

For each way, rank 0 reports its peak RSS after setup minus its RSS before the model was touched (the process
baseline: torch, gloo), as a fraction of the full model's fp32 parameter bytes. The goal (issue 22): meta ≤ 0.6.
Both ways must give bitwise the same weights (checked on a sample of parameters).

    python benchmarks/bench_init_memory.py                    # writes benchmarks/results/init_memory_cpu.json
    python benchmarks/bench_init_memory.py --model llama-tiny --ranks 4
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.progress import Progress

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_args import positive_int

WAYS = ("whole", "meta")


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def worker(model_name: str, way: str, out: str) -> None:
    """One rank: build the model `way`, shard it over all ranks; rank 0 writes what it measured."""
    import torch
    import torch.distributed as dist

    from gaudi3_scale.distributed.mesh import build_device_mesh
    from gaudi3_scale.distributed.parallelize import build_parallelized, parallelize
    from gaudi3_scale.distributed.plan import ParallelPlan
    from gaudi3_scale.distributed.teardown import leave_process_group
    from gaudi3_scale.models import build_model, get_model_config
    from gaudi3_scale.train.module import next_token_loss

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = build_device_mesh("cpu", world_size=world, tp_size=1, dp_replicate=1)
    cfg = get_model_config(model_name)
    cfg = cfg.resolve_vocab(cfg.vocab_size or 50_304)
    baseline = _rss_bytes()
    started = time.perf_counter()
    plan = ParallelPlan(strategy="fsdp", world_size=world)
    if way == "meta":  # what the trainer does
        model = build_parallelized(cfg, plan, seed=0, loss=next_token_loss, mesh=mesh, device="cpu").model
    else:  # built whole on every rank, then sharded
        model = parallelize(build_model(cfg, seed=0), plan, loss=next_token_loss, mesh=mesh).model
    setup_s = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    full_bytes = sum(p.numel() * 4 for p in model.parameters())  # DTensor numel is the global one
    sample = {name: p.full_tensor()[:2].clone() for name, p in list(model.named_parameters())[:4]}
    if dist.get_rank() == 0:
        torch.save(
            {"baseline_rss_bytes": baseline, "peak_rss_bytes": peak, "full_fp32_bytes": full_bytes,
             "setup_s": setup_s, "sample": sample},
            out,
        )  # fmt: skip
    del model, sample
    leave_process_group()  # the groups go with their gloo threads before the exit


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llama3.2-1b")
    parser.add_argument("--ranks", type=positive_int, default=2)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "init_memory_cpu.json"
    )
    args = parser.parse_args()

    import torch

    from gaudi3_scale.bench.result import write_json_atomic
    from gaudi3_scale.monitor.environment import environment_info

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, Progress() as progress:
        task = progress.add_task(f"{args.model} on {args.ranks} ranks", total=len(WAYS))
        for way in WAYS:
            path = Path(tmp) / f"{way}.pt"
            proc = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.ranks}", __file__,
                 "--worker", args.model, way, str(path)],
                capture_output=True, text=True,
            )  # fmt: skip
            if proc.returncode:
                sys.exit(f"{way}: the workers failed:\n{proc.stderr[-3000:]}")
            results[way] = torch.load(path, weights_only=True)
            progress.advance(task)
    samples = [results[way].pop("sample") for way in WAYS]
    identical = all(torch.equal(samples[0][k], samples[1][k]) for k in samples[0])
    report: dict[str, Any] = {"benchmark": "init_memory", "model": args.model, "ranks": args.ranks,
                              "same_weights": identical, "machine": environment_info()}  # fmt: skip
    for way in WAYS:
        r = results[way]
        over = r["peak_rss_bytes"] - r["baseline_rss_bytes"]
        r["peak_over_baseline_bytes"] = over
        r["fraction_of_full_fp32"] = over / r["full_fp32_bytes"]
        report[way] = r
        print(f"{way:5s}: rank 0 peak {over / 2**30:6.2f} GiB over its baseline = "
              f"{r['fraction_of_full_fp32']:.2f} x the full fp32 parameters ({r['full_fp32_bytes'] / 2**30:.2f} GiB); "
              f"setup {r['setup_s']:.1f} s")  # fmt: skip
    print(
        f"same weights both ways: {identical}; goal meta <= 0.6: {report['meta']['fraction_of_full_fp32'] <= 0.6}"
    )
    write_json_atomic(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:5])
    else:
        main()
