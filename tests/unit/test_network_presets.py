"""Network presets: every variable is sourced, user exports win, and launched workers really see the values."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gaudi3_scale.config import ConfigError
from gaudi3_scale.config.core import parse_overrides
from gaudi3_scale.distributed.config import ParallelConfig
from gaudi3_scale.distributed.network import (
    NETWORK_PRESETS,
    NetworkPreset,
    apply_network_preset,
    register_network_preset,
)
from gaudi3_scale.train.config import build_run_config


def test_every_variable_of_every_preset_has_an_https_source() -> None:
    assert {"nccl-debug", "nccl-ethernet", "nccl-infiniband"} <= set(NETWORK_PRESETS)
    for name, preset in NETWORK_PRESETS.items():
        assert preset.name == name and preset.backend in ("nccl", "hccl")
        assert preset.variables and set(preset.sources) == set(preset.variables), name
        for variable, url in preset.sources.items():
            assert url.startswith("https://"), (name, variable, url)
        prefix = "https://docs.nvidia.com/" if preset.backend == "nccl" else "https://docs.habana.ai/"
        assert all(url.startswith(prefix) for url in preset.sources.values()), name


def test_no_preset_holds_a_site_specific_setting() -> None:
    site_specific = ("IFNAME", "NCCL_IB_HCA", "GID_INDEX", "COMM_ID", "HABANA_LOGS")
    for preset in NETWORK_PRESETS.values():
        for variable in preset.variables:
            assert not any(part in variable for part in site_specific), (preset.name, variable)


def test_hccl_presets_say_they_are_not_validated_on_gaudi() -> None:
    hccl = [p for p in NETWORK_PRESETS.values() if p.backend == "hccl"]
    assert hccl
    for preset in hccl:
        assert "not yet validated on gaudi hardware" in preset.description.lower(), preset.name


def test_apply_sets_only_unset_variables_and_returns_them(caplog: pytest.LogCaptureFixture) -> None:
    env = {"NCCL_DEBUG": "WARN", "PATH": "/bin"}
    with caplog.at_level(logging.INFO, logger="gaudi3_scale.distributed.network"):
        applied = apply_network_preset("nccl-debug", env)
    assert applied == {"NCCL_DEBUG_SUBSYS": "INIT,ENV,NET"}
    assert env == {"NCCL_DEBUG": "WARN", "PATH": "/bin", "NCCL_DEBUG_SUBSYS": "INIT,ENV,NET"}
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos == ["network preset nccl-debug: NCCL_DEBUG_SUBSYS=INIT,ENV,NET"]


def test_a_users_export_wins_even_when_empty() -> None:
    env = {"NCCL_NET": "", "NCCL_SOCKET_NTHREADS": "8"}
    applied = apply_network_preset("nccl-ethernet", env)
    assert applied == {"NCCL_NSOCKS_PERTHREAD": "4"}
    assert env["NCCL_NET"] == "" and env["NCCL_SOCKET_NTHREADS"] == "8"


def test_applying_twice_sets_nothing_the_second_time() -> None:
    env: dict[str, str] = {}
    first = apply_network_preset("nccl-ethernet", env)
    assert first == NETWORK_PRESETS["nccl-ethernet"].variables
    assert apply_network_preset("nccl-ethernet", env) == {}
    assert env == first


def test_none_sets_nothing() -> None:
    env = {"HOME": "/root"}
    assert apply_network_preset(None, env) == {}
    assert env == {"HOME": "/root"}


def test_the_default_target_is_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in NETWORK_PRESETS["nccl-infiniband"].variables:
        monkeypatch.setenv(variable, "placeholder")  # recorded, so teardown restores the original state…
        monkeypatch.delenv(variable)  # …then unset for the test
    assert apply_network_preset("nccl-infiniband") == {"NCCL_NET": "IB"}
    assert os.environ["NCCL_NET"] == "IB"


def test_unknown_preset_is_one_line_naming_the_field_and_the_choices() -> None:
    with pytest.raises(ConfigError) as exc:
        apply_network_preset("nccl-fast", {})
    message = str(exc.value)
    assert "\n" not in message
    assert message.startswith("parallel.network_preset: got 'nccl-fast'; allowed: ")
    assert all(name in message for name in NETWORK_PRESETS)


def test_parallel_config_validates_the_preset_name() -> None:
    assert ParallelConfig(network_preset="nccl-ethernet").network_preset == "nccl-ethernet"
    assert ParallelConfig().network_preset is None
    with pytest.raises(ConfigError) as exc:
        ParallelConfig(network_preset="nope")
    assert exc.value.field == "network_preset" and "got 'nope'" in str(exc.value)
    with pytest.raises(ConfigError, match=r"^parallel\.network_preset: got 'nope'; allowed: hccl-aws-efa"):
        build_run_config(overrides=parse_overrides(["--parallel.network_preset", "nope"]))
    cfg = build_run_config(overrides=parse_overrides(["--parallel.network_preset", "nccl-debug"]))
    assert cfg.parallel.network_preset == "nccl-debug"


def test_a_preset_without_a_source_for_each_variable_is_refused() -> None:
    preset = NetworkPreset(
        name="unsourced",
        backend="nccl",
        description="test",
        variables={"NCCL_DEBUG": "INFO", "NCCL_NET": "IB"},
        sources={"NCCL_DEBUG": "https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html"},
    )
    with pytest.raises(ValueError, match="NCCL_NET"):
        register_network_preset(preset)
    assert "unsourced" not in NETWORK_PRESETS
    with pytest.raises(ValueError, match="already registered"):
        register_network_preset(NETWORK_PRESETS["nccl-debug"])


# Runs in every Python process of the test's subprocess tree (it is on PYTHONPATH); only launched workers (LOCAL_RANK
# set) write down what they inherited. The venv has no sitecustomize of its own and no user site, so this shadows
# nothing (checked below).
_PROBE = """\
import json, os
if "LOCAL_RANK" in os.environ:
    names = ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS")
    path = os.path.join(os.environ["NETWORK_PRESET_PROBE"], "rank%s.json" % os.environ["RANK"])
    with open(path, "w") as f:
        json.dump({name: os.environ.get(name) for name in names}, f)
"""


@pytest.mark.distributed
def test_launched_workers_inherit_the_preset_but_keep_a_users_export(tmp_path: Path) -> None:
    if importlib.util.find_spec("sitecustomize") is not None:
        pytest.skip("this interpreter already has a sitecustomize; the probe would shadow it")
    probe, out = tmp_path / "probe", tmp_path / "run"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(_PROBE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_")}
    env["NCCL_DEBUG_SUBSYS"] = "COLL"  # the user's own export must survive the preset
    env["NETWORK_PRESET_PROBE"] = str(probe)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(probe), os.environ.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "gaudi3_scale.cli", "train", "--nproc-per-node", "2",
           "--parallel.network_preset", "nccl-debug", "--train.max_steps", "1", "--train.val_every_steps", "0",
           "--train.val_batches", "1", "--no-progress", "--sample-tokens", "0", "--checkpoint.enabled", "false",
           "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = {p.name: json.loads(p.read_text()) for p in sorted(probe.glob("rank*.json"))}
    expected = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "COLL"}
    assert seen == {"rank0.json": expected, "rank1.json": expected}
    assert "network_preset: nccl-debug" in (out / "config.yaml").read_text()
