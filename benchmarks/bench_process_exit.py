"""What a process's exit costs, with and without `process_exit.skip_exit_collection`, side by side.

Each case is one fresh `python -c …` process run both ways, alternating, --reps times: with the collector frozen at
exit (what `gaudi3`, `python -m gaudi3_scale.cli` and every rank's `python -m gaudi3_scale.train` do) and without.
The process prints the time when its work is done; the exit is what follows until the parent sees it end (module
teardown and the final collections). Also its wall time and CPU (user + system, from the parent's rusage of its
children). Medians are printed and saved as JSON with machine info.

    python benchmarks/bench_process_exit.py
    python benchmarks/bench_process_exit.py --cases torch --reps 1
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gaudi3_scale.bench.result import write_json_atomic
from gaudi3_scale.monitor.environment import environment_info

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_args import positive_int

# name: the work, as Python source (`OUT`: a fresh directory for a run). gaudi3-train: the default model's
# `gaudi3 train` for 12 steps, through `cli.main.main` as the console script calls it.
CASES = {
    "torch": "import torch",
    "lightning": "import lightning.pytorch",
    "gaudi3-train": (
        "from gaudi3_scale.cli.main import main\n"
        "main(['train', '--out', OUT, '--train.max_steps', '12', '--train.val_every_steps', '0',"
        " '--sample-tokens', '0', '--no-progress', '--checkpoint.every_steps', '6'])"
    ),
}
SKIP = "from gaudi3_scale.process_exit import skip_exit_collection\nskip_exit_collection()\n"
DONE = "\nimport time\nprint('done', time.time(), flush=True)\n"


def run_once(work: str, skip: bool, out: Path) -> dict[str, float]:
    """One process: its exit (s from its work's end to its end), wall and CPU seconds."""
    source = f"OUT = {str(out)!r}\n" + (SKIP if skip else "") + work + DONE
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, cwd=out.parent)
    ended_unix_s, wall_s = time.time(), time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"case failed ({'with' if skip else 'without'} the skip): {proc.stderr[-2000:]}")
    done_unix_s = float(proc.stdout.split("done ")[-1].split()[0])
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"exit_s": ended_unix_s - done_unix_s, "wall_s": wall_s, "cpu_s": cpu_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--reps", type=positive_int, default=5)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "process_exit_cpu.json"
    )
    args = parser.parse_args()
    names = [name.strip() for name in args.cases.split(",")]
    unknown = [name for name in names if name not in CASES]
    if unknown or args.reps < 1:
        parser.error(
            f"--cases: unknown {unknown}; valid: {', '.join(CASES)}" if unknown else "--reps must be >= 1"
        )

    rows: list[dict[str, Any]] = []
    total, done = len(names) * args.reps * 2, 0
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        for name in names:
            samples: dict[bool, list[dict[str, float]]] = {True: [], False: []}
            for rep in range(args.reps):
                for skip in (rep % 2 == 0, rep % 2 == 1):  # alternate which goes first
                    out = Path(scratch) / f"run-{done}"
                    samples[skip].append(run_once(CASES[name], skip, out))
                    done += 1
                    eta_s = (time.perf_counter() - started) / done * (total - done)
                    print(
                        f"[{done}/{total}] {name}, {'skip' if skip else 'plain'}: ETA {eta_s:.0f} s",
                        flush=True,
                    )
            row: dict[str, Any] = {"case": name}
            for skip, label in ((False, "plain"), (True, "skip")):
                for key in ("exit_s", "wall_s", "cpu_s"):
                    row[f"{label}_{key}"] = statistics.median(s[key] for s in samples[skip])
            row["exit_saved_s"] = row["plain_exit_s"] - row["skip_exit_s"]
            row["cpu_saved_s"] = row["plain_cpu_s"] - row["skip_cpu_s"]
            rows.append(row)

    print(
        f"{'case':>24} {'exit plain':>11} {'exit skip':>10} {'CPU plain':>10} {'CPU skip':>9} {'CPU saved':>10}"
    )
    for row in rows:
        print(f"{row['case']:>24} {row['plain_exit_s']:10.3f}s {row['skip_exit_s']:9.3f}s "
              f"{row['plain_cpu_s']:9.2f}s {row['skip_cpu_s']:8.2f}s {row['cpu_saved_s']:9.2f}s")  # fmt: skip
    result = {
        "machine": environment_info(),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "median_of": args.reps,
        "results": rows,
    }
    write_json_atomic(args.out, result)
    plot(rows, args.reps, args.out.with_suffix(".png"))
    print(f"saved {args.out} and {args.out.with_suffix('.png').name}")


def plot(rows: list[dict[str, Any]], reps: int, path: Path) -> None:
    """Exit seconds per case, without and with the skip, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    xs = range(len(rows))
    for offset, label, key in (
        (-0.2, "plain exit", "plain_exit_s"),
        (0.2, "skip_exit_collection", "skip_exit_s"),
    ):
        bars = ax.bar([x + offset for x in xs], [row[key] for row in rows], width=0.4, label=label)
        ax.bar_label(bars, fmt="%.2f s", fontsize=8)
    ax.set_xticks(list(xs), [row["case"] for row in rows])
    ax.set_ylabel("seconds from the work's end to the process's end")
    ax.set_title(f"process exit, median of {reps}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
