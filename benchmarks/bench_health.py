"""What the training-health checks cost per step: `gaudi3 train` with the `health` defaults (the step guard's
all-reduce and host sync, the spike detectors, the watchdog's beat, the straggler decision) against the same run
with all of them off (each rank's compute time is measured either way: two clock reads per micro-batch).

Every run is a fresh `gaudi3 train` process on the default model (shakespeare-char), checkpoints off; the two
settings run in alternated pairs (on first, then off first, …), so a shared machine's drift slows both alike. A
run's step time is the steady-state one summary.json reports (after the throughput warm-up steps). The result is
the median over pairs of (health on / health off); `--ranks 2` runs the same on 2 ranks (DDP, gloo).

Runs minutes apart on a shared machine differ by several per cent, more than the 1 % this is about, so the
`interleaved` cell also measures the step guard (its check and spike detectors, the part that runs on every step)
inside one run: the guard is switched on and off every optimizer step, and the ratio is the median step time of
guarded steps over unguarded ones, steps milliseconds apart — on one process, and on 2 ranks (DDP, gloo; this
script started by torchrun, both ranks switching at the same steps, rank 0's clock). The watchdog's beat and the
straggler clock stay on for both halves there (a clock read or two per step).

    PYTHONPATH=src python benchmarks/bench_health.py                 # 1 and 2 ranks → benchmarks/results/health_cpu.json
    PYTHONPATH=src python benchmarks/bench_health.py --steps 60 --pairs 1 --out /tmp/h.json   # a smoke check

Results merge into `--out` by rank count: a run of `--ranks 1` replaces the stored 1-rank run pairs and keeps the
2-rank ones (likewise the interleaved cells). Every cell carries the `machine` it was measured on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from rich.progress import Progress

from gaudi3_scale.bench.result import load_stored_results, write_json_atomic
from gaudi3_scale.config.core import parse_overrides
from gaudi3_scale.monitor.environment import environment_info
from gaudi3_scale.train import GaudiTrainer, build_run_config
from gaudi3_scale.train.step import at_step_boundary

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_args import positive_int

RESULTS = Path(__file__).resolve().parent / "results"
OFF = ["--health.nonfinite_guard=false", "--health.spike_policy=off", "--health.watchdog=false",
       "--health.stragglers=false"]  # fmt: skip


def _run(steps: int, ranks: int, health: bool) -> float:
    """One run's steady-state step time, seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        command = [sys.executable, "-m", "gaudi3_scale.cli", "train", f"--out={out}", "--no-progress",
                   "--sample-tokens=0", f"--train.max_steps={steps}", "--train.val_every_steps=0",
                   "--checkpoint.enabled=false", f"--parallel.nproc_per_node={ranks}", *([] if health else OFF)]  # fmt: skip
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"bench_health: a run failed:\n{proc.stderr[-2000:]}")
        step_time_s = json.loads((out / "summary.json").read_text())["step_time_s"]
        return float(step_time_s)


def _measure(steps: int, ranks: int, pairs: int, progress: Progress, task: Any) -> dict[str, Any]:
    rows = []
    for pair in range(pairs):
        times: dict[bool, float] = {}
        for health in (True, False) if pair % 2 == 0 else (False, True):
            times[health] = _run(steps, ranks, health)
            progress.advance(task)
        rows.append({"on_step_time_s": times[True], "off_step_time_s": times[False],
                     "ratio": times[True] / times[False]})  # fmt: skip
    return {
        "ranks": ranks,
        "steps": steps,
        "pairs": rows,
        "median_ratio": statistics.median(r["ratio"] for r in rows),
        "overhead_percent": (statistics.median(r["ratio"] for r in rows) - 1) * 100,
    }


def _guarded(step: int) -> bool:
    """Steps 4k and 4k + 3 guarded, 4k + 1 and 4k + 2 not (ABBA): each side has as many even steps as odd ones.
    Plain alternation is biased: with the guard on at every step, even steps measured 1.011× odd ones."""
    return step % 4 in (0, 3)


class _Alternate(pl.Callback):
    """Switches the module's step guard on and off by `_guarded(step)`; times every step from the previous one's
    end (data, hooks and all). The steps around a metrics record (every `log_every`) are left out of both sides."""

    def __init__(self, skip_steps: int, advance: Any, log_every: int) -> None:
        self.skip_steps, self.advance, self.log_every = skip_steps, advance, log_every
        self.times: dict[bool, list[float]] = {True: [], False: []}
        self._guard: Any = None
        self._last = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._guard = pl_module.guard  # type: ignore[union-attr]
        assert self._guard is not None, "the health defaults attach a step guard"
        pl_module.guard = self._guard if _guarded(trainer.global_step + 1) else None  # type: ignore[union-attr]
        self._last = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not at_step_boundary(pl_module):
            return
        now = time.perf_counter()
        guarded = pl_module.guard is not None  # type: ignore[union-attr]
        step = trainer.global_step
        if step > self.skip_steps and step % self.log_every not in (0, 1):
            self.times[guarded].append(now - self._last)
        pl_module.guard = self._guard if _guarded(step + 1) else None  # type: ignore[union-attr]
        self.advance(trainer.global_step)
        self._last = time.perf_counter()


def _interleaved_run(steps: int, ranks: int, advance: Any) -> dict[str, Any]:
    """The interleaved cell in this process (one rank of `ranks`, under torchrun when 2)."""
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"--out_dir={tmp}/run", f"--train.max_steps={steps}", "--train.val_every_steps=0",
                     "--checkpoint.enabled=false", f"--parallel.nproc_per_node={ranks}"]  # fmt: skip
        cfg = build_run_config(None, parse_overrides(overrides))
        clock = _Alternate(skip_steps=30, advance=advance, log_every=cfg.train.log_every_steps)
        GaudiTrainer(cfg, progress=False, callbacks=[clock]).fit()
    on, off = statistics.median(clock.times[True]), statistics.median(clock.times[False])
    return {"ranks": ranks, "steps": steps, "guarded_steps": len(clock.times[True]),
            "unguarded_steps": len(clock.times[False]), "median_guarded_step_s": on,
            "median_unguarded_step_s": off, "median_ratio": on / off,
            "overhead_percent": (on / off - 1) * 100}  # fmt: skip


def _interleaved(steps: int, ranks: int, progress: Progress, task: Any) -> dict[str, Any]:
    if ranks == 1:
        return _interleaved_run(steps, 1, lambda step: progress.update(task, completed=step))
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "cell.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                   __file__, "--worker", str(result), "--interleaved-steps", str(steps)]  # fmt: skip
        worker = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        progress_file = result.with_suffix(".step")
        while worker.poll() is None:
            time.sleep(0.5)
            if progress_file.is_file():
                progress.update(task, completed=int(progress_file.read_text() or 0))
        output = worker.stdout.read() if worker.stdout else ""
        if worker.returncode or not result.is_file():
            raise SystemExit(f"bench_health: the {ranks}-rank interleaved run failed:\n{output[-2000:]}")
        return dict(json.loads(result.read_text()))


def _worker(result: Path, steps: int) -> None:
    """One torchrun rank of the multi-rank interleaved cell; rank 0 writes the cell (and its step count)."""
    rank0 = os.environ.get("RANK", "0") == "0"
    step_file = result.with_suffix(".step")

    def advance(step: int) -> None:
        if rank0 and step % 10 == 0:
            step_file.write_text(str(step))

    cell = _interleaved_run(steps, int(os.environ["WORLD_SIZE"]), advance)
    if rank0:
        result.write_text(json.dumps(cell))


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=110)
    for offset, cell in enumerate(result["cells"]):
        ratios = [r["ratio"] for r in cell["pairs"]]
        ax.scatter(
            [offset] * len(ratios),
            ratios,
            label=f"{cell['ranks']} rank(s): median {cell['median_ratio']:.4f}",
        )
    first = len(result["cells"])
    for offset, cell in enumerate(result["interleaved"], start=first):
        ax.scatter([offset], [cell["median_ratio"]], marker="D",
                   label=f"{cell['ranks']} rank(s), step by step: {cell['median_ratio']:.4f}")  # fmt: skip
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.axhline(1.01, color="red", linewidth=0.8, linestyle="--", label="the 1 % goal")
    ticks = [f"{c['ranks']} rank(s), run pairs" for c in result["cells"]]
    ticks += [f"{c['ranks']} rank(s), step by step" for c in result["interleaved"]]
    ax.set_xticks(range(len(ticks)), ticks, fontsize=7)
    ax.set_ylabel("step time, health on / off")
    ax.set_title("Training-health overhead: run pairs, and the guard switched every step")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _merge_by_ranks(stored: list[dict[str, Any]], new: list[dict[str, Any]], stored_machine: Any,
                    machine: dict[str, Any]) -> list[dict[str, Any]]:  # fmt: skip
    """One cell per rank count, in rank order: this run's where it measured that count, else the stored one (with
    its own `machine`, or the one its file recorded for it)."""
    by_ranks = {cell["ranks"]: {**cell, "machine": cell.get("machine", stored_machine)} for cell in stored}
    by_ranks.update({cell["ranks"]: {**cell, "machine": machine} for cell in new})
    return [by_ranks[ranks] for ranks in sorted(by_ranks)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=positive_int, default=300, help="optimizer steps per run")
    parser.add_argument(
        "--pairs", type=positive_int, default=4, help="alternated (on, off) pairs per rank count"
    )
    parser.add_argument(
        "--ranks", type=int, nargs="*", default=[1, 2],
        help="rank counts of run pairs (none: keep the pairs of --out, with their machine)",
    )  # fmt: skip
    parser.add_argument(
        "--interleaved-steps", type=int, default=1000, help="steps of the interleaved run (0: none)"
    )
    parser.add_argument(
        "--interleaved-ranks", type=int, nargs="*", default=[1, 2], help="rank counts of interleaved runs"
    )
    parser.add_argument(
        "--out", type=Path, default=RESULTS / "health_cpu.json", help="result JSON (merged by rank count)"
    )
    parser.add_argument(
        "--worker", type=Path, help=argparse.SUPPRESS
    )  # a torchrun rank of an interleaved cell
    args = parser.parse_args()
    if args.worker is not None:
        _worker(args.worker, args.interleaved_steps)
        return
    try:
        stored = load_stored_results(args.out, {})
    except ValueError as err:
        parser.error(str(err))
    with Progress(*Progress.get_default_columns()) as progress:
        task = progress.add_task("health on/off runs", total=2 * args.pairs * len(args.ranks))
        cells = [_measure(args.steps, ranks, args.pairs, progress, task) for ranks in args.ranks]
        interleaved = []
        for ranks in args.interleaved_ranks if args.interleaved_steps else []:
            steps_task = progress.add_task(
                f"guard on/off, step by step, {ranks} rank(s)", total=args.interleaved_steps
            )
            interleaved.append(_interleaved(args.interleaved_steps, ranks, progress, steps_task))
    command = "PYTHONPATH=src python benchmarks/bench_health.py " + " ".join(sys.argv[1:])
    machine = environment_info()
    result = {"benchmark": "health_overhead", "command": command.strip(), "machine": machine,
              "health_off_flags": OFF}  # fmt: skip
    # The stored cells of the rank counts this run did not measure stay, each with the machine it ran on.
    stored_machine = stored.get("machine")
    result["cells"] = _merge_by_ranks(stored.get("cells", []), cells, stored.get("cells_machine", stored_machine),
                                      machine)  # fmt: skip
    result["interleaved"] = _merge_by_ranks(
        stored.get("interleaved", []), interleaved, stored_machine, machine
    )
    write_json_atomic(args.out, result)
    _plot(result, args.out.with_suffix(".png"))
    for cell in cells:
        print(
            f"{cell['ranks']} rank(s): health on / off = {cell['median_ratio']:.4f} (median of {len(cell['pairs'])} pairs)"
        )
    for cell in interleaved:
        print(f"interleaved, {cell['ranks']} rank(s): guarded / unguarded step = {cell['median_ratio']:.4f}")
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
