"""Faults injected into a run for tests of the health checks, from the environment variable `GAUDI3_INJECT_FAULTS`
(test-only: nothing sets it; a run without it pays one dict lookup at start).

    GAUDI3_INJECT_FAULTS="nan:rank=1:step=5,spike:step=8:scale=50"

`nan` makes the loss of optimizer step `step` NaN on `rank` (every rank when omitted) before its backward pass, so
the gradients that the all-reduce spreads are NaN too; `spike` multiplies that loss by `scale`; `sleep` sleeps
`seconds` before each forward of `rank` from `step` on (a straggler). `transient=1` makes a `nan` or `spike` happen
only the first time its step runs, not when `health.rerun_check` runs it again (a hardware fault, not the data's).
Under pipeline parallel a `nan` or `spike` acts on the rank holding the last stage (where the loss is computed), on
each micro-batch's loss of its step.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

__all__ = ["ENV_VAR", "Fault", "faults_from_env", "inject_delay", "inject_into_loss"]

ENV_VAR = "GAUDI3_INJECT_FAULTS"


@dataclass(frozen=True)
class Fault:
    kind: str  # nan | spike | sleep
    step: int = 0
    rank: int | None = None
    scale: float = 100.0
    seconds: float = 0.0
    transient: bool = False  # not injected into a re-run of its step (health.rerun)


def faults_from_env() -> tuple[Fault, ...]:
    text = os.environ.get(ENV_VAR, "").strip()
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, *fields = item.split(":")
        values = dict(field.split("=", 1) for field in fields)
        faults.append(
            Fault(
                kind=kind,
                step=int(values.get("step", 0)),
                rank=int(values["rank"]) if "rank" in values else None,
                scale=float(values.get("scale", 100.0)),
                seconds=float(values.get("seconds", 0.0)),
                transient=values.get("transient", "0") == "1",
            )
        )
    return tuple(faults)


def inject_into_loss(
    faults: tuple[Fault, ...], loss: torch.Tensor, *, step: int, rank: int, rerun: bool = False
) -> torch.Tensor:
    for fault in faults:
        if fault.step == step and fault.rank in (None, rank) and not (rerun and fault.transient):
            if fault.kind == "nan":
                loss = loss * float("nan")
            elif fault.kind == "spike":
                loss = loss * fault.scale
    return loss


def inject_delay(faults: tuple[Fault, ...], *, step: int, rank: int) -> None:
    for fault in faults:
        if fault.kind == "sleep" and step >= fault.step and fault.rank in (None, rank):
            time.sleep(fault.seconds)
