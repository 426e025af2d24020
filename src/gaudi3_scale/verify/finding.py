"""What `gaudi3 doctor`'s checks take (`DoctorInputs`) and give (`Finding`); shared by `verify/doctor.py` and
`verify/node_checks.py`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from gaudi3_scale.train.config import RunConfig

__all__ = [
    "DoctorInputs",
    "Finding",
    "Status",
    "doctor_inputs",
    "fail",
    "ok",
    "one_line",
    "size_text",
    "warn",
]

Status = Literal["OK", "WARN", "FAIL"]


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One check's verdict: OK; WARN (the run may start, read the line); FAIL (the run would fail or must not start)."""

    check: str
    status: Status
    detail: str  # what was found
    fix: str = ""  # what to do, for WARN and FAIL

    def line(self) -> str:
        text = f"{self.status} {self.check}: {self.detail}"
        return f"{text}; fix: {self.fix}" if self.fix and self.status != "OK" else text

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


def one_line(text: str, limit: int = 300) -> str:
    """A tool's or an exception's message as one line of at most `limit` characters (cut in the middle)."""
    line = " ".join(text.split())
    return line if len(line) <= limit else f"{line[: limit - 80]} … {line[-75:]}"


def size_text(num_bytes: float) -> str:
    """Bytes as GiB, or MiB below one GiB."""
    return f"{num_bytes / 2**30:,.1f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:,.1f} MiB"


def ok(check: str, detail: str) -> Finding:
    return Finding(check=check, status="OK", detail=detail)


def warn(check: str, detail: str, fix: str) -> Finding:
    return Finding(check=check, status="WARN", detail=detail, fix=fix)


def fail(check: str, detail: str, fix: str) -> Finding:
    return Finding(check=check, status="FAIL", detail=detail, fix=fix)


@dataclass(frozen=True, kw_only=True)
class DoctorInputs:
    cfg: RunConfig  # the resolved run config (`--config`, `--out`, overrides), as `gaudi3 train` would see it
    rdzv_endpoint: str | None  # HOST:PORT to try; None = not set
    rdzv_source: str = ""  # where the endpoint came from, for the report
    storage_options: dict[str, Any] | None = (
        None  # fsspec options for checkpoint.remote_url (None: backend env)
    )


def doctor_inputs(cfg: RunConfig, environ: Mapping[str, str] = os.environ) -> DoctorInputs:
    """The endpoint is `parallel.rdzv_endpoint` (`--rdzv-endpoint`), else MASTER_ADDR:MASTER_PORT (torchrun's)."""
    if cfg.parallel.rdzv_endpoint:
        return DoctorInputs(
            cfg=cfg,
            rdzv_endpoint=cfg.parallel.rdzv_endpoint,
            rdzv_source="--rdzv-endpoint / parallel.rdzv_endpoint",
        )
    addr, port = environ.get("MASTER_ADDR", ""), environ.get("MASTER_PORT", "")
    if addr and port:
        return DoctorInputs(cfg=cfg, rdzv_endpoint=f"{addr}:{port}", rdzv_source="MASTER_ADDR/MASTER_PORT")
    return DoctorInputs(cfg=cfg, rdzv_endpoint=None)
