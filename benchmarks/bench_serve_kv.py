"""`gaudi3 serve` with a KV cache against recomputing the context: generated tokens/s per number of clients.

Real `gaudi3 serve` processes on 127.0.0.1 serve the same safetensors export: `--kv-cache off` (every step
re-reads each request's whole context, the path before the cache), `dynamic` (the default) and `static` (fixed
decode shapes). Models (`--model`, RANDOM weights: throughput does not depend on what the weights say, byte
tokenizer):

    gpt12-ctx512   gpt2 shape, 12 layers at context 512, width 128 (4 heads), so that the recompute server finishes
                   in a couple of minutes on 2 cores
    llama3.2-1b    Llama 3.2 1B's real shape (16 layers, width 2048, GQA 32/8 heads, 128,256-token head), its
                   context cut to 512 (the load needs 448; the static cache decodes over the whole context)
    llama-tiny     `--small`'s stand-in for llama3.2-1b on CPU (2 layers x 64, context 512)

Every client sends `--requests` completions back to back, each a 384-byte prompt (384 tokens) plus 64 sampled
tokens (temperature 0.8, seeded), so each request ends at 448 of the 512 positions; every response must be a
complete 200. Each (clients, model) group runs `--rounds` times, the modes' order alternating, and each cell pools
its rounds. The JSON is rewritten after every cell to `<out stem>.partial.json`, so a run cut short keeps what
finished there; only a run that finishes without errors replaces `--out` (a stored result is never replaced by a
partial or failed one: the partial file stays beside it, said on stderr).

`--device cuda`: the servers put the model on the GPU (serve/loading.py does when CUDA is available; `--device cpu`
hides the GPU from them). Its defaults: both full-size models, clients 1,16,64, `--max-batch-size 64`, 1 round,
`--budget-s 150`: no cell starts when its estimate (the same model and mode at fewer clients, scaled by the clients)
would end past the budget. Static decode is NOT captured in CUDA graphs: gaudi3 serve has no capture path, and the
JSON says so.

    python benchmarks/bench_serve_kv.py            # writes benchmarks/results/serve/serve_kv_cpu.json and .png
    python benchmarks/bench_serve_kv.py --quick    # 4 clients, 16 tokens each; nothing written
    timeout 240 python benchmarks/bench_serve_kv.py --device cuda --git-commit SHA   # serve_kv_cuda.json
    python benchmarks/bench_serve_kv.py --small --device cpu --budget-s 120 --out /tmp/kv.json  # the GPU run's dry-run
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_args import positive_int
from bench_serve import RESULTS, _build_export, _complete, _run_clients, _start_server, _summary
from gaudi3_scale.bench.result import write_json_atomic
from gaudi3_scale.data.tokenizers import ByteTokenizer
from gaudi3_scale.models import ModelConfig, count_parameters, get_model_config
from gaudi3_scale.models.build import model_class
from gaudi3_scale.monitor.environment import environment_info

MODES = ("dynamic", "static", "off")  # --kv-cache; off last: the one a budget skips first
SHAPE = {"num_layers": 12, "dim": 128, "num_heads": 4, "context_length": 512}
# name → (registry preset, overrides); vocab_size None → the byte tokenizer's
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt12-ctx512": ("shakespeare-char", SHAPE),
    "llama3.2-1b": ("llama3.2-1b", {"context_length": 512}),
    "llama-tiny": ("llama-tiny", {"context_length": 512}),
}
PROMPT_TOKENS, MAX_TOKENS, CLIENTS, MAX_BATCH = 384, 64, 16, 8
FILLER = "O, what a rogue and peasant slave am I! Is it not monstrous that this player here, "
CUDA_GRAPHS = (
    "not captured: gaudi3 serve has no CUDA-graph path; --kv-cache static only keeps the decode step's shapes "
    "fixed (serve/decoding.py CachedDecoder.decode_step), nothing captures or replays it"
)


def _prompt(client: int, request: int, length: int = PROMPT_TOKENS) -> str:
    """`length` bytes (one token each with the byte tokenizer), different for every request."""
    head = f"Client {client}, request {request}: "
    return (head + FILLER * (length // len(FILLER) + 1))[:length]


def _model_config(name: str) -> ModelConfig:
    preset, overrides = MODELS[name]
    cfg = replace(get_model_config(preset), **overrides)
    return cfg if cfg.vocab_size is not None else replace(cfg, vocab_size=ByteTokenizer().vocab_size)


def _csv(kind: type, text: str) -> list[Any]:
    return [kind(part.strip()) for part in text.split(",") if part.strip()]


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the servers run")
    parser.add_argument("--small", action="store_true",
                        help="the CPU dry-run of the GPU set: gpt12-ctx512 and llama-tiny, clients 1,4, 16 tokens")  # fmt: skip
    parser.add_argument("--model", help=f"comma-separated, from {', '.join(MODELS)} "
                        "(default: gpt12-ctx512 on cpu, with llama3.2-1b on cuda)")  # fmt: skip
    parser.add_argument(
        "--clients", help="comma-separated client counts (default: 16 on cpu, 1,16,64 on cuda)"
    )
    parser.add_argument(
        "--max-batch-size", type=positive_int, help="of every server (default: 8 on cpu, 64 on cuda)"
    )
    parser.add_argument("--requests", type=positive_int, default=1, help="requests per client per round")
    parser.add_argument("--rounds", type=positive_int, help="rounds per group, the modes' order alternated (default: 2 on "
                        "cpu, 1 on cuda and with --small)")  # fmt: skip
    parser.add_argument("--threads", type=positive_int, default=1, help="OMP_NUM_THREADS of every server")
    parser.add_argument("--budget-s", type=float, help="stop starting cells past this many seconds since the "
                        "start (default: 150 on cuda and with --small, none on cpu)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="4 clients, 16 tokens, 1 round; nothing written")
    parser.add_argument(
        "--git-commit", help="the commit measured (default: git rev-parse HEAD, when there is .git)"
    )
    parser.add_argument("--out", type=Path,
                        help="default: benchmarks/results/serve/serve_kv_<device>.json (_small.json with --small)")  # fmt: skip
    args = parser.parse_args()
    cuda, small = args.device == "cuda", args.small or args.quick
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    default_models = (
        "gpt12-ctx512,llama-tiny" if args.small else "gpt12-ctx512,llama3.2-1b" if cuda else "gpt12-ctx512"
    )
    try:
        args.models = _csv(str, args.model or default_models)
        args.clients = _csv(int, args.clients or ("4" if args.quick else "1,4" if args.small else "1,16,64" if cuda
                                                  else str(CLIENTS)))  # fmt: skip
    except ValueError as exc:
        parser.error(f"--clients: comma-separated positive integers ({exc})")
    unknown = [m for m in args.models if m not in MODELS]
    if unknown or not args.models:
        parser.error(f"--model: unknown {', '.join(unknown) or '(none given)'}; valid: {', '.join(MODELS)}")
    if not args.clients or min(args.clients) < 1:
        parser.error("--clients: comma-separated positive integers")
    args.max_batch_size = args.max_batch_size or (64 if cuda else MAX_BATCH)
    args.rounds = 1 if args.quick else args.rounds or (1 if cuda or small else 2)
    args.max_tokens = 16 if small else MAX_TOKENS
    args.budget_s = args.budget_s or (150.0 if cuda or args.small else None)
    for name in ("max_batch_size", "requests", "rounds", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.budget_s is not None and args.budget_s <= 0:
        parser.error(f"--budget-s must be positive, got {args.budget_s}")
    # --small never overwrites the committed full-size results
    args.out = args.out or RESULTS / f"serve_kv_{args.device}{'_small' if args.small else ''}.json"
    return args


def main() -> None:
    started = time.perf_counter()
    args = _parse()
    # under `timeout`: SIGTERM unwinds through the `finally` that stops the servers
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the servers inherit it
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # serve moves the model to a GPU whenever it sees one
    configs = {m: _model_config(m) for m in args.models}
    report = _report_head(args, configs)
    by_cell: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        servers, report["gpu_memory_used_by_servers_bytes"] = _start_servers(Path(tmp), configs, args)
        try:
            for _, port in servers.values():  # warm-up: first-call allocations and thread pools
                _complete(port, _prompt(0, 0), 0, max_tokens=4)
            report["startup_s"] = time.perf_counter() - started
            total = sum(args.clients) * len(args.models) * len(MODES) * args.requests * args.rounds
            progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                TextColumn("{task.completed}/{task.total} requests"), TimeRemainingColumn())  # fmt: skip
            with progress:
                task = progress.add_task("bench_serve_kv", total=total)
                for clients in args.clients:
                    for model in args.models:
                        modes = _modes_to_run(report, model, clients, args, time.perf_counter() - started)
                        _record(report, by_cell, args, started)  # the skipped too, should nothing run after
                        for i in range(args.rounds):
                            for mode in modes if i % 2 == 0 else modes[::-1]:
                                progress.update(
                                    task, description=f"{model}, {clients} clients, --kv-cache {mode}"
                                )
                                by_cell.setdefault((clients, model, mode), []).append(
                                    _run_clients(servers[model, mode][1], clients, args.requests, progress, task,
                                                 _prompt, args.max_tokens))  # fmt: skip
                                _record(report, by_cell, args, started)
                        progress.advance(
                            task, (len(MODES) - len(modes)) * clients * args.requests * args.rounds
                        )
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(timeout=60)
    _print_table(report)
    print(f"verdict: {report['verdict']}")
    errors = any(c["errors"] for c in report["cells"])
    if not args.quick:
        written = _partial(args.out)
        if errors and args.out.is_file():
            print(f"kept {args.out}: this run had errors; its cells are in {written}", file=sys.stderr)
        else:
            write_json_atomic(args.out, report)
            written.unlink(missing_ok=True)
            written = args.out
        _plot(report, written.with_suffix(".png"))
        print(f"wrote {written} and {written.with_suffix('.png').name}")
    if errors:
        raise SystemExit(f"errors in {[c for c in report['cells'] if c['errors']]}")


def _start_servers(
    tmp: Path, configs: dict[str, ModelConfig], args: argparse.Namespace
) -> tuple[dict[tuple[str, str], tuple[Any, int]], int | None]:
    """Every (model, mode) server, started together; the GPU memory they took (None on cpu)."""
    exports = {}
    for name, cfg in configs.items():
        (tmp / name).mkdir()
        big = count_parameters(cfg) > 100e6
        exports[name] = _build_export(tmp / name, cfg, _random_model(cfg, args.device) if big else None)
    if args.device == "cuda":
        torch.cuda.empty_cache()  # what the draws left cached is not the servers'
    free_before = torch.cuda.mem_get_info()[0] if args.device == "cuda" else None
    keys = [(m, mode) for m in configs for mode in MODES]
    with ThreadPoolExecutor(len(keys)) as pool:
        futures = [pool.submit(_start_server, exports[m], args.max_batch_size, tmp / f"serve-{m}-{mode}.err",
                               ["--kv-cache", mode]) for m, mode in keys]  # fmt: skip
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:  # stop the ones that did start before saying why the others did not
        for future in futures:
            if future.exception() is None:
                future.result()[0].terminate()
        raise failed[0]
    servers = {key: future.result() for key, future in zip(keys, futures, strict=True)}
    used = None if free_before is None else free_before - torch.cuda.mem_get_info()[0]
    return servers, used


def _random_model(cfg: ModelConfig, device: str) -> nn.Module:
    """Plain N(0, 0.02) draws on `device`, stored in bf16: `build_model`'s init draws on the host, 1-3 min for
    Llama 3.2 1B on few cores, and the values do not matter here (serve loads them into float32 all the same)."""
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    model.to_empty(device=device)
    generator = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02, generator=generator)
    return model.to(torch.bfloat16).cpu()


def _modes_to_run(report: dict[str, Any], model: str, clients: int, args: argparse.Namespace,
                  elapsed_s: float) -> tuple[str, ...]:  # fmt: skip
    """The modes whose cells fit the budget, each estimated from the same model and mode at the most clients so
    far (its wall time x the clients' ratio: an upper bound for a batching server); the others recorded skipped."""
    modes: list[str] = []
    planned_s = elapsed_s
    for mode in MODES:
        reason, done = None, [c for c in report["cells"] if c["model"] == model and c["kv_cache"] == mode]
        if args.budget_s is None:
            pass
        elif any(s["model"] == model and s["kv_cache"] == mode for s in report["skipped"]):
            reason = "skipped at fewer clients"
        elif planned_s >= args.budget_s:
            reason = "budget spent"
        elif done:
            estimate_s = done[-1]["wall_s"] * clients / done[-1]["clients"]
            if planned_s + estimate_s > args.budget_s:
                reason = (
                    f"estimated to end at {planned_s + estimate_s:.1f} s, past the {args.budget_s:g} s budget"
                )
            planned_s += 0 if reason else estimate_s
        if reason is None:
            modes.append(mode)
        else:
            report["skipped"].append({"model": model, "clients": clients, "kv_cache": mode, "reason": reason})
    return tuple(modes)


def _report_head(args: argparse.Namespace, configs: dict[str, ModelConfig]) -> dict[str, Any]:
    machine = environment_info()
    return {
        "benchmark": f"serve_kv_{args.device}",
        "command": shlex.join(["python", "benchmarks/bench_serve_kv.py", *sys.argv[1:]]),
        "device": args.device,
        "git_commit": args.git_commit or machine["git_commit"],
        "models": {name: {"preset": MODELS[name][0], "arch": cfg.arch, "num_layers": cfg.num_layers, "dim": cfg.dim,
                          "num_heads": cfg.num_heads, "kv_heads": cfg.kv_heads, "context_length": cfg.context_length,
                          "parameters": count_parameters(cfg), "vocab_size": cfg.vocab_size, "tokenizer": "byte",
                          "served_dtype": "float32 (serve loads exports into float32)",
                          "weights": "random (seed 0): throughput does not depend on the weights' values"}
                   for name, cfg in configs.items()},
        "load": {"clients": args.clients, "prompt_tokens": PROMPT_TOKENS, "max_tokens": args.max_tokens,
                 "temperature": 0.8, "requests_per_client_per_round": args.requests, "rounds": args.rounds,
                 "max_batch_size": args.max_batch_size, "server_threads": args.threads},
        "budget_s": args.budget_s,
        "cuda_graphs": CUDA_GRAPHS if args.device == "cuda" else "n/a on cpu",
        "goal": "dynamic KV cache >= 5x the recompute path's tokens/s",
        "cells": [],
        "skipped": [],
        "machine": machine,
    }  # fmt: skip


def _partial(out: Path) -> Path:
    """Where a run writes its cells while it runs (see the module docstring)."""
    return out.with_name(f"{out.stem}.partial.json")


def _record(report: dict[str, Any], by_cell: dict[tuple[int, str, str], list[dict[str, Any]]],
            args: argparse.Namespace, started: float) -> None:  # fmt: skip
    """Cells, ratios and verdict from what ran so far; the partial JSON rewritten (not with --quick)."""
    report["cells"] = [{"model": model, "kv_cache": mode, **_summary(args.max_batch_size, clients, rounds)}
                       for (clients, model, mode), rounds in by_cell.items()]  # fmt: skip
    ratios: dict[str, dict[str, dict[str, float]]] = {}
    for c in report["cells"]:
        off = _tokens_per_s(report, c["model"], c["clients"], "off")
        if off:
            ratios.setdefault(c["model"], {}).setdefault(str(c["clients"]), {})[c["kv_cache"]] = (
                c["generated_tokens_per_s"] / off
            )
    report["tokens_per_s_over_recompute"] = ratios
    report["elapsed_s"] = time.perf_counter() - started
    report["verdict"] = verdict(report)
    if not args.quick:
        write_json_atomic(_partial(args.out), report)


def _tokens_per_s(report: dict[str, Any], model: str, clients: int, mode: str) -> float | None:
    for c in report["cells"]:
        if (c["model"], c["clients"], c["kv_cache"]) == (model, clients, mode):
            return float(c["generated_tokens_per_s"])
    return None


def verdict(report: dict[str, Any]) -> str:
    """One line: per model, static over dynamic at the most clients both ran, dynamic over off likewise."""
    parts = []
    for model in report["models"]:
        said = []
        for over, under in (("static", "dynamic"), ("dynamic", "off")):
            both = [c["clients"] for c in report["cells"] if c["model"] == model and c["kv_cache"] == over
                    and _tokens_per_s(report, model, c["clients"], under)]  # fmt: skip
            if both:
                n = max(both)
                ratio = _tokens_per_s(report, model, n, over) / _tokens_per_s(report, model, n, under)  # type: ignore[operator]
                said.append(f"{over}/{under} x{ratio:.2f} at {n} clients")
        parts.append(f"{model}: {', '.join(said) or 'no pair measured'}")
    errors = sum(c["errors"] for c in report["cells"])
    ran = f"{len(report['cells'])} cells ran, {len(report['skipped'])} skipped, {errors} errors"
    used = report.get("gpu_memory_used_by_servers_bytes")
    on_gpu = [] if used is None else [f"the servers took {used / 2**30:.1f} GiB of the GPU"]  # 0: not on it
    return "; ".join([*parts, ran, *on_gpu, f"cuda graphs: {report['cuda_graphs']}"])


def _print_table(report: dict[str, Any]) -> None:
    table = Table(title=f"gaudi3 serve on {report['device']} (random weights), {report['load']['prompt_tokens']}"
                        f"-token prompts + {report['load']['max_tokens']} tokens")  # fmt: skip
    for column in ("model", "clients", "--kv-cache", "p50 (s)", "p95 (s)", "tokens/s", "x off", "mean batch",
                   "requests", "errors"):  # fmt: skip
        table.add_column(column, justify="right")
    for c in report["cells"]:
        ratio = (
            report["tokens_per_s_over_recompute"]
            .get(c["model"], {})
            .get(str(c["clients"]), {})
            .get(c["kv_cache"])
        )
        table.add_row(c["model"], str(c["clients"]), c["kv_cache"], f"{c['latency_p50_s']:.2f}",
                      f"{c['latency_p95_s']:.2f}", f"{c['generated_tokens_per_s']:,.1f}",
                      "-" if ratio is None else f"{ratio:.1f}", f"{c['mean_batch_size']:.2f}", str(c["requests"]),
                      str(c["errors"]))  # fmt: skip
    for s in report["skipped"]:
        table.add_row(s["model"], str(s["clients"]), s["kv_cache"], "skipped", s["reason"], *[""] * 5)
    console = Console()
    if not console.is_terminal:  # a log file: rich's 80 columns would cut every name
        console.width = 160
    console.print(table)


def _plot(report: dict[str, Any], path: Path) -> None:
    """Per model: tokens/s and p50 latency, grouped by clients, a bar per --kv-cache mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(report["models"])
    fig, axes = plt.subplots(2, len(models), figsize=(4.5 * len(models) + 0.5, 6.4), squeeze=False)
    colors = {"off": "#7f7f7f", "dynamic": "#1f77b4", "static": "#ff7f0e"}
    clients = report["load"]["clients"]
    for col, model in enumerate(models):
        for row, (key, label) in enumerate((("generated_tokens_per_s", "generated tokens/s"),
                                            ("latency_p50_s", "p50 request latency (s)"))):  # fmt: skip
            ax = axes[row][col]
            for k, mode in enumerate(MODES):
                cells = {
                    c["clients"]: c[key]
                    for c in report["cells"]
                    if c["model"] == model and c["kv_cache"] == mode
                }
                xs = [i + (k - 1) * 0.27 for i, n in enumerate(clients) if n in cells]
                ax.bar(xs, [cells[n] for n in clients if n in cells], width=0.27, color=colors[mode],
                       label=f"--kv-cache {mode}")  # fmt: skip
            ax.set_xticks(range(len(clients)), [f"{n} clients" for n in clients])
            ax.set_ylabel(label)
            ax.grid(alpha=0.3, axis="y")
            if row == 0:
                ax.set_title(model, fontsize=9)
        axes[0][col].legend(fontsize=7)
    machine = report["machine"]
    device = (machine.get("cuda") or {}).get("device") or machine.get("cpu")
    fig.suptitle(f"gaudi3 serve on {device}: {report['load']['prompt_tokens']}-token prompts + "
                 f"{report['load']['max_tokens']} tokens, --max-batch-size {report['load']['max_batch_size']}",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
