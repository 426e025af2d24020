"""`pl.Trainer(accelerator="hpu", ...)` arguments a Gaudi run cannot honour are refused in one line: Lightning's own
strategies (they would not use hccl) and device counts or card lists the node cannot give. Both Lightning
namespaces, in a fresh interpreter; the Gaudi node is a stand-in (8 usable HPUs, nothing Habana imported), as
these are hardware-only paths. Not yet validated on Gaudi hardware."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import importlib, json, sys
import gaudi3_scale.device.hpu as hpu, gaudi3_scale.device.gaudi_accelerator as ga
hpu.hpu_available = ga.hpu_available = lambda: True
hpu.hpu_device_count = ga.hpu_device_count = lambda: 8
ga.require_hpu = lambda: None
forms = {"ddp": dict(strategy="ddp", devices=8), "ddp_spawn": dict(strategy="ddp_spawn", devices=8),
         "deepspeed": dict(strategy="deepspeed", devices=8), "habana_ddp": dict(strategy="habana_ddp", devices=8),
         "16": dict(devices=16), "abc": dict(devices="abc"), "[3, 5]": dict(devices=[3, 5]),
         "[0, 1]": dict(devices=[0, 1]), "auto": dict(devices="auto")}
out = {}
for ns in ("lightning.pytorch", "pytorch_lightning"):
    pl = importlib.import_module(ns)
    import gaudi3_scale  # registers hpu in the namespaces imported so far
    for name, kw in forms.items():
        try:
            t = pl.Trainer(accelerator="hpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                           enable_model_summary=False, **kw)
            out[f"{ns} {name}"] = f"{type(t.strategy).__name__} {len(t.strategy.parallel_devices)}"
        except Exception as exc:
            out[f"{ns} {name}"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def test_strategies_and_devices_a_gaudi_run_cannot_honour_are_one_line() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    allowed_devices = "allowed: 1 to 8 (the HPUs visible here), 'auto', -1, or the list [0, ..., n-1]"
    for ns in ("lightning.pytorch", "pytorch_lightning"):
        for strategy in ("ddp", "ddp_spawn", "deepspeed"):
            assert out[f"{ns} {strategy}"] == (
                f"UserInputError: strategy: '{strategy}' does not run over HCCL on Gaudi (HPU); allowed: auto, "
                "habana_ddp, habana_fsdp, single_device"
            )
        assert out[f"{ns} habana_ddp"] == "HPUDDPStrategy 8"
        assert (
            out[f"{ns} 16"]
            == f"UserInputError: devices: 16 HPUs requested but only 8 are visible here; {allowed_devices}"
        )
        assert (
            out[f"{ns} abc"] == f"UserInputError: devices: 'abc' is not a number of HPUs; {allowed_devices}"
        )
        assert out[f"{ns} [3, 5]"] == (
            "UserInputError: devices: [3, 5] on Gaudi picks cards, but each rank takes the card of its local rank; "
            + allowed_devices
        )
        assert out[f"{ns} [0, 1]"] == "HPUDDPStrategy 2"
        assert out[f"{ns} auto"] == "HPUDDPStrategy 8"
