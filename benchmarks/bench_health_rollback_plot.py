"""A loss spike and its rollback, plotted for docs/health.md: two real `gaudi3 train` runs on CPU, side by side with
one thread each (shakespeare-char with `--layers` layers), the same config (`health.spike_policy rollback`), one
with a loss spike injected at data step `--spike-step` (`GAUDI3_INJECT_FAULTS`, test-only: the loss × `--scale`),
its twin without.

The spiking run drops that update, restores the newest checkpoint at or before it and skips
`--skip-batches` batches from the data step that checkpoint resumes at (docs/health.md, Rolling back); the twin
trains on those batches. Up to the restored step the two runs are bitwise the same; after it they train on
different batches. The PNG shows both loss curves (the rolled-back run's kept steps), the spike's loss, the
rollback (from → to step, the steps it went back over shaded, as on loss.png: `train.report.draw_health_marks`)
and the steps at which the twin trained on the batches the rolled-back run skipped. The JSON has every loss, the
health records, the rollback and the machine.

    PYTHONPATH=src python benchmarks/bench_health_rollback_plot.py   # → benchmarks/results/health_rollback_cpu.json,
                                                                     #   docs/img/health_rollback.png
    PYTHONPATH=src python benchmarks/bench_health_rollback_plot.py --steps 40 --spike-step 27 --checkpoint-every 5 \\
        --skip-batches 5 --out /tmp/r.json --png /tmp/r.png                     # a smoke check
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gaudi3_scale.bench.result import write_json_atomic
from gaudi3_scale.monitor.environment import environment_info
from gaudi3_scale.train.report import draw_health_marks, read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_args import positive_int

# The injected spike is the loss's. This 1-layer model's gradient norm spikes by itself at the default 6 MADs (a
# twin run rolled back at step 120 in one try), which would leave no run without a rollback to compare with.
WATCH_LOSS_ONLY = ["--health.spike_on_grad_norm=false"]


def _start(out: Path, args: argparse.Namespace, *, spike: bool) -> subprocess.Popen[str]:
    faults = f"spike:step={args.spike_step}:scale={args.scale}" if spike else ""
    command = [sys.executable, "-m", "gaudi3_scale.cli", "train", f"--out={out}", "--no-progress",
               "--sample-tokens=0", f"--model.num_layers={args.layers}", "--train.threads=1",
               f"--train.max_steps={args.steps}", "--train.log_every_steps=1", "--train.val_every_steps=0",
               f"--checkpoint.every_steps={args.checkpoint_every}", "--health.spike_policy=rollback",
               f"--health.rollback_skip_batches={args.skip_batches}", *WATCH_LOSS_ONLY]  # fmt: skip
    env = {**os.environ, "GAUDI3_INJECT_FAULTS": faults}
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)


def _finish(proc: subprocess.Popen[str], out: Path) -> dict[str, Any]:
    """One run, once ended: its wall time, kept losses (each step's newest record), health records and summary."""
    _, stderr = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"bench_health_rollback_plot: a run failed:\n{stderr[-2000:]}")
    records = read_metrics(out / "metrics.jsonl")
    summary = json.loads((out / "summary.json").read_text())
    # Each step's newest record: after the rollback, the steps the run kept.
    losses = {r["step"]: r["train_loss"] for r in records if r.get("train_loss") is not None}
    return {
        "wall_s": summary["wall_s"],
        "train_loss": sorted(losses.items()),
        "final_val_loss": summary.get("val_loss"),
        "health_records": [r for r in records if "health_event" in r],
        "health": {k: v for k, v in summary["health"].items() if k != "events"},
    }


def _check(spiking: dict[str, Any], twin: dict[str, Any], spike_step: int) -> dict[str, Any]:
    """The rollback record; refuses a pair whose events are not the injected spike's alone."""
    events = [(r["step"], r["health_event"], r["health_action"]) for r in spiking["health_records"]]
    expected = [(spike_step, "loss_spike", "rollback"), (spike_step, "rollback", "rollback")]
    if events != expected or twin["health_records"]:
        raise SystemExit(f"bench_health_rollback_plot: expected only {expected}, got {events} and, in the twin, "
                         f"{twin['health_records']}")  # fmt: skip
    return dict(spiking["health_records"][1])


def _identical_until(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> int:
    """The last step up to which both runs' losses are equal, bit for bit."""
    last = 0
    for (step, x), (other, y) in zip(a, b, strict=False):
        if step != other or x != y:
            break
        last = step
    return last


def _panel(ax: Any, result: dict[str, Any], steps: tuple[int, int]) -> None:
    """Both curves over optimizer steps `steps` (inclusive), with the spike, the rollback and the skipped batches."""
    spiking, twin = result["runs"]["rolled_back"], result["runs"]["twin"]
    rollback, spike = result["rollback"], result["spike"]
    shown = [[(s, loss) for s, loss in run["train_loss"] if steps[0] <= s <= steps[1]] for run in (twin, spiking)]  # fmt: skip
    same = result["identical_until_step"]
    ax.plot(*zip(*shown[0], strict=True), color="tab:gray", linewidth=1.0,
            label=f"twin run, no spike (bitwise the same up to step {same})")  # fmt: skip
    ax.plot(*zip(*shown[1], strict=True), color="tab:blue", linewidth=1.0,
            label=f"spike injected at step {spike['step']} (loss × {result['settings']['spike_scale']:g})")  # fmt: skip
    draw_health_marks(ax, spiking["health_records"])
    losses = [loss for run in shown for _, loss in run]
    low, high = min(losses), max(losses)
    ax.set_xlim(steps[0] - 1, steps[1] + 1)
    # Room above the curves for the marks; the spike's own loss is far off this scale.
    ax.set_ylim(low - 0.08 * (high - low), high + 0.25 * (high - low))
    bottom, top = ax.get_ylim()
    arrow_y = top - 0.05 * (top - bottom)
    ax.plot([spike["step"]], [top], marker="v", color="tab:red", markersize=9, clip_on=False, linestyle="none",
            label=f"spike: loss {spike['event_loss']:.1f}, update dropped")  # fmt: skip
    ax.annotate("", xy=(rollback["to_step"], arrow_y), xytext=(rollback["from_step"], arrow_y),
                arrowprops={"arrowstyle": "->", "color": "tab:purple"})  # fmt: skip
    ax.text(rollback["from_step"], arrow_y, f"  rolled back {rollback['from_step']} → {rollback['to_step']}",
            color="tab:purple", ha="left", va="center", fontsize=8)  # fmt: skip
    first, last = rollback["skipped_batches"]
    # The twin loads data step d at optimizer step d + 1 (it skips no batch).
    ax.axvspan(first + 1, last + 1, ymax=0.04, color="tab:green", alpha=0.6,
               label=f"batches {first}–{last}: skipped after the rollback; the twin trained on them here")  # fmt: skip
    ax.set_xlabel("optimizer step")
    ax.grid(alpha=0.3)


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rollback = result["rollback"]
    last_step = result["runs"]["twin"]["train_loss"][-1][0]
    fig, (full, zoom) = plt.subplots(1, 2, figsize=(12, 5.4), dpi=110, gridspec_kw={"width_ratios": [3, 2]})
    _panel(full, result, (1, last_step))
    around = (max(1, rollback["to_step"] - 10), min(last_step, rollback["skipped_batches"][1] + 15))
    _panel(zoom, result, around)
    full.set_ylabel("training loss (nats/token)")
    full.set_title("the whole run")
    zoom.set_title(f"steps {around[0]}–{around[1]}")
    handles, labels = full.get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=3)
    settings = result["settings"]
    layers = f"{settings['num_layers']} layer{'s' if settings['num_layers'] != 1 else ''}"
    fig.suptitle(f"health.spike_policy rollback: a loss spike and its rollback (CPU, shakespeare-char with {layers}, "
                 f"a checkpoint every {settings['checkpoint_every_steps']} steps)")  # fmt: skip
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "health_rollback_cpu.json"
DOCS_IMAGE = ROOT / "docs" / "img" / "health_rollback.png"  # docs/health.md shows it


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=positive_int, default=160, help="optimizer steps per run")
    parser.add_argument("--layers", type=int, default=1, help="model.num_layers of shakespeare-char")
    parser.add_argument("--spike-step", type=int, default=90, help="the data step whose loss spikes")
    parser.add_argument("--scale", type=float, default=20.0, help="the spiking loss is multiplied by this")
    parser.add_argument("--checkpoint-every", type=int, default=20, help="checkpoint.every_steps")
    parser.add_argument("--skip-batches", type=int, default=20, help="health.rollback_skip_batches")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="result JSON")
    parser.add_argument(
        "--png", type=Path,
        help="the plot (default: docs/img/health_rollback.png when --out is the default, else beside --out)",
    )  # fmt: skip
    args = parser.parse_args()
    # A trial run with its own --out never replaces the image the docs show.
    if args.png is None:
        args.png = DOCS_IMAGE if args.out.resolve() == DEFAULT_OUT else args.out.with_suffix(".png")
    with tempfile.TemporaryDirectory() as tmp:
        # Side by side, one thread each: what differs between them is the spike, not the machine.
        outs = {"spike": Path(tmp) / "spike", "twin": Path(tmp) / "twin"}
        started = time.perf_counter()
        procs = {name: _start(out, args, spike=name == "spike") for name, out in outs.items()}
        spiking, twin = (_finish(procs[name], outs[name]) for name in ("spike", "twin"))
        both_wall_s = time.perf_counter() - started
    rollback = _check(spiking, twin, args.spike_step)
    spike = spiking["health_records"][0]
    command = "PYTHONPATH=src python benchmarks/bench_health_rollback_plot.py " + " ".join(sys.argv[1:])
    result = {
        "benchmark": "health_rollback_plot",
        "command": command.strip(),
        "machine": environment_info(),
        "settings": {
            "model": "shakespeare-char",
            "num_layers": args.layers,
            "steps": args.steps,
            "flags": WATCH_LOSS_ONLY,
            "spike_data_step": args.spike_step,
            "spike_scale": args.scale,
            "checkpoint_every_steps": args.checkpoint_every,
            "rollback_skip_batches": args.skip_batches,
        },
        "spike": {"step": spike["step"], "event_loss": spike["event_loss"], "detail": spike["detail"]},
        "rollback": {key: rollback[key] for key in ("from_step", "to_step", "checkpoint", "skipped_batches")},
        "identical_until_step": _identical_until(spiking["train_loss"], twin["train_loss"]),
        "final_train_loss": {"rolled_back": spiking["train_loss"][-1][1], "twin": twin["train_loss"][-1][1]},
        "final_val_loss": {"rolled_back": spiking["final_val_loss"], "twin": twin["final_val_loss"]},
        "both_runs_wall_s": both_wall_s,
        "runs": {"rolled_back": spiking, "twin": twin},
        # as the docs cite it: relative to the repository when inside it
        "png": str(
            args.png.resolve().relative_to(ROOT) if args.png.resolve().is_relative_to(ROOT) else args.png
        ),
    }
    write_json_atomic(args.out, result)
    _plot(result, args.png)
    print(f"spike at step {spike['step']} (loss {spike['event_loss']:.2f}); rolled back {rollback['from_step']} → "
          f"{rollback['to_step']}, batches {rollback['skipped_batches'][0]}–{rollback['skipped_batches'][1]} skipped; "
          f"runs bitwise equal up to step {result['identical_until_step']}")  # fmt: skip
    print(f"final val loss: rolled back {spiking['final_val_loss']:.4f}, twin {twin['final_val_loss']:.4f}")
    print(f"wrote {args.out} and {args.png}")


if __name__ == "__main__":
    main()
