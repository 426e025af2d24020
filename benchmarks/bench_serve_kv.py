"""`gaudi3 serve` with a KV cache against recomputing the context: generated tokens/s at 16 concurrent clients.

Three real `gaudi3 serve` processes on 127.0.0.1 serve the same safetensors export: `--kv-cache off` (every step
re-reads each request's whole context, the path before the cache), `dynamic` (the default) and `static` (fixed
decode shapes). The model: gpt2 shape, 12 layers at context 512, width 128 (4 heads) so that the recompute
server finishes in a couple of minutes on 2 cores, byte tokenizer, RANDOM weights (throughput does not depend on
what the weights say). Every client sends `--requests` completions back to back, each a 384-byte prompt (384
tokens) plus 64 sampled tokens (temperature 0.8, seeded), so each request ends at 448 of the 512 positions; every
response must be a complete 200. All servers run `--max-batch-size 8` (the default) and `--threads` OpenMP
threads; the rounds alternate the servers' order and each cell pools its rounds.

    python benchmarks/bench_serve_kv.py            # writes benchmarks/results/serve/serve_kv_cpu.json and .png
    python benchmarks/bench_serve_kv.py --quick    # 4 clients, 16 tokens each; nothing written
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import RESULTS, _build_export, _complete, _run_clients, _start_server, _summary
from gaudi3_scale.data.tokenizers import ByteTokenizer
from gaudi3_scale.models import count_parameters, get_model_config
from gaudi3_scale.monitor.environment import environment_info

MODES = ("off", "dynamic", "static")  # --kv-cache
SHAPE = {"num_layers": 12, "dim": 128, "num_heads": 4, "context_length": 512}
PROMPT_TOKENS, MAX_TOKENS, CLIENTS, MAX_BATCH = 384, 64, 16, 8
FILLER = "O, what a rogue and peasant slave am I! Is it not monstrous that this player here, "


def _prompt(client: int, request: int, length: int = PROMPT_TOKENS) -> str:
    """`length` bytes (one token each with the byte tokenizer), different for every request."""
    head = f"Client {client}, request {request}: "
    return (head + FILLER * (length // len(FILLER) + 1))[:length]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=1, help="requests per client per round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per server, their order alternated")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every server")
    parser.add_argument("--quick", action="store_true", help="4 clients, 16 tokens, 1 round; nothing written")
    parser.add_argument("--out", type=Path, default=RESULTS / "serve_kv_cpu.json")
    args = parser.parse_args()
    clients, max_tokens, rounds = (4, 16, 1) if args.quick else (CLIENTS, MAX_TOKENS, args.rounds)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the servers inherit it
    cfg = replace(get_model_config("shakespeare-char"), **SHAPE, vocab_size=ByteTokenizer().vocab_size)
    by_mode: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        export = _build_export(Path(tmp), cfg)
        servers = {m: _start_server(export, MAX_BATCH, Path(tmp) / f"serve-{m}.err", ["--kv-cache", m])
                   for m in MODES}  # fmt: skip
        try:
            for _, port in servers.values():  # warm-up: first-call allocations and thread pools
                _complete(port, _prompt(0, 0), 0, max_tokens=4)
            progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                TextColumn("{task.completed}/{task.total} requests"), TimeRemainingColumn())  # fmt: skip
            with progress:
                task = progress.add_task(
                    "bench_serve_kv", total=len(MODES) * clients * args.requests * rounds
                )
                for i in range(rounds):
                    for mode in MODES if i % 2 == 0 else MODES[::-1]:
                        progress.update(task, description=f"{clients} clients, --kv-cache {mode}")
                        by_mode[mode].append(_run_clients(servers[mode][1], clients, args.requests, progress,
                                                          task, _prompt, max_tokens))  # fmt: skip
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(timeout=60)
    cells = [{"kv_cache": m, **_summary(MAX_BATCH, clients, by_mode[m])} for m in MODES]
    speedups = {
        m: c["generated_tokens_per_s"] / cells[0]["generated_tokens_per_s"]
        for m, c in zip(MODES, cells, strict=True)
    }
    _print_table(cells, speedups)
    if any(c["errors"] for c in cells):
        raise SystemExit(f"errors in {[c for c in cells if c['errors']]}")
    if args.quick:
        return
    report = {
        "benchmark": "serve_kv_cpu",
        "command": f"python benchmarks/bench_serve_kv.py --requests {args.requests} --rounds {rounds} "
        f"--threads {args.threads}",
        "model": {"arch": cfg.arch, **SHAPE, "parameters": count_parameters(cfg), "vocab_size": cfg.vocab_size,
                  "tokenizer": "byte", "weights": "random (seed 0): throughput does not depend on the weights' values"},
        "load": {"clients": clients, "prompt_tokens": PROMPT_TOKENS, "max_tokens": max_tokens, "temperature": 0.8,
                 "requests_per_client_per_round": args.requests, "rounds": rounds, "max_batch_size": MAX_BATCH,
                 "server_threads": args.threads},
        "cells": cells,
        "tokens_per_s_over_recompute": speedups,
        "goal": "dynamic KV cache >= 5x the recompute path's tokens/s",
        "machine": environment_info(),
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    _plot(cells, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png').name}")


def _print_table(cells: list[dict[str, Any]], speedups: dict[str, float]) -> None:
    clients = cells[0]["clients"]
    table = Table(title=f"gaudi3 serve, 12 layers x 128 at context 512 (random weights), {clients} clients")
    for column in (
        "--kv-cache",
        "p50 (s)",
        "p95 (s)",
        "tokens/s",
        "x off",
        "mean batch",
        "requests",
        "errors",
    ):
        table.add_column(column, justify="right")
    for c in cells:
        table.add_row(c["kv_cache"], f"{c['latency_p50_s']:.2f}", f"{c['latency_p95_s']:.2f}",
                      f"{c['generated_tokens_per_s']:,.1f}", f"{speedups[c['kv_cache']]:.1f}",
                      f"{c['mean_batch_size']:.2f}", str(c["requests"]), str(c["errors"]))  # fmt: skip
    Console().print(table)


def _plot(cells: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    names = [f"--kv-cache {c['kv_cache']}" for c in cells]
    colors = ["#7f7f7f", "#1f77b4", "#ff7f0e"]
    left.bar(names, [c["generated_tokens_per_s"] for c in cells], color=colors)
    left.set_ylabel("generated tokens/s")
    right.bar(names, [c["latency_p50_s"] for c in cells], color=colors)
    right.set_ylabel("p50 request latency (s)")
    for ax in (left, right):
        ax.grid(alpha=0.3, axis="y")
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"gaudi3 serve on CPU: 12 layers x 128, context 512, {CLIENTS} clients, "
                 f"{PROMPT_TOKENS}-token prompts + {MAX_TOKENS} tokens")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
