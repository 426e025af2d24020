"""`gaudi3 doctor`'s network checks: RDMA devices against `parallel.network_preset`, the memlock limit RDMA needs,
the rendezvous endpoint, and the checkpoint storage (local directory and `checkpoint.remote_url`).

Each `check_*` reads the machine and hands the readings to a `*_finding` function that judges them; the judging
functions take plain values (or a sysfs root), so tests feed them real readings. Thresholds: docs/doctor.md.
"""

from __future__ import annotations

import os
import resource
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.verify.finding import DoctorInputs, Finding, fail, ok, one_line, warn
from gaudi3_scale.verify.node_checks import write_problem

__all__ = [
    "RdmaDevice",
    "check_checkpoint",
    "check_memlock",
    "check_network",
    "check_rendezvous",
    "memlock_finding",
    "network_finding",
    "probe_remote_storage",
    "rdma_devices",
]

RDZV_TIMEOUT_S = (
    5.0  # a TCP connect inside one cluster answers in milliseconds; 5 s means a firewall drops it
)
REMOTE_TIMEOUT_S = (
    30.0  # one small write, read and delete; longer and the store is not usable for checkpoints
)
SYSFS_INFINIBAND = Path("/sys/class/infiniband")
SYSFS_NET = Path("/sys/class/net")


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:  # a port without the file, a virtual NIC without a speed (EINVAL)
        return ""


@dataclass(frozen=True)
class RdmaDevice:
    name: str
    kind: str  # EFA (driver efa), InfiniBand or RoCE (port link layer InfiniBand / Ethernet)
    active: bool  # a port in state ACTIVE

    def __str__(self) -> str:
        return f"{self.name} ({self.kind}, {'active' if self.active else 'no active port'})"


def _rdma_kind(driver: str, link_layers: set[str]) -> str:
    if driver == "efa":
        return "EFA"
    if "InfiniBand" in link_layers:
        return "InfiniBand"
    return "RoCE" if "Ethernet" in link_layers else "unknown link layer"


def rdma_devices(root: Path = SYSFS_INFINIBAND) -> list[RdmaDevice]:
    """Every RDMA device the kernel lists: AWS EFA, InfiniBand and RoCE adapters all appear under
    /sys/class/infiniband; the driver names EFA, each port's link_layer tells InfiniBand from RoCE."""
    devices = []
    for device in sorted(root.iterdir()) if root.is_dir() else []:
        driver_link = device / "device" / "driver"
        driver = driver_link.resolve().name if driver_link.exists() else ""
        ports = sorted((device / "ports").glob("*"))
        kind = _rdma_kind(driver, {_read(port / "link_layer") for port in ports})
        active = any(_read(port / "state").endswith("ACTIVE") for port in ports)  # "4: ACTIVE"
        devices.append(RdmaDevice(device.name, kind, active))
    return devices


def _interfaces(root: Path = SYSFS_NET) -> list[str]:
    """Host network interfaces that are up, with their speed where the driver reports one."""
    found = []
    for nic in sorted(root.iterdir()) if root.is_dir() else []:
        if nic.name != "lo" and _read(nic / "operstate") == "up":
            speed = _read(nic / "speed")
            found.append(f"{nic.name} {speed} Mb/s" if speed.isdigit() else nic.name)
    return found


def network_finding(
    preset: str | None, device: str, nnodes: int, rdma: list[RdmaDevice], interfaces: list[str]
) -> Finding:
    """Does `parallel.network_preset` fit the RDMA devices present? (see distributed/network.py)"""
    from gaudi3_scale.distributed.network import get_network_preset

    active = [d for d in rdma if d.active]
    seen = f"RDMA: {', '.join(map(str, rdma)) or 'none'}; interfaces up: {', '.join(interfaces) or 'none'}"
    docs = "docs/network_presets.md"
    if preset is None:
        if nnodes > 1 and not active:
            return warn(
                "network",
                f"{seen}; {nnodes} nodes and no RDMA: collectives between nodes go over TCP",
                f"fine on an Ethernet cluster (the nccl-ethernet preset tunes it); else check the RDMA "
                f"drivers and that the container sees /dev/infiniband ({docs})",
            )
        return ok("network", f"{seen}; no preset: NCCL/HCCL choose the transport")
    backend = get_network_preset(preset).backend
    if (backend, device) in (("nccl", "hpu"), ("hccl", "cuda")):
        return warn(
            "network",
            f"{seen}; preset {preset} is for {backend.upper()}, but train.device is {device}",
            f"use a {'hccl' if device == 'hpu' else 'nccl'}-* preset ({docs})",
        )
    if preset == "nccl-infiniband" and not any(d.kind in ("InfiniBand", "RoCE") for d in active):
        return fail(
            "network",
            f"{seen}; preset nccl-infiniband forces NCCL_NET=IB, which needs an active "
            "InfiniBand or RoCE port: NCCL will fail to initialize",
            "drop the preset, or fix the adapter (ibstat) and pass /dev/infiniband into the container",
        )
    if preset == "hccl-aws-efa" and not any(d.kind == "EFA" for d in rdma):
        return fail(
            "network",
            f"{seen}; preset hccl-aws-efa needs an AWS EFA device",
            f"drop the preset (or use hccl-host-nic) on machines without EFA ({docs})",
        )
    if preset == "nccl-ethernet" and active:
        return warn(
            "network",
            f"{seen}; preset nccl-ethernet forces TCP sockets, leaving the RDMA devices unused",
            f"drop the preset (NCCL then picks RDMA), or nccl-infiniband on IB/RoCE ({docs})",
        )
    if preset.endswith("-debug"):
        return warn(
            "network",
            f"{seen}; preset {preset} logs verbosely",
            "for diagnosing only: drop it for production runs",
        )
    return ok("network", f"{seen}; preset {preset} fits")


def check_network(inputs: DoctorInputs) -> Finding:
    parallel = inputs.cfg.parallel
    return network_finding(
        parallel.network_preset, inputs.cfg.train.device, parallel.nnodes, rdma_devices(), _interfaces()
    )


def memlock_finding(soft: int, rdma: list[RdmaDevice], nnodes: int) -> Finding:
    """RDMA registers (pins) communication buffers; NCCL asks for `--ulimit memlock=-1` (unlimited)."""
    found = f"locked memory: {'unlimited' if soft == resource.RLIM_INFINITY else f'{soft // 1024:,} KiB'}"
    active = [d.name for d in rdma if d.active]
    if soft == resource.RLIM_INFINITY:
        return ok("memlock", found)
    if not active:
        return ok("memlock", f"{found}; no active RDMA device, so nothing here needs it unlimited")
    fix = "docker run --ulimit memlock=-1; systemd LimitMEMLOCK=infinity; /etc/security/limits.conf memlock unlimited"
    detail = f"{found} with RDMA devices {', '.join(active)}: registering communication buffers fails"
    return fail("memlock", detail, fix) if nnodes > 1 else warn("memlock", f"{detail} once nodes > 1", fix)


def check_memlock(inputs: DoctorInputs) -> Finding:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return memlock_finding(soft, rdma_devices(), inputs.cfg.parallel.nnodes)


# ---- rendezvous -----------------------------------------------------------------------------------------------


def check_rendezvous(inputs: DoctorInputs) -> Finding:
    """A TCP connect to the c10d rendezvous; node 0 opens it when its `gaudi3 train` starts."""
    if inputs.rdzv_endpoint is None:
        return ok(
            "rendezvous",
            "not set (one node: a free port on 127.0.0.1); test one with --rdzv-endpoint "
            "or MASTER_ADDR/MASTER_PORT",
        )
    host, _, port = inputs.rdzv_endpoint.rpartition(":")
    host = host.strip("[]")  # [::1]:29400
    where = f"{inputs.rdzv_endpoint} (from {inputs.rdzv_source})"
    if not host or not port.isdigit():
        return fail("rendezvous", f"{where} is not HOST:PORT", "give --rdzv-endpoint HOST:PORT")
    start = time.monotonic()
    try:
        with socket.create_connection((host, int(port)), timeout=RDZV_TIMEOUT_S):
            pass
    except socket.gaierror as exc:
        return fail(
            "rendezvous",
            f"{where}: cannot resolve {host!r} ({exc.strerror})",
            "use node 0's address, or a name every node resolves (DNS, /etc/hosts)",
        )
    except OSError as exc:  # refused, unreachable, or TimeoutError
        reason = f"no answer within {RDZV_TIMEOUT_S:g} s" if isinstance(exc, TimeoutError) else str(exc)
        return fail(
            "rendezvous",
            f"{where}: {reason}",
            f"start node 0's gaudi3 train first (it listens on {port}); else open TCP {port} from this "
            f"node to {host} (firewall, security group)",
        )
    return ok("rendezvous", f"{where} accepts TCP connections ({(time.monotonic() - start) * 1000:.1f} ms)")


# ---- checkpoint storage ---------------------------------------------------------------------------------------


def probe_remote_storage(url: str, storage_options: dict[str, Any] | None, *, timeout_s: float) -> str:
    """Write, read back and delete a small object under `url`; what happened as one line, or an exception.

    The storage calls run in a daemon thread, so an endpoint that never answers (botocore retries with backoff)
    costs `timeout_s`, not minutes; the thread is then abandoned, and the process does not wait for it at exit.
    """
    from gaudi3_scale.checkpoint.storage import open_remote
    from gaudi3_scale.storage import is_local_filesystem

    fs, root = open_remote(url, storage_options)  # ConfigError: a bad URL or a missing backend package
    probe = f"{root}/.gaudi3-doctor-{socket.gethostname()}-{os.getpid()}"
    payload = b"gaudi3 doctor probe\n"
    outcome: list[BaseException | bytes] = []

    def attempt() -> None:
        try:
            if is_local_filesystem(fs):
                fs.makedirs(root, exist_ok=True)
            fs.pipe_file(probe, payload)
            data = bytes(fs.cat_file(probe))
            fs.rm_file(probe)
            outcome.append(data)
        except Exception as exc:  # handed to the caller, which reports it
            outcome.append(exc)

    worker = threading.Thread(target=attempt, name="gaudi3-doctor-probe", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if not outcome:
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    if outcome[0] != payload:
        raise OSError(f"read back {len(outcome[0])} bytes that differ from the {len(payload)} written")
    return f"{url} writable (wrote, read back and deleted {len(payload)} bytes)"


def check_checkpoint(inputs: DoctorInputs) -> Finding:
    """The local checkpoint directory is writable; `checkpoint.remote_url`, if set, takes a write and a read."""
    cfg = inputs.cfg
    if not cfg.checkpoint.enabled:
        return ok("checkpoint", "checkpoint.enabled is false: nothing is written")
    local = cfg.output_dir / "checkpoints"
    problem = write_problem(local)
    if problem is not None:
        return fail("checkpoint", f"{local}: {problem}", "mount a writable volume there, or set --out")
    url = cfg.checkpoint.remote_url
    if not url:
        return ok("checkpoint", f"{local} writable; no checkpoint.remote_url")
    try:
        remote = probe_remote_storage(url, inputs.storage_options, timeout_s=REMOTE_TIMEOUT_S)
    except UserInputError as exc:
        return fail("checkpoint", str(exc), "fix checkpoint.remote_url, or install what the message names")
    except Exception as exc:  # any storage error is the finding
        return fail(
            "checkpoint",
            f"{url}: {type(exc).__name__}: {one_line(str(exc))}",
            "check the endpoint, bucket and credentials (s3://: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, "
            "AWS_SECRET_ACCESS_KEY) and that this node may write there",
        )
    return ok("checkpoint", f"{local} writable; {remote}")
