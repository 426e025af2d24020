"""`gaudi3 serve` under load: continuous batching (`--max-batch-size 8`) against one request at a time (`1`).

Both servers are real `gaudi3 serve` processes on 127.0.0.1 serving the same safetensors export: the
shakespeare-char preset (4 layers, dim 128, context 64) with a byte tokenizer and RANDOM weights (throughput does
not depend on what the weights say). For each number of concurrent clients, both servers are measured one after
the other: every client sends `--requests` completions back to back (64 tokens each, sampled at temperature 0.8
with a seed), and every response is checked to be complete (200, 64 tokens, finish_reason "length"). Each cell
runs `--rounds` times, the two servers' order alternating, and pools its rounds.

Recorded per cell: p50 / p95 request latency, requests/s, generated tokens/s, errors (must be 0), and the mean
batch the engine ran (generated tokens / decode steps, from the server's /health counters).

    python benchmarks/bench_serve.py            # writes benchmarks/results/serve/serve_cpu.json and .png
    python benchmarks/bench_serve.py --quick    # fewer requests, nothing written

`--burst 200,1000` measures something else: N clients connecting at the same instant to one server with the
default limits (`--max-batch-size 8 --max-queue 64`), each asking for 4 tokens. Every client must get an HTTP
answer, 200 or 503 `queue_full` (a connection reset or any other outcome is an error); recorded per burst: the
count of each outcome, the time until the last answer, and p50 / p95 time to a 200 and to a 503. Written to
`--out`, by default benchmarks/results/serve/serve_burst_cpu.json (nothing with `--quick`).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_args import positive_int, positive_ints
from gaudi3_scale.artifacts.export import export_checkpoint
from gaudi3_scale.bench.result import write_json_atomic
from gaudi3_scale.config.core import to_dict
from gaudi3_scale.data.tokenizers import ByteTokenizer
from gaudi3_scale.models import ModelConfig, build_model, count_parameters, get_model_config
from gaudi3_scale.monitor.environment import environment_info
from gaudi3_scale.train.module import CONFIG_KEY

RESULTS = Path(__file__).parent / "results" / "serve"
PRESET = "shakespeare-char"
MAX_TOKENS = 64
BATCH_SIZES = (1, 8)  # --max-batch-size: one at a time vs the default
CLIENTS = (1, 4, 16)
SERVING = re.compile(r"^serving \S+ \(([\d,]+) parameters\) on http://127\.0\.0\.1:(\d+)$")


def _build_export(directory: Path, cfg: ModelConfig | None = None, model: nn.Module | None = None) -> Path:
    """A random-weight model (default: the preset's shape, `build_model`'s init; else `model`, built from `cfg`) as
    a `gaudi3 ckpt export --format safetensors` dir."""
    cfg = cfg or replace(get_model_config(PRESET), vocab_size=ByteTokenizer().vocab_size)
    model = model if model is not None else build_model(cfg, seed=0)
    # A plain Lightning-style checkpoint file: what `gaudi3 train` writes, minus the optimizer state.
    checkpoint = directory / "random.ckpt"
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                CONFIG_KEY: {"model": to_dict(cfg)}}, checkpoint)  # fmt: skip
    tokenizer_dir = directory / "tokenizer"
    tokenizer_dir.mkdir()
    ByteTokenizer().save(tokenizer_dir)
    export_checkpoint(checkpoint, directory / "export", tokenizer_dir=tokenizer_dir)
    return directory / "export"


def _start_server(
    export: Path, batch_size: int, log: Path, extra: Sequence[str] = ()
) -> tuple[subprocess.Popen[str], int]:
    cmd = [sys.executable, "-m", "gaudi3_scale.cli", "serve", str(export), "--port", "0",
           "--max-batch-size", str(batch_size), *extra]  # fmt: skip
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    match = SERVING.match(line)
    if match is None:
        proc.kill()
        raise RuntimeError(f"{cmd} did not start ({line!r}): {log.read_text()[-2000:]}")
    return proc, int(match.group(2))


def _post(port: int, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", data=data, timeout=300) as resp:
        return json.loads(resp.read())


def _complete(
    port: int, prompt: str, seed: int, max_tokens: int = MAX_TOKENS
) -> tuple[float, int, str | None]:
    """(latency s, completion tokens, the problem if the response is not a complete 200)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8, "seed": seed}
    start = time.perf_counter()
    try:
        answer = _post(port, "/v1/completions", body)
    except (urllib.error.URLError, OSError) as exc:
        return time.perf_counter() - start, 0, f"{type(exc).__name__}: {exc}"
    latency = time.perf_counter() - start
    tokens, choice = answer["usage"]["completion_tokens"], answer["choices"][0]
    if tokens != max_tokens or choice["finish_reason"] != "length" or not choice["text"]:
        return latency, tokens, f"incomplete: {tokens} tokens, finish_reason {choice['finish_reason']}"
    return latency, tokens, None


def _prompt(client: int, request: int) -> str:
    return f"Client {client}, request {request}:\n"


def _run_clients(port: int, clients: int, requests: int, progress: Progress, task: Any,
                 prompt: Callable[[int, int], str] = _prompt, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:  # fmt: skip
    """One round: `clients` threads, each sending `requests` completions back to back."""
    before = _post(port, "/health")["engine"]
    results: list[tuple[float, int, str | None]] = []
    lock = threading.Lock()

    def client(index: int) -> None:
        for i in range(requests):
            outcome = _complete(port, prompt(index, i), seed=1000 * index + i, max_tokens=max_tokens)
            with lock:
                results.append(outcome)
            progress.advance(task)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall_s = time.perf_counter() - start
    after = _post(port, "/health")["engine"]
    return {"results": results, "wall_s": wall_s, "decode_steps": after["decode_steps"] - before["decode_steps"],
            "engine_tokens": after["generated_tokens"] - before["generated_tokens"]}  # fmt: skip


def _burst(port: int, clients: int) -> dict[str, Any]:
    """`clients` threads released together, one 4-token completion each: outcomes and times to answer."""
    body = json.dumps({"prompt": "burst", "max_tokens": 4, "temperature": 0}).encode()
    outcomes: list[tuple[str, float]] = []
    lock = threading.Lock()
    start = threading.Barrier(clients + 1)

    def client() -> None:
        start.wait()
        began = time.perf_counter()
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{port}/v1/completions", data=body, timeout=300
            ) as r:
                r.read()
                outcome = str(r.status)
        except urllib.error.HTTPError as exc:
            code = json.loads(exc.read()).get("error", {}).get("code")
            outcome = f"{exc.code} {code}"
        except OSError as exc:
            outcome = type(exc).__name__
        with lock:
            outcomes.append((outcome, time.perf_counter() - began))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    wall_s = time.perf_counter() - began
    counts = {o: sum(1 for got, _ in outcomes if got == o) for o in sorted({o for o, _ in outcomes})}
    row: dict[str, Any] = {"clients": clients, "outcomes": counts, "wall_s": wall_s,
                           "errors": sum(n for o, n in counts.items() if o not in ("200", "503 queue_full"))}  # fmt: skip
    for outcome, key in (("200", "ok"), ("503 queue_full", "refused")):
        times = sorted(t for o, t in outcomes if o == outcome)
        row[f"{key}_p50_s"] = statistics.median(times) if times else None
        row[f"{key}_p95_s"] = times[round(0.95 * (len(times) - 1))] if times else None
    return row


def _run_bursts(sizes: list[int], out: Path | None) -> None:
    """Each burst size against one server; the report written to `out` (None: nothing written)."""
    with tempfile.TemporaryDirectory() as tmp:
        export = _build_export(Path(tmp))
        proc, port = _start_server(export, 8, Path(tmp) / "serve-burst.err")
        try:
            _complete(port, "warm-up", 0)
            rows = [_burst(port, n) for n in sizes]
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    table = Table(title=f"gaudi3 serve, {PRESET} (random weights): simultaneous clients, 4 tokens each")
    for column in (
        "clients",
        "200",
        "503 queue_full",
        "other",
        "last answer (s)",
        "200 p50 (s)",
        "503 p50 (s)",
    ):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(str(r["clients"]), str(r["outcomes"].get("200", 0)), str(r["outcomes"].get("503 queue_full", 0)),
                      str(r["errors"]), f"{r['wall_s']:.2f}", f"{r['ok_p50_s'] or 0:.2f}",
                      f"{r['refused_p50_s'] or 0:.2f}")  # fmt: skip
    Console().print(table)
    report = {"benchmark": "serve_burst_cpu",
              "command": f"python benchmarks/bench_serve.py --burst {','.join(map(str, sizes))}",
              "server": {"preset": PRESET, "weights": "random (seed 0)", "max_batch_size": 8, "max_queue": 64},
              "bursts": rows, "machine": environment_info()}  # fmt: skip
    if any(r["errors"] for r in rows):
        raise SystemExit(f"clients without an HTTP answer: {[r['outcomes'] for r in rows]}")
    if out is not None:
        write_json_atomic(out, report)
        print(f"wrote {out}")


def _summary(batch_size: int, clients: int, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell over its rounds: latencies pooled, throughput = everything generated / all the wall time."""
    results = [r for one in rounds for r in one["results"]]
    wall_s = sum(one["wall_s"] for one in rounds)
    latencies = sorted(r[0] for r in results)
    errors = [r[2] for r in results if r[2] is not None]
    steps = sum(one["decode_steps"] for one in rounds)
    return {
        "max_batch_size": batch_size,
        "clients": clients,
        "requests": len(results),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "wall_s": wall_s,
        "latency_p50_s": statistics.median(latencies),
        "latency_p95_s": latencies[round(0.95 * (len(latencies) - 1))],
        "requests_per_s": len(results) / wall_s,
        "generated_tokens_per_s": sum(r[1] for r in results) / wall_s,
        "mean_batch_size": sum(one["engine_tokens"] for one in rounds) / steps if steps else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=positive_int, default=8, help="requests per client per round")
    parser.add_argument(
        "--rounds", type=positive_int, default=2, help="rounds per cell, the servers' order alternated"
    )
    parser.add_argument(
        "--quick", action="store_true", help="1 round of 2 requests per client; nothing is written"
    )
    parser.add_argument(
        "--out", type=Path,
        help="result JSON (default results/serve/serve_cpu.json; with --burst results/serve/serve_burst_cpu.json)",
    )  # fmt: skip
    parser.add_argument(
        "--burst", type=positive_ints, metavar="N,N",
        help="measure bursts of N simultaneous clients instead (comma-separated, each at least 1)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.burst:
        _run_bursts(args.burst, None if args.quick else args.out or RESULTS / "serve_burst_cpu.json")
        return
    args.out = args.out or RESULTS / "serve_cpu.json"
    requests, rounds = (2, 1) if args.quick else (args.requests, args.rounds)
    cells: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        export = _build_export(Path(tmp))
        servers = {b: _start_server(export, b, Path(tmp) / f"serve-b{b}.err") for b in BATCH_SIZES}
        try:
            for _, port in servers.values():  # warm-up: first-call allocations and thread pools
                for seed in range(3):
                    _complete(port, "warm-up", seed)
            progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                TextColumn("{task.completed}/{task.total} requests"), TimeRemainingColumn())  # fmt: skip
            with progress:
                task = progress.add_task(
                    "bench_serve", total=len(BATCH_SIZES) * sum(CLIENTS) * requests * rounds
                )
                for clients in CLIENTS:
                    by_batch: dict[int, list[dict[str, Any]]] = {b: [] for b in BATCH_SIZES}
                    # Side by side, the same load; who goes first alternates (drift, caches).
                    for i in range(rounds):
                        for batch_size in BATCH_SIZES if i % 2 == 0 else BATCH_SIZES[::-1]:
                            progress.update(
                                task, description=f"{clients} clients, --max-batch-size {batch_size}"
                            )
                            port = servers[batch_size][1]
                            by_batch[batch_size].append(_run_clients(port, clients, requests, progress, task))
                    cells += [_summary(b, clients, by_batch[b]) for b in BATCH_SIZES]
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(timeout=60)
    _print_table(cells)
    cfg = replace(get_model_config(PRESET), vocab_size=ByteTokenizer().vocab_size)
    report = {
        "benchmark": "serve_cpu",
        "command": f"python benchmarks/bench_serve.py --requests {requests} --rounds {rounds}",
        "model": {
            "preset": PRESET,
            "parameters": count_parameters(cfg),
            "vocab_size": cfg.vocab_size,
            "context_length": cfg.context_length,
            "tokenizer": "byte",
            "weights": "random (seed 0): throughput does not depend on the weights' values",
        },
        "load": {
            "max_tokens": MAX_TOKENS,
            "temperature": 0.8,
            "requests_per_client_per_round": requests,
            "rounds": rounds,
            "clients": list(CLIENTS),
            "max_batch_sizes": list(BATCH_SIZES),
        },
        "cells": cells,
        "batched_over_one_at_a_time_tokens_per_s": _speedups(cells),
        "machine": environment_info(),
    }
    if any(c["errors"] for c in cells):
        raise SystemExit(f"errors in {[c for c in cells if c['errors']]}")
    if not args.quick:
        write_json_atomic(args.out, report)
        _plot(cells, args.out.with_suffix(".png"))
        print(f"wrote {args.out} and {args.out.with_suffix('.png').name}")


def _speedups(cells: list[dict[str, Any]]) -> dict[str, float]:
    by_key = {(c["clients"], c["max_batch_size"]): c["generated_tokens_per_s"] for c in cells}
    low, high = BATCH_SIZES
    return {f"{n} clients": by_key[(n, high)] / by_key[(n, low)] for n in CLIENTS}


def _print_table(cells: list[dict[str, Any]]) -> None:
    table = Table(title=f"gaudi3 serve, {PRESET} (random weights), {MAX_TOKENS} tokens per request")
    for column in ("clients", "max batch", "p50 (s)", "p95 (s)", "req/s", "tokens/s", "mean batch", "errors"):
        table.add_column(column, justify="right")
    for c in cells:
        table.add_row(str(c["clients"]), str(c["max_batch_size"]), f"{c['latency_p50_s']:.3f}",
                      f"{c['latency_p95_s']:.3f}", f"{c['requests_per_s']:.2f}",
                      f"{c['generated_tokens_per_s']:,.0f}", f"{c['mean_batch_size']:.2f}", str(c["errors"]))  # fmt: skip
    Console().print(table)


def _plot(cells: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for batch_size, color in zip(BATCH_SIZES, ("#1f77b4", "#ff7f0e"), strict=True):
        mine = [c for c in cells if c["max_batch_size"] == batch_size]
        clients = [c["clients"] for c in mine]
        label = f"--max-batch-size {batch_size}"
        left.plot(clients, [c["generated_tokens_per_s"] for c in mine], marker="o", color=color, label=label)
        right.plot(clients, [c["latency_p50_s"] for c in mine], marker="o", color=color, label=f"{label} p50")
        right.plot(clients, [c["latency_p95_s"] for c in mine], marker="x", color=color, linestyle="--",
                   label=f"{label} p95")  # fmt: skip
    left.set_ylabel("generated tokens/s")
    right.set_ylabel("request latency (s)")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(CLIENTS), [str(n) for n in CLIENTS])
        ax.set_xlabel("concurrent clients")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"gaudi3 serve on CPU: {PRESET} shape, random weights, {MAX_TOKENS} tokens per request")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
