"""`gaudi3 train` on a set of shapes, each held against what the project forecasts for it: peak memory (the
estimator, `tune.memory`) and step time (the cost planner's FLOPs ÷ (peak × MFU)); fp8 speed-ups from the pairs.

Each shape is one real `gaudi3 train` run in a fresh process (synthetic ids of the shape's vocabulary, checkpoints
and validation off), timed by the trainer itself (steady state over its measured steps, device-synchronised). Per
shape the JSON keeps what the run measured (`peak_memory_bytes`: `torch.cuda.max_memory_allocated` on CUDA, peak
RSS on CPU; step time, tokens/s, MFU, warm-up and wall time), the forecasts, and their errors:

* memory: `estimate_memory` for the run's resolved config (strategy, precision, micro-batch, activation
  checkpointing, device kind), error = (estimate − measured) / measured;
* step time: the cost planner's former model (training FLOPs ÷ (peak dense BF16 FLOP/s × MFU 0.40)): what
  `gaudi3 cost compare` assumed for a run it had no benchmark for, before it took `gaudi3 plan`'s step
  (`forecast.model`, docs/foresight.md); kept as it was, so the stored runs' column means what it meant.

fp8: every fp8 shape with a bf16 shape of the same model and batch gives `fp8_over_bf16_tokens_per_s`. Only two
rows measured by the same invocation (the same `measured_with.run_id`) are side by side; a ratio of rows from
different invocations (another lease, a cold vs a warm machine, another commit) is kept but marked
`"side_by_side": false`, and the verdict says so.

Each row carries what it was measured with (`measured_with`: machine, peak FLOP/s, the invocation's `run_id`); the
top-level `machine` is the last invocation's. A shape that did not run "ok" (failed, timed out, skipped for the
budget) never replaces a stored row that did: that stays, the attempt goes under its `failed_attempts`.

The shapes run in order and each gets `--run-timeout-s` (default 240 s) but never more than what is left of
`--budget-s`: a device lease cut short still leaves every finished shape in the JSON (written after each run).

    python benchmarks/bench_gpu_shapes.py                     # the GPU set (results/gpu_shapes_cuda.json + .png)
    python benchmarks/bench_gpu_shapes.py --shapes gpt2-mb32-eager,llama3.2-1b-bf16 --budget-s 300
    python benchmarks/bench_gpu_shapes.py --shapes moe-1b-top2,bert-base-mb32 --budget-s 120  # MoE and BERT, 50 steps
    python benchmarks/bench_gpu_shapes.py --small             # the tiny CPU set (the default without CUDA)
    python benchmarks/bench_gpu_shapes.py --list
    python benchmarks/bench_gpu_shapes.py --rescore A.json B.json --out C.json  # no device: merge, forecast anew

`--rescore` merges the shapes of earlier result files (a later file's shape replaces an earlier one's) and holds the
forecasts of the code as it is now against their measurements: a model changed on a CPU is checked against the GPU
runs without a GPU. The measurements and the machine they ran on are kept as they were.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_args import positive_int
from bench_gpu import RESULTS, ROOT, Cell, _model_config, _peak_flops, run_gaudi3
from gaudi3_scale.bench.result import keep_good_entry, load_stored_results, write_json_atomic

# What `gaudi3 cost compare` assumed without a benchmark before it took gaudi3 plan's step (its default MFU then).
COST_PLANNER_MFU = 0.40


def _llama(size: str, precision: str, mb: int, **change: Any) -> Cell:
    suffix = "-bf16" if precision == "bf16-mixed" else "-fp8"
    suffix += "-head" if change.get("fp8_head") else ""
    suffix += f"-{change['fp8_recipe']}" if change.get("fp8_recipe", "tensorwise") != "tensorwise" else ""
    suffix += "-skip-small" if change.get("fp8_skip_small_linears") else ""
    suffix += "-ckpt" if change.get("activation_checkpointing") else ""
    return Cell(name=f"llama3.2-{size}{suffix}", model=f"llama3.2-{size}", vocab_size=128256, context_length=2048,
                micro_batch_size=mb, precision=precision, compile=True, warmup_steps=5, measured_steps=20,
                **change)  # fmt: skip


def _gpt2(compile: bool) -> Cell:
    return Cell(name=f"gpt2-mb32-{'compiled' if compile else 'eager'}", model="gpt2-124m",
                model_overrides={"bias": False}, vocab_size=50257, context_length=1024, micro_batch_size=32,
                precision="bf16-mixed", compile=compile, warmup_steps=5 if compile else 2, measured_steps=20)  # fmt: skip


# A mixture of experts of about 1 B parameters (0.4 B active): Llama blocks of width 1024, 8 SwiGLU experts of
# width 2816, top-2; Llama 3's vocabulary replaced by a 32k one, as Mixtral's.
_MOE = {"num_layers": 12, "dim": 1024, "num_heads": 16, "num_kv_heads": 8, "ffn_dim": 2816, "num_experts": 8,
        "experts_per_token": 2}  # fmt: skip

# In priority order: the fp8 pairs first (the speed-up goal), then the estimator's shapes, then the rest.
GPU_SHAPES = [
    _llama("1b", "bf16-mixed", 8),
    _llama("1b", "fp8", 8, fp8_head=True),
    _llama("3b", "bf16-mixed", 2),
    _llama("3b", "fp8", 2, fp8_head=True),
    _gpt2(False),
    _gpt2(True),
    _llama("1b", "bf16-mixed", 8, activation_checkpointing=True),
    Cell(name="moe-1b-top2", model="moe-tiny", model_overrides=_MOE, vocab_size=32000, context_length=2048,
         micro_batch_size=8, precision="bf16-mixed", compile=True, warmup_steps=5, measured_steps=50),
    Cell(name="bert-base-mb32", model="bert-base", vocab_size=30522, data_vocab_size=30518, context_length=512,
         micro_batch_size=32, precision="bf16-mixed", compile=True, warmup_steps=5, measured_steps=50),
    _llama("1b", "fp8", 8),
    _llama("1b", "fp8", 8, fp8_head=True, fp8_recipe="rowwise"),
    _llama("1b", "fp8", 8, fp8_head=True, fp8_skip_small_linears=True),
]  # fmt: skip

_TINY_LLAMA = {"num_layers": 2, "dim": 64, "num_heads": 4, "num_kv_heads": 2, "ffn_dim": 192}
CPU_SHAPES = [
    Cell(name="tiny-gpt2-eager", model="shakespeare-char", model_overrides={"num_layers": 2, "num_heads": 2, "dim": 64},
         vocab_size=512, context_length=64, micro_batch_size=8, precision="32-true", compile=False, warmup_steps=2,
         measured_steps=20),
    Cell(name="tiny-llama-ckpt", model="llama-tiny", model_overrides=_TINY_LLAMA, vocab_size=512, context_length=64,
         micro_batch_size=8, precision="32-true", compile=False, warmup_steps=2, measured_steps=20,
         activation_checkpointing=True),
    Cell(name="tiny-moe", model="moe-tiny", vocab_size=512, context_length=64, micro_batch_size=8,
         precision="32-true", compile=False, warmup_steps=2, measured_steps=20),
    Cell(name="tiny-bert", model="bert-tiny", vocab_size=516, data_vocab_size=512, context_length=64, micro_batch_size=8,
         precision="32-true", compile=False, warmup_steps=2, measured_steps=20),
]  # fmt: skip


def forecast(cell: Cell, device: str, peak_flops: float | None) -> dict[str, Any]:
    """The estimator's peak memory and the cost planner's step time for `cell`, as the run resolves it."""
    from gaudi3_scale.device.float8 import Float8Plan
    from gaudi3_scale.distributed.plan import BatchPlan, ParallelPlan
    from gaudi3_scale.models import count_parameters, flops_per_token, get_model_config
    from gaudi3_scale.tune.memory import estimate_memory

    model = _model_config(cell, get_model_config).resolve_padding(device)
    float8 = Float8Plan(
        recipe=cell.fp8_recipe, head=cell.fp8_head, skip_small_linears=cell.fp8_skip_small_linears
    )  # type: ignore[arg-type]
    plan = ParallelPlan.build(
        activation_checkpointing=cell.activation_checkpointing,
        compile=cell.compile,
        float8=float8 if cell.precision == "fp8" else None,
    )
    batch = BatchPlan.from_micro_batch(cell.micro_batch_size, context_length=cell.context_length)
    est = estimate_memory(model, plan, batch, precision=cell.precision, device_kind=device)
    out: dict[str, Any] = {
        "memory_bytes": est.total_bytes,
        "memory_parts_bytes": {**dict(est.rows()), "peak_phase": est.peak_phase},
        # MFU's FLOPs count a mixture of experts' *active* parameters (models/counting.py): both counts shown.
        "flops_per_token": flops_per_token(model),
        "parameters": count_parameters(model),
        "active_parameters": count_parameters(model, active=True),
    }
    if peak_flops:
        out["step_time_s"] = out["flops_per_token"] * batch.tokens_per_step / (peak_flops * COST_PLANNER_MFU)
        out["step_time_source"] = f"cost planner: FLOPs ÷ (peak × MFU {COST_PLANNER_MFU}, its default)"
    return out


def _relative(predicted: float | None, measured: float | None) -> float | None:
    return None if not predicted or not measured else (predicted - measured) / measured


def measure(cell: Cell, device: str, peak_flops: float | None, env: dict[str, str], tmp: Path,
            timeout_s: float) -> dict[str, Any]:  # fmt: skip
    run = run_gaudi3(cell, tmp / cell.name, env, timeout_s=timeout_s)
    row = _score({"cell": asdict(cell), "run": run}, device, peak_flops)
    if run.get("status") == "ok" and peak_flops:
        row["mfu"] = run["tokens_per_s"] * row["forecast"]["flops_per_token"] / peak_flops
    return row


def _score(row: dict[str, Any], device: str, peak_flops: float | None) -> dict[str, Any]:
    """`row` with the forecast of the code as it is and, for a run that finished, the errors against it."""
    row["forecast"] = fc = forecast(Cell(**row["cell"]), device, peak_flops)
    row.pop("memory_error", None), row.pop("step_time_error", None)
    run = row["run"]
    if run.get("status") == "ok":
        row["memory_error"] = _relative(fc["memory_bytes"], run["peak_memory_bytes"])
        row["step_time_error"] = _relative(fc.get("step_time_s"), run["step_time_s"])
    return row


def _run_ok(row: dict[str, Any]) -> bool:
    return row.get("run", {}).get("status") == "ok"


def _run_id(row: dict[str, Any]) -> str | None:
    return (row.get("measured_with") or {}).get("run_id")


def fp8_pairs(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each fp8 shape against the bf16 shape of the same model, batch and layout; `side_by_side` only when one
    invocation measured both (rows without a `run_id`, written before it was recorded, are not)."""
    pairs: dict[str, dict[str, Any]] = {}
    for name, row in rows.items():
        cell = row["cell"]
        if cell["precision"] != "fp8" or row["run"].get("status") != "ok":
            continue
        for other in rows.values():
            c = other["cell"]
            same = all(c[k] == cell[k] for k in ("model", "micro_batch_size", "context_length",
                                                  "activation_checkpointing", "compile"))  # fmt: skip
            if same and c["precision"] == "bf16-mixed" and other["run"].get("status") == "ok":
                pairs[name] = {
                    "bf16": c["name"],
                    "side_by_side": _run_id(row) is not None and _run_id(row) == _run_id(other),
                    "fp8_over_bf16_tokens_per_s": row["run"]["tokens_per_s"] / other["run"]["tokens_per_s"],
                    "peak_memory_fp8_over_bf16": row["run"]["peak_memory_bytes"]
                    / other["run"]["peak_memory_bytes"],
                }
    return pairs


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["shapes"].values() if r["run"].get("status") == "ok"]
    if not rows:
        return
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(rows)), 4.2), dpi=110)
    xs = range(len(rows))
    names = [r["cell"]["name"] for r in rows]
    panels = (
        (axes[0], "GiB", lambda r: r["run"]["peak_memory_bytes"] / 2**30,
         lambda r: r["forecast"]["memory_bytes"] / 2**30, "memory_error", "peak memory: measured vs estimator"),
        (axes[1], "ms per step", lambda r: r["run"]["step_time_s"] * 1e3,
         lambda r: (r["forecast"].get("step_time_s") or 0) * 1e3, "step_time_error",
         f"step time: measured vs cost planner (MFU {COST_PLANNER_MFU})"),
    )  # fmt: skip
    for ax, unit, measured, predicted, err, title in panels:
        ax.bar([x - 0.2 for x in xs], [measured(r) for r in rows], width=0.4, label="measured")
        ax.bar([x + 0.2 for x in xs], [predicted(r) for r in rows], width=0.4, label="forecast")
        for x, r in zip(xs, rows, strict=True):
            if r.get(err) is not None:
                top = max(measured(r), predicted(r))
                ax.annotate(f"{r[err]:+.0%}", (x, top), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(xs), names, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel(unit)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    machine = results["machine"]
    device = (machine.get("cuda") or {}).get("device") or machine.get("cpu")
    fig.suptitle(f"gaudi3 train on {device}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def verdict(results: dict[str, Any]) -> str:
    rows = results["shapes"]
    ok = [r for r in rows.values() if r["run"].get("status") == "ok"]
    mem = [r["memory_error"] for r in ok if r.get("memory_error") is not None]
    step = [r["step_time_error"] for r in ok if r.get("step_time_error") is not None]
    parts = [f"{len(ok)}/{len(rows)} shapes ran"]
    if mem:
        inside = sum(abs(e) <= 0.10 for e in mem)
        parts.append(f"memory estimate {min(mem):+.1%} … {max(mem):+.1%} ({inside}/{len(mem)} within ±10 %)")
    if step:
        parts.append(f"cost-planner step time {min(step):+.0%} … {max(step):+.0%}")
    pairs = results.get("fp8", {})
    if pairs:
        best = max(pairs, key=lambda k: pairs[k]["fp8_over_bf16_tokens_per_s"])
        ratio = pairs[best]["fp8_over_bf16_tokens_per_s"]
        apart = "" if pairs[best].get("side_by_side") else ", not side by side: rows of different runs"
        parts.append(
            f"best fp8 {best} ×{ratio:.3f} bf16 ({'meets' if ratio >= 1.3 else 'below'} the 1.3× goal{apart})"
        )
    return "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--small", action="store_true", help="the tiny CPU set (the default without CUDA)")
    parser.add_argument(
        "--shapes", help="comma-separated shape names, run in this order (default: the whole set)"
    )
    parser.add_argument("--measured-steps", type=positive_int, help="override every shape's measured steps")
    parser.add_argument("--budget-s", type=float, default=3600.0, help="stop starting shapes after this long")
    parser.add_argument(
        "--run-timeout-s", type=float, default=240.0, help="the most one shape's run may take"
    )
    parser.add_argument(
        "--out", type=Path, help="result JSON (merged by shape; default results/gpu_shapes_<device>.json)"
    )
    parser.add_argument("--list", action="store_true", help="print the shapes and exit")
    parser.add_argument(
        "--rescore", nargs="+", type=Path, metavar="JSON",
        help="run nothing: merge these result files and forecast their shapes with the code as it is (needs --out)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.rescore:
        if args.out is None:
            parser.error("--rescore needs --out (where the merged, re-forecast results go)")
        missing = [str(p) for p in args.rescore if not p.is_file()]
        if missing:
            parser.error(f"--rescore: no such result file: {', '.join(missing)}")
        try:
            rescore(args.rescore, args.out)
        except ValueError as exc:
            parser.error(f"--rescore: {exc}")
        return
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # kills the run in flight

    import torch
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from gaudi3_scale.monitor.environment import environment_info

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cuda", "cpu"):
        parser.error(f"--device must be cuda or cpu, got {device!r}")
    shapes = CPU_SHAPES if args.small or device == "cpu" else GPU_SHAPES
    if args.list:
        for c in shapes:
            print(f"{c.name:32s} {c.model} mb {c.micro_batch_size} ctx {c.context_length} {c.precision} "
                  f"{'compiled' if c.compile else 'eager'}{' act.ckpt' if c.activation_checkpointing else ''}")  # fmt: skip
        return
    if args.shapes:
        by_name = {c.name: c for c in shapes}
        wanted = [s.strip() for s in args.shapes.split(",") if s.strip()]
        unknown = [s for s in wanted if s not in by_name]
        if unknown:
            parser.error(f"unknown shape(s) {', '.join(unknown)}; valid: {', '.join(by_name)}")
        shapes = [by_name[s] for s in wanted]
    if args.measured_steps is not None:
        shapes = [replace(c, measured_steps=args.measured_steps) for c in shapes]
    if args.budget_s <= 0 or args.run_timeout_s <= 0:
        parser.error("--budget-s and --run-timeout-s must be positive")
    out = args.out or RESULTS / f"gpu_shapes_{device}.json"
    try:
        results = load_stored_results(out, {"shapes": {}})
    except ValueError as err:
        parser.error(str(err))
    peak, peak_source = _peak_flops(device)
    results.update(benchmark="bench_gpu_shapes", machine=environment_info(), peak_flops=peak,
                   peak_source=peak_source)  # fmt: skip
    # What each row of this invocation was measured with: merged files keep per-row provenance, and fp8 pairs
    # are side by side only within one run_id.
    measured_with = {"machine": results["machine"], "peak_flops": peak, "peak_source": peak_source,
                     "run_id": uuid.uuid4().hex[:12]}  # fmt: skip
    failed: list[str] = []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    if device == "cpu":
        env.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    started = time.perf_counter()
    progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                        TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())  # fmt: skip
    with progress, tempfile.TemporaryDirectory() as tmp:
        task = progress.add_task("shapes", total=len(shapes))
        for cell in shapes:
            left = args.budget_s - (time.perf_counter() - started)
            if left < 20:
                row = {"cell": asdict(cell), "run": {"status": "skipped: budget spent"},
                       "forecast": forecast(cell, device, peak)}  # fmt: skip
            else:
                progress.update(task, description=cell.name)
                row = measure(cell, device, peak, env, Path(tmp), min(args.run_timeout_s, left))
                progress.console.print(_line(row))
            if not keep_good_entry(
                results["shapes"], cell.name, {**row, "measured_with": measured_with}, _run_ok
            ):
                failed.append(cell.name)
            results["fp8"] = fp8_pairs(results["shapes"])
            write_json_atomic(out, results)
            progress.advance(task)
    _finish(results, out)
    if failed:
        print(f"kept the stored rows of {', '.join(failed)}: this run's did not finish (see failed_attempts)",
              file=sys.stderr)  # fmt: skip


def rescore(paths: list[Path], out: Path) -> None:
    """Merge the result files' shapes and forecast each with the code as it is now (module docstring)."""
    from gaudi3_scale.monitor.environment import environment_info

    merged: dict[str, Any] = {"shapes": {}}
    for path in paths:
        try:
            data = json.loads(path.read_text())
            shapes = data["shapes"]
            if data.get("benchmark") != "bench_gpu_shapes" or not isinstance(shapes, dict):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{path} is not a bench_gpu_shapes result file") from None
        for key in ("benchmark", "machine", "peak_flops", "peak_source", "note"):
            if key in data:
                merged.setdefault(key, data[key])
        for name, row in shapes.items():
            # A later file's row replaces an earlier one's only when it ran, or the earlier did not either.
            # Each row keeps the machine and peak it was measured with (`measured_with`, or its file's).
            kept = {"measured_in": path.name, **row}  # a merged file's own record stays
            kept.setdefault(
                "measured_with", {key: data.get(key) for key in ("machine", "peak_flops", "peak_source")}
            )
            keep_good_entry(merged["shapes"], name, kept, _run_ok)
    for row in merged["shapes"].values():
        with_ = row["measured_with"]
        device = "cuda" if (with_.get("machine") or {}).get("cuda") else "cpu"
        _score(row, device, with_.get("peak_flops"))
    now = environment_info()
    merged["forecast_by"] = {"date": now.get("date"), "git_commit": now.get("git_commit")}
    _finish(merged, out)


def _finish(results: dict[str, Any], out: Path) -> None:
    """The fp8 pairs and the verdict, written with the plot; the verdict printed."""
    results["fp8"] = fp8_pairs(results["shapes"])
    results["verdict"] = verdict(results)
    write_json_atomic(out, results)
    plot(results, out.with_suffix(".png"))
    print(f"verdict: {results['verdict']}")
    print(f"wrote {out} and {out.with_suffix('.png')}")


def _line(row: dict[str, Any]) -> str:
    name, run = row["cell"]["name"], row["run"]
    if run.get("status") != "ok":
        return f"{name}: {run.get('status')} {(run.get('reason') or [''])[-1]}"
    mem = f"{run['peak_memory_bytes'] / 2**30:.2f} GiB (estimate {row['memory_error']:+.1%})"
    fc = row["forecast"]
    active = fc.get("active_parameters")
    basis = (
        f" of {active / 1e6:,.1f} M active parameters" if active and active != fc.get("parameters") else ""
    )
    mfu = f", MFU {row['mfu']:.1%}{basis}" if row.get("mfu") is not None else ""
    return (f"{name}: {run['step_time_s'] * 1e3:.1f} ms/step, {run['tokens_per_s']:,.0f} tok/s{mfu}, "
            f"peak {mem}, warm-up {run['warmup_s']:.1f} s, process {run['process_s']:.1f} s")  # fmt: skip


if __name__ == "__main__":
    main()
