"""`gaudi3 doctor`: each check on real inputs (a TCP listener, directories, this process's limits, a sysfs-shaped
tree, the kernel clock, an S3 server), the CLI in a subprocess, and the check `gaudi3 train` runs in the image."""

from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.train.config import RunConfig, resolve_config
from gaudi3_scale.verify.doctor import (
    BEFORE_TRAIN_ENV,
    CHECKS,
    SKIP_ENV,
    check_accelerator,
    check_versions,
    exit_code,
    run_checks,
    select_checks,
)
from gaudi3_scale.verify.finding import DoctorInputs, Finding, doctor_inputs
from gaudi3_scale.verify.network_checks import (
    RdmaDevice,
    check_checkpoint,
    check_rendezvous,
    memlock_finding,
    network_finding,
    rdma_devices,
)
from gaudi3_scale.verify.node_checks import (
    NOFILE_MIN,
    SHM_MIN_BYTES,
    check_clock,
    check_nofile,
    clock_finding,
    disk_finding,
    nofile_finding,
    read_kernel_clock,
    shm_finding,
)

INF = resource.RLIM_INFINITY


@pytest.fixture(scope="module")
def cfg() -> RunConfig:
    return resolve_config(None, [])


def _inputs(*overrides: str) -> DoctorInputs:
    return doctor_inputs(resolve_config(None, list(overrides)), environ={})


# ---- rendezvous -----------------------------------------------------------------------------------------------


def test_rendezvous_reachable_then_refused_and_where_the_endpoint_comes_from(cfg: RunConfig) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    with listener:
        found = check_rendezvous(doctor_inputs(cfg, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}))
        assert found.status == "OK" and f"127.0.0.1:{port}" in found.detail
        assert "MASTER_ADDR/MASTER_PORT" in found.detail
    # The port is closed now: refused.
    refused = check_rendezvous(_inputs(f"--parallel.rdzv_endpoint=127.0.0.1:{port}"))
    assert refused.status == "FAIL" and "refused" in refused.detail.lower(), refused.line()
    assert "--rdzv-endpoint" in refused.detail and f"TCP {port}" in refused.fix
    unresolved = check_rendezvous(_inputs("--parallel.rdzv_endpoint=no-such-host.invalid:29400"))
    assert unresolved.status == "FAIL" and "cannot resolve 'no-such-host.invalid'" in unresolved.detail
    # Neither the config nor the environment names one: nothing to test.
    assert check_rendezvous(doctor_inputs(cfg, {"MASTER_ADDR": "10.0.0.1"})).status == "OK"


# ---- disk and checkpoint directory ----------------------------------------------------------------------------


def test_disk_thresholds_and_write_checks_on_real_directories(tmp_path: Path) -> None:
    free = shutil.disk_usage(tmp_path).free
    out = tmp_path / "runs" / "new"  # not there yet: its nearest existing parent is written to
    assert disk_finding(out, checkpoint_bytes=1, keep=4).status == "OK"
    assert not list(tmp_path.iterdir()), "the write probe must leave nothing behind"
    assert disk_finding(out, checkpoint_bytes=0, keep=4).status == "OK"
    warned = disk_finding(out, checkpoint_bytes=free // 2, keep=4)  # 1 fits, 4 do not
    assert warned.status == "WARN" and "keep_last" in warned.fix
    assert disk_finding(out, checkpoint_bytes=free * 2, keep=4).status == "FAIL"
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    under_a_file = disk_finding(blocker / "run", checkpoint_bytes=1, keep=4)
    assert under_a_file.status == "FAIL" and "not a directory" in under_a_file.detail


def test_checkpoint_directory_writable_or_not(tmp_path: Path) -> None:
    found = check_checkpoint(_inputs(f"--out_dir={tmp_path / 'run'}"))
    assert found.status == "OK" and "no checkpoint.remote_url" in found.detail
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert check_checkpoint(_inputs(f"--out_dir={blocker / 'run'}")).status == "FAIL"
    assert check_checkpoint(_inputs("--checkpoint.enabled=false")).status == "OK"
    if os.geteuid() != 0:  # root writes into a read-only directory anyway
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert check_checkpoint(_inputs(f"--out_dir={locked / 'run'}")).status == "FAIL"


# ---- limits and shared memory ---------------------------------------------------------------------------------


@pytest.fixture
def nofile_limit() -> Iterator[tuple[int, int]]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    yield soft, hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_open_file_limit_of_this_process(nofile_limit: tuple[int, int], cfg: RunConfig) -> None:
    _, hard = nofile_limit
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))  # the usual default soft limit
    found = check_nofile(doctor_inputs(cfg, {}))
    assert found.status == "WARN" and "soft 1,024" in found.detail, found.line()
    assert nofile_finding(INF, INF).status == "OK" and "unlimited" in nofile_finding(INF, INF).detail
    assert nofile_finding(NOFILE_MIN, NOFILE_MIN).status == "OK"
    assert "ulimit -n" in nofile_finding(1024, INF).fix  # raisable without privilege
    assert "--ulimit nofile=" in nofile_finding(1024, 4096).fix  # the hard limit is too low as well


def test_memlock_matters_only_with_active_rdma() -> None:
    ib = [RdmaDevice("mlx5_0", "InfiniBand", True)]
    assert memlock_finding(8 * 2**20, [], nnodes=2).status == "OK"
    assert memlock_finding(8 * 2**20, [RdmaDevice("mlx5_1", "RoCE", False)], nnodes=2).status == "OK"
    assert memlock_finding(INF, ib, nnodes=2).status == "OK"
    multi = memlock_finding(8 * 2**20, ib, nnodes=2)
    assert multi.status == "FAIL" and "8,192 KiB" in multi.detail and "memlock=-1" in multi.fix
    assert memlock_finding(8 * 2**20, ib, nnodes=1).status == "WARN"


def test_shared_memory(tmp_path: Path) -> None:
    stat = os.statvfs("/dev/shm")
    found = shm_finding("/dev/shm")
    assert found.status == ("OK" if stat.f_blocks * stat.f_frsize >= SHM_MIN_BYTES else "WARN"), found.line()
    missing = shm_finding(str(tmp_path / "no-shm"))
    assert missing.status == "FAIL" and "--shm-size=1g" in missing.fix


# ---- network --------------------------------------------------------------------------------------------------


def _port(device: Path, link_layer: str, state: str, driver: Path) -> None:
    (device / "ports" / "1").mkdir(parents=True)
    (device / "ports" / "1" / "link_layer").write_text(link_layer + "\n")
    (device / "ports" / "1" / "state").write_text(state + "\n")
    (device / "device").mkdir()
    driver.mkdir(parents=True, exist_ok=True)
    (device / "device" / "driver").symlink_to(driver)


def test_rdma_devices_read_from_a_sysfs_shaped_tree_and_judged_against_presets(tmp_path: Path) -> None:
    root, drivers = tmp_path / "infiniband", tmp_path / "drivers"
    _port(root / "mlx5_0", "InfiniBand", "4: ACTIVE", drivers / "mlx5_core")
    _port(root / "mlx5_1", "Ethernet", "1: DOWN", drivers / "mlx5_core")
    _port(root / "rdmap0s6", "Unspecified", "4: ACTIVE", drivers / "efa")
    found = rdma_devices(root)
    assert found == [
        RdmaDevice("mlx5_0", "InfiniBand", True),
        RdmaDevice("mlx5_1", "RoCE", False),
        RdmaDevice("rdmap0s6", "EFA", True),
    ]
    assert rdma_devices(tmp_path / "absent") == []
    ib, efa = found[:1], found[2:]
    judge = network_finding
    assert judge("nccl-infiniband", "cuda", 2, ib, ["eth0"]).status == "OK"
    assert (
        judge("nccl-infiniband", "cuda", 2, efa, ["eth0"]).status == "FAIL"
    )  # NCCL_NET=IB does not drive EFA
    assert judge("nccl-infiniband", "cuda", 2, found[1:2], []).status == "FAIL"  # RoCE port down
    assert judge("hccl-aws-efa", "hpu", 2, ib, []).status == "FAIL"
    assert judge("hccl-aws-efa", "hpu", 2, efa, []).status == "OK"
    assert judge("nccl-ethernet", "cuda", 2, ib, []).status == "WARN"  # RDMA left unused
    assert judge("nccl-ethernet", "hpu", 2, [], []).status == "WARN"  # an NCCL preset on Gaudi
    assert judge("nccl-debug", "cuda", 1, [], []).status == "WARN"
    assert judge(None, "auto", 2, [], ["eth0"]).status == "WARN"  # several nodes over TCP
    assert judge(None, "auto", 1, [], ["eth0"]).status == "OK"


# ---- clock, accelerator, versions, selection ------------------------------------------------------------------


def test_clock_from_adjtimex(cfg: RunConfig) -> None:
    state, status, maxerror_us = read_kernel_clock()
    assert 0 <= state <= 5 and maxerror_us >= 0
    assert check_clock(doctor_inputs(cfg, {})) == clock_finding(state, status, maxerror_us)
    assert clock_finding(5, 0x40, 16_000_000).status == "WARN"  # TIME_ERROR, STA_UNSYNC: unsynchronised
    synced = clock_finding(0, 0x2001, 1500)
    assert synced.status == "OK" and "1.5 ms" in synced.detail


def test_accelerator_on_a_cpu_node_depends_on_train_device() -> None:
    if shutil.which("nvidia-smi") or shutil.which("hl-smi"):
        pytest.skip("this machine has an accelerator")
    assert check_accelerator(_inputs("--train.device=cpu")).status == "OK"
    assert check_accelerator(_inputs("--train.device=auto")).status == "WARN"
    wrong = check_accelerator(_inputs("--train.device=cuda"))
    assert wrong.status == "FAIL" and "train.device is cuda" in wrong.detail


def test_versions_meet_pyproject(cfg: RunConfig) -> None:
    found = check_versions(doctor_inputs(cfg, {}))
    assert found.status == "OK" and "lightning 2.6" in found.detail, found.line()


def test_selection_unknown_names_and_a_check_that_raises(
    cfg: RunConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert select_checks() == list(CHECKS)
    assert select_checks(["clock", "shm"]) == ["shm", "clock"]  # report order
    assert "rendezvous" not in select_checks(skip=["rendezvous"])
    with pytest.raises(
        UserInputError, match="--check: unknown check 'nosuch'; allowed: accelerator, network"
    ):
        select_checks(["nosuch"])
    with pytest.raises(UserInputError, match="--skip: unknown check 'x'"):
        select_checks(skip=["x"])

    def broken(inputs: DoctorInputs) -> Finding:
        raise RuntimeError("sysfs moved")

    monkeypatch.setitem(CHECKS, "broken", broken)
    findings = run_checks(doctor_inputs(cfg, {}), ["broken", "shm"])  # the next check still runs
    assert [f.check for f in findings] == ["broken", "shm"]
    assert findings[0].status == "FAIL" and "RuntimeError: sysfs moved" in findings[0].detail
    assert exit_code(findings) == 1 and exit_code(findings[1:]) == 0


# ---- remote checkpoint storage: a real S3 server --------------------------------------------------------------


def test_remote_checkpoint_storage_on_a_real_s3_server(tmp_path: Path) -> None:
    from s3_server import running_s3_server

    with running_s3_server("doctor") as (server, options):
        cfg = resolve_config(None, [f"--out_dir={tmp_path}", "--checkpoint.remote_url=s3://doctor/ckpt"])
        served = len(server.requests)  # the bucket was made before
        found = check_checkpoint(DoctorInputs(cfg=cfg, rdzv_endpoint=None, storage_options=options))
        assert found.status == "OK" and "s3://doctor/ckpt writable" in found.detail, found.line()
        requests = server.requests[served:]
        puts = [path for method, path in requests if method == "PUT"]
        assert len(puts) == 1 and puts[0].startswith("/doctor/ckpt/.gaudi3-doctor-")
        assert ("DELETE", puts[0]) in requests  # the probe object is removed again
        server.stop()
        down = check_checkpoint(DoctorInputs(cfg=cfg, rdzv_endpoint=None, storage_options=options))
        server.start()  # the context manager stops it
    assert down.status == "FAIL" and "AWS_ENDPOINT_URL" in down.fix, down.line()


# ---- the CLI, and the check before training -------------------------------------------------------------------


def test_cli_json_report_and_exit_code_agree(
    tmp_path: Path, gaudi3_cli: Callable[..., tuple[int, str, str]]
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gaudi3_scale.cli", "doctor", "--json", "--out", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = json.loads(done.stdout)
    assert [entry["check"] for entry in report] == list(CHECKS)
    assert all(set(entry) == {"check", "status", "detail", "fix"} for entry in report)
    assert all(entry["status"] in ("OK", "WARN", "FAIL") and entry["detail"] for entry in report)
    assert all(entry["fix"] for entry in report if entry["status"] != "OK")
    failed = any(entry["status"] == "FAIL" for entry in report)
    assert done.returncode == (1 if failed else 0), done.stderr
    code, out, err = gaudi3_cli("doctor", "--check", "nosuch")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(
        "gaudi3: error: --check: unknown check 'nosuch'; allowed: accelerator, network, shm"
    )
    # A selection that leaves nothing would pass the node gate having checked nothing.
    code, out, err = gaudi3_cli("doctor", "--check", "shm", "--skip", "shm")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(
        "gaudi3: error: --skip: skips every check selected (shm), so none would run; keep at least one of: "
        "accelerator, network, shm"
    )


def test_train_in_the_image_runs_the_doctor_first_and_stops_on_a_fail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    from gaudi3_scale.cli.doctor_cmd import doctor_before_training
    from gaudi3_scale.cli.main import main

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(BEFORE_TRAIN_ENV, "1")
    with pytest.raises(SystemExit) as stopped:
        main(["train", "--out", str(blocker / "run"), "--train.max_steps", "1"])
    out, err = capfd.readouterr()
    assert stopped.value.code == 1
    assert "FAIL disk:" in out and "FAIL checkpoint:" in out and "rendezvous" not in out
    assert f"training did not start; fix what it says, or set {SKIP_ENV}=1" in err
    assert not (tmp_path / "run").exists()
    monkeypatch.setenv(SKIP_ENV, "1")
    doctor_before_training(None, str(blocker / "run"), [])  # skipped: no doctor, no exit
    assert capfd.readouterr() == ("", "")


def test_tools_that_start_many_trainings_check_the_node_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    from gaudi3_scale.cli.doctor_cmd import doctor_once_for_trainings

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(BEFORE_TRAIN_ENV, "1")
    monkeypatch.delenv(SKIP_ENV, raising=False)
    doctor_once_for_trainings(None, [])  # this node passes (warnings at most), so no exit
    assert "OK versions:" in capfd.readouterr().out
    assert os.environ[SKIP_ENV] == "1"  # the trainings tune / repro / benchmark start next skip it
