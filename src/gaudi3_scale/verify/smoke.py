"""Smoke tier: train the default tiny model briefly on CPU; save, verify, reload and resume its checkpoint.

`run_smoke` runs the stages in order and stops at the first that fails; each stage raises `SmokeFailure` (or any
exception) with one line saying what is wrong, and the report names the stage. `gaudi3 smoke` is the thin CLI.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["STAGES", "SmokeFailure", "SmokeReport", "StageResult", "run_smoke"]

STAGES = ("train", "save", "verify", "reload", "resume")
RESUME_STEPS = 10  # optimizer steps the resume stage adds after the checkpoint


class SmokeFailure(Exception):
    """A stage's check did not hold; the message is one line."""


@dataclass(frozen=True, kw_only=True)
class StageResult:
    name: str
    ok: bool
    time_s: float
    detail: str  # what the stage found when ok, why it failed otherwise


@dataclass(kw_only=True)
class SmokeReport:
    stages: list[StageResult] = field(default_factory=list)
    total_s: float = 0.0

    @property
    def ok(self) -> bool:
        return len(self.stages) == len(STAGES) and all(s.ok for s in self.stages)

    @property
    def failed(self) -> StageResult | None:
        return next((s for s in self.stages if not s.ok), None)


@dataclass(kw_only=True)
class _State:
    """What one stage hands the next."""

    out_dir: Path
    steps: int
    trainer: Any = None  # GaudiTrainer after `train`
    checkpoint: Path | None = None  # after `save`


def _smoke_overrides(
    out_dir: Path, steps: int, *, warmup_steps: int, every_steps: int, resume: str = "never"
) -> list[tuple[str, str]]:
    # Two layers and no validation keep 100 steps well inside the 2-minute budget on 2 CPU cores; a short warmup
    # lets the loss fall visibly within them. `every_steps=steps` saves one checkpoint, at the last step.
    return [
        ("out_dir", str(out_dir)),
        ("train.threads", "2"),
        ("model.num_layers", "2"),
        ("train.max_steps", str(steps)),
        ("optim.warmup_steps", str(warmup_steps)),
        ("train.val_every_steps", "0"),
        ("checkpoint.every_steps", str(every_steps)),
        ("train.resume", resume),
    ]


def _warmup_steps(steps: int) -> int:
    return min(10, steps)


def _train(state: _State) -> str:
    from gaudi3_scale.train import GaudiTrainer, build_run_config

    cfg = build_run_config(
        None,
        _smoke_overrides(
            state.out_dir, state.steps, warmup_steps=_warmup_steps(state.steps), every_steps=state.steps
        ),
    )
    trainer = GaudiTrainer(cfg, progress=False)
    summary = trainer.fit()
    if summary["steps"] != state.steps:
        raise SmokeFailure(f"trained {summary['steps']} steps, expected {state.steps}")
    loss = summary["train_loss"]
    if loss is None or not math.isfinite(loss):
        raise SmokeFailure(f"final train loss is {loss}")
    state.trainer = trainer
    return f"{state.steps} steps, train loss {loss:.3f}"


def _save(state: _State) -> str:
    from gaudi3_scale.checkpoint.manager import CheckpointManager
    from gaudi3_scale.checkpoint.manifest import read_manifest

    committed = dict(CheckpointManager(state.out_dir / "checkpoints").committed())
    if state.steps not in committed:
        raise SmokeFailure(f"no committed checkpoint at step {state.steps} (committed: {sorted(committed)})")
    path = committed[state.steps]
    manifest = read_manifest(path)
    if manifest is None or manifest.get("step") != state.steps:
        raise SmokeFailure(f"{path}: manifest missing or not for step {state.steps}")
    state.checkpoint = path
    return str(path)


def _verify(state: _State) -> str:
    from gaudi3_scale.checkpoint.manifest import verify_checkpoint

    assert state.checkpoint is not None, "save runs before verify"
    problems = verify_checkpoint(state.checkpoint)
    if problems:
        raise SmokeFailure(f"{len(problems)} problem(s): {problems[0]}")
    return "checksums match the manifest"


def _fixed_batch_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    x, y = batch
    with torch.no_grad():
        logits = model(x)
    return float(F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)))


def _reload(state: _State) -> str:
    from gaudi3_scale.artifacts.inference import load_for_generation, read_model_state
    from gaudi3_scale.models import build_model

    assert state.checkpoint is not None and state.trainer is not None, "train and save run before reload"
    model_cfg, saved = read_model_state(state.checkpoint)
    model, _ = load_for_generation(state.checkpoint)
    trained = state.trainer.module.model
    trained_state = trained.state_dict()
    for key, tensor in saved.items():
        if not torch.equal(tensor, trained_state[key].detach().cpu()):
            raise SmokeFailure(f"checkpoint weight {key} differs from the trained model's")
    for key, tensor in model.state_dict().items():
        if not torch.equal(tensor, saved[key]):
            raise SmokeFailure(f"reloaded weight {key} differs from the checkpoint")
    batch = next(iter(state.trainer.datamodule.val_dataloader()))
    trained.eval()
    trained_loss = _fixed_batch_loss(trained, batch)
    reloaded_loss = _fixed_batch_loss(model, batch)
    initial_loss = _fixed_batch_loss(build_model(model_cfg, seed=0).eval(), batch)  # an untrained model
    if reloaded_loss != trained_loss:
        raise SmokeFailure(f"reloaded model's loss {reloaded_loss!r} != trained model's {trained_loss!r}")
    if not math.isfinite(reloaded_loss) or reloaded_loss >= initial_loss:
        raise SmokeFailure(f"loss {reloaded_loss:.4f} is not below an untrained model's {initial_loss:.4f}")
    return f"weights bitwise equal; loss {reloaded_loss:.3f} (untrained {initial_loss:.3f})"


def _resume(state: _State) -> str:
    from gaudi3_scale.checkpoint.manager import CheckpointManager
    from gaudi3_scale.train import GaudiTrainer, build_run_config
    from gaudi3_scale.train.report import read_metrics

    assert state.checkpoint is not None, "save runs before resume"
    out, total = state.out_dir / "resume", state.steps + RESUME_STEPS
    # Its own directory keeps the first run's metrics and checkpoints as they were; every_steps=0 saves at the end.
    overrides = _smoke_overrides(
        out, total, warmup_steps=_warmup_steps(state.steps), every_steps=0, resume=str(state.checkpoint)
    )
    summary = GaudiTrainer(build_run_config(None, overrides), progress=False).fit()
    logged = [r["step"] for r in read_metrics(out / "metrics.jsonl") if r.get("train_loss") is not None]
    if summary["steps"] != total or not logged or min(logged) <= state.steps:
        raise SmokeFailure(f"did not continue from step {state.steps} to {total} (logged steps {logged})")
    loss = summary["train_loss"]
    if loss is None or not math.isfinite(loss):
        raise SmokeFailure(f"train loss after resuming is {loss}")
    if total not in dict(CheckpointManager(out / "checkpoints").committed()):
        raise SmokeFailure(f"no committed checkpoint at step {total} after resuming")
    return f"steps {state.steps + 1}-{total}, train loss {loss:.3f}"


_STAGE_FUNCTIONS: dict[str, Callable[[_State], str]] = {
    "train": _train,
    "save": _save,
    "verify": _verify,
    "reload": _reload,
    "resume": _resume,
}


def _one_line(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else "(no message)"
    return text if isinstance(exc, SmokeFailure) else f"{type(exc).__name__}: {text}"


def run_smoke(
    out_dir: Path,
    steps: int = 100,
    progress_print: Callable[[StageResult], None] | None = None,
    after_stage: Callable[[str, Path], None] | None = None,
) -> SmokeReport:
    """Run every stage in `STAGES` order into `out_dir`, stopping at the first failure.

    `progress_print` sees each stage's result as it finishes. `after_stage(name, out_dir)` runs after each stage
    that passed; tests use it to break what the next stage checks (e.g. corrupt the checkpoint before `verify`).
    """
    state = _State(out_dir=Path(out_dir), steps=steps)
    report = SmokeReport()
    started = time.perf_counter()
    for name in STAGES:
        stage_start = time.perf_counter()
        try:
            detail, ok = _STAGE_FUNCTIONS[name](state), True
        except Exception as exc:  # any error fails the stage; the report carries it as one line
            detail, ok = _one_line(exc), False
        result = StageResult(name=name, ok=ok, time_s=time.perf_counter() - stage_start, detail=detail)
        report.stages.append(result)
        if progress_print is not None:
            progress_print(result)
        if not ok:
            break
        if after_stage is not None:
            after_stage(name, state.out_dir)
    report.total_s = time.perf_counter() - started
    return report
