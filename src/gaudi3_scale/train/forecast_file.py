"""The run's forecast as the trainer receives it: `gaudi3 train` computes it (forecast/, a layer above training)
and names its file in GAUDI3_FORECAST; the trainer of rank 0 copies it to <run>/plan.json and puts its
`predicted_*` fields beside the measured values of summary.json. No variable, or a file that cannot be read: no
forecast (a forecast never stops a run)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from gaudi3_scale.config import strict_json
from gaudi3_scale.config.atomic import write_text_atomic

__all__ = ["FORECAST_ENV", "PLAN_FILE", "predicted_fields", "read_forecast", "write_plan"]

FORECAST_ENV = "GAUDI3_FORECAST"
PLAN_FILE = "plan.json"


def read_forecast() -> dict[str, Any] | None:
    path = os.environ.get(FORECAST_ENV)
    if not path:
        return None
    try:
        forecast = strict_json.restore_non_finite(json.loads(Path(path).read_text()))
    except (OSError, ValueError):
        return None
    return forecast if isinstance(forecast, dict) else None


def write_plan(out_dir: Path, forecast: dict[str, Any]) -> None:
    write_text_atomic(out_dir / PLAN_FILE, strict_json.dumps(forecast, indent=2) + "\n")


def predicted_fields(forecast: dict[str, Any] | None) -> dict[str, Any]:
    """summary.json's `predicted_*` fields (empty without a forecast)."""
    if forecast is None:
        return {}
    return {k: v for k, v in forecast.items() if k.startswith("predicted_")}
