"""`gaudi3 doctor`: what a node needs before a training run, one finding per check.

Each check is a function of `DoctorInputs` (the resolved run config, the rendezvous endpoint, storage options)
that returns one `Finding` (verify/finding.py): OK, WARN or FAIL, what was found, and the fix. `CHECKS` is the
registry, a plain dict in report order. The host checks (shared memory, open files, disk, clock) live in
`verify/node_checks.py`, the network ones (RDMA and presets, memlock, rendezvous, checkpoint storage) in
`verify/network_checks.py`, the accelerator and version checks here. Nothing heavy (torch, fsspec) is
imported until a check runs, so the CLI lists and validates check names at once. docs/doctor.md: thresholds, why.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterable

from gaudi3_scale.config.errors import UserInputError, brief
from gaudi3_scale.verify import network_checks, node_checks
from gaudi3_scale.verify.finding import DoctorInputs, Finding, doctor_inputs, fail, ok, one_line, warn

__all__ = [
    "BEFORE_TRAIN_ENV",
    "CHECKS",
    "SKIPPED_BEFORE_TRAIN",
    "SKIP_ENV",
    "DoctorInputs",
    "Finding",
    "check_accelerator",
    "check_versions",
    "doctor_inputs",
    "exit_code",
    "run_checks",
    "select_checks",
]

# `gaudi3 train` runs the checks first where BEFORE_TRAIN_ENV is "1" (the training image sets it) and SKIP_ENV is
# not "1" (an emergency switch). Node 0 opens the rendezvous only once its training starts, so before training a
# refused connection is expected on every node: that check is left out there.
BEFORE_TRAIN_ENV = "GAUDI3_DOCTOR_BEFORE_TRAIN"
SKIP_ENV = "GAUDI3_SKIP_DOCTOR"
SKIPPED_BEFORE_TRAIN = ("rendezvous",)
_TOOL_TIMEOUT_S = 10.0
UNVALIDATED = "not yet validated on Gaudi hardware"


# ---- accelerator ----------------------------------------------------------------------------------------------


def _tool_output(args: list[str]) -> str | None:
    """stdout of a vendor tool, or None when it fails (what that means is decided by the caller)."""
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=_TOOL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _package_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _gaudi_finding(hl_smi: str | None) -> Finding | None:
    """None when this is no Gaudi node. Not yet validated on Gaudi hardware: the `driver_version` field of
    `hl-smi -Q` is the one Gaudi users' scripts read; the Intel Gaudi software version is the version of the
    `habana-torch-plugin` package (habana_frameworks)."""
    from gaudi3_scale.device.hpu import hpu_device_count
    from gaudi3_scale.monitor.system import query_hl_smi

    usable = hpu_device_count()
    if hl_smi is None and usable == 0:
        return None
    if hl_smi is None:
        return ok("accelerator", f"{usable} Gaudi (HPU) device(s); no hl-smi; {UNVALIDATED}")
    try:
        seen = len(query_hl_smi(hl_smi))
    except (OSError, subprocess.TimeoutExpired, RuntimeError, ValueError) as exc:
        return fail(
            "accelerator",
            f"hl-smi failed: {one_line(str(exc))}",
            "check the habanalabs driver (dmesg), and run the container with --runtime=habana",
        )
    driver = (_tool_output([hl_smi, "-Q", "driver_version", "-f", "csv,noheader"]) or "?").splitlines()[0]
    plugin = _package_version("habana-torch-plugin") or "not installed"
    versions = (
        f"driver {driver}, Intel Gaudi software {plugin}, torch {_package_version('torch')}; {UNVALIDATED}"
    )
    if usable == 0:
        return fail(
            "accelerator",
            f"hl-smi sees {seen} Gaudi(s) but torch sees no HPU ({versions})",
            "use Intel's PyTorch image (habana_frameworks) and run the container with --runtime=habana "
            "-e HABANA_VISIBLE_DEVICES=all",
        )
    return ok("accelerator", f"{usable} Gaudi (HPU) device(s) of {seen} on the node; {versions}")


def _nvidia_finding(nvidia_smi: str | None) -> Finding | None:
    """None when this is no NVIDIA node; driver from nvidia-smi, CUDA and NCCL as this torch build has them."""
    import torch

    usable = torch.cuda.device_count() if torch.cuda.is_available() else 0
    rows = (
        _tool_output([nvidia_smi, "--query-gpu=name,driver_version", "--format=csv,noheader"])
        if nvidia_smi
        else None
    )
    if rows is None and usable == 0:
        return None
    lines = (rows or "").splitlines()
    driver = lines[0].rsplit(",", 1)[-1].strip() if lines else "?"
    if usable == 0:
        return fail(
            "accelerator",
            f"nvidia-smi sees {len(lines)} GPU(s) (driver {driver}) but torch "
            f"{torch.__version__} sees none (built for CUDA {torch.version.cuda})",
            "install a CUDA build of torch this driver supports; run the container with --gpus all",
        )
    nccl = (
        ".".join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else "absent"
    )
    return ok(
        "accelerator",
        f"{usable}x {torch.cuda.get_device_name(0)}; driver {driver}; CUDA "
        f"{torch.version.cuda} (torch {torch.__version__}); NCCL {nccl}",
    )


def check_accelerator(inputs: DoctorInputs) -> Finding:
    """Gaudi first, then NVIDIA, else a CPU node; judged against `train.device`."""
    wanted = inputs.cfg.train.device
    gaudi = _gaudi_finding(shutil.which("hl-smi"))
    nvidia = None if gaudi else _nvidia_finding(shutil.which("nvidia-smi"))
    found, kind = (gaudi, "hpu") if gaudi else (nvidia, "cuda") if nvidia else (None, "cpu")
    if found is not None and found.status == "FAIL":
        return found
    if wanted in ("cuda", "hpu") and wanted != kind:
        has = "no GPU or Gaudi" if found is None else found.detail
        return fail(
            "accelerator",
            f"train.device is {wanted}, but this node has {has}",
            f"run on a {wanted} node, or set --train.device auto",
        )
    if found is not None:
        return found
    cpu_node = "no GPU or Gaudi found: a CPU-only node"
    if wanted == "cpu":
        return ok("accelerator", f"{cpu_node} (train.device cpu)")
    return warn(
        "accelerator",
        f"{cpu_node}; train.device auto will train on the CPU",
        "fine for a CPU run (say so with --train.device cpu); on a GPU or Gaudi node check the driver "
        "(nvidia-smi, hl-smi) and the container runtime (--gpus all, --runtime=habana)",
    )


# ---- versions -------------------------------------------------------------------------------------------------


def check_versions(inputs: DoctorInputs) -> Finding:
    """Python and every core dependency (torch, lightning, …) against the installed gaudi3-scale's requirements,
    which are pyproject.toml's. Extras are not checked: a missing extra is named when a feature needs it."""
    import platform
    from importlib.metadata import PackageNotFoundError, metadata, requires

    from packaging.requirements import Requirement  # a dependency of lightning
    from packaging.specifiers import SpecifierSet

    python = platform.python_version()
    try:
        python_spec, required = (
            metadata("gaudi3-scale")["Requires-Python"] or "",
            requires("gaudi3-scale") or [],
        )
    except PackageNotFoundError:
        return warn(
            "versions",
            f"python {python}; gaudi3-scale is not installed, so its requirements are unknown",
            "pip install -e . (or the wheel) into this environment",
        )
    wrong = [] if SpecifierSet(python_spec).contains(python) else [f"python {python} (needs {python_spec})"]
    for requirement in map(Requirement, required):
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue  # an extra's requirement
        have = _package_version(requirement.name)
        if have is None or not requirement.specifier.contains(have, prereleases=True):
            wrong.append(f"{requirement.name} {have or 'missing'} (needs {requirement.specifier or 'any'})")
    shown = f"python {python}, torch {_package_version('torch')}, lightning {_package_version('lightning')}"
    if wrong:
        return fail(
            "versions",
            f"{shown}; outside pyproject's ranges: {', '.join(wrong)}",
            "reinstall: pip install -c requirements/constraints.txt -e .",
        )
    return ok("versions", f"{shown}; every core requirement of pyproject.toml is met")


# ---- registry and run -----------------------------------------------------------------------------------------

Check = Callable[[DoctorInputs], Finding]
CHECKS: dict[str, Check] = {
    "accelerator": check_accelerator,
    "network": network_checks.check_network,
    "shm": node_checks.check_shm,
    "nofile": node_checks.check_nofile,
    "memlock": network_checks.check_memlock,
    "disk": node_checks.check_disk,
    "clock": node_checks.check_clock,
    "versions": check_versions,
    "rendezvous": network_checks.check_rendezvous,
    "checkpoint": network_checks.check_checkpoint,
}


def select_checks(only: Iterable[str] = (), skip: Iterable[str] = ()) -> list[str]:
    """The checks to run, in report order; an unknown name, or a selection that leaves none (which would pass the
    node gate without checking anything), is one `UserInputError` listing the valid ones."""
    only, skip = list(only), list(skip)
    for flag, names in (("--check", only), ("--skip", skip)):
        unknown = [name for name in names if name not in CHECKS]
        if unknown:
            raise UserInputError(f"{flag}: unknown check {brief(unknown[0])}; allowed: {', '.join(CHECKS)}")
    selected = [name for name in CHECKS if (not only or name in only) and name not in skip]
    if not selected:
        raise UserInputError(
            f"--skip: skips every check selected ({', '.join(only or CHECKS)}), so none would run; keep at least "
            f"one of: {', '.join(CHECKS)}"
        )
    return selected


def run_checks(inputs: DoctorInputs, names: Iterable[str]) -> list[Finding]:
    """Every named check in turn; one that raises is reported as its FAIL, and the others still run."""
    findings = []
    for name in names:
        try:
            findings.append(CHECKS[name](inputs))
        except Exception as exc:  # a broken check must not hide the others; the FAIL names the exception
            detail = f"the check itself failed: {type(exc).__name__}: {one_line(str(exc))}"
            findings.append(fail(name, detail, "report this as a bug, with the line"))
    return findings


def exit_code(findings: Iterable[Finding]) -> int:
    """1 when any check FAILed, else 0: a WARN does not stop a run."""
    return 1 if any(f.status == "FAIL" for f in findings) else 0
