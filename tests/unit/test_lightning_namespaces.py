"""A user's Lightning script as written, under `lightning.pytorch` and `pytorch_lightning`, in fresh interpreters.

Off Gaudi the description's Trainer call must reach our one "no HPU here" line (never a Lightning registry error),
whichever namespace and import order the script uses. With a stand-in Habana package that only reports 8 HPUs
(tests/assets/fake_habana_site: it runs nothing), the Trainer defaults we add for Gaudi are checked: strategy
"auto", the precision plugin, the registered strategies' classes and backend.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gaudi3_scale.device.hpu import hpu_available

pytestmark = pytest.mark.skipif(hpu_available(), reason="checks the behaviour without Gaudi")

FAKE_HABANA = Path(__file__).parents[1] / "assets" / "fake_habana_site"

# The description's train.py, as far as the Trainer: both ways of naming the accelerator.
NO_GAUDI = """
import {first}
import {second}
import lightning.pytorch, pytorch_lightning
from gaudi3_scale.config.errors import UserInputError
for pl in (lightning.pytorch, pytorch_lightning):
    assert "hpu" in pl.accelerators.AcceleratorRegistry, pl.__name__
    assert {{"habana_ddp", "habana_fsdp"}} <= set(pl.strategies.StrategyRegistry), pl.__name__
    for make_accelerator in ("GaudiAccelerator()", "'hpu'"):
        for strategy in ("habana_ddp", "auto"):
            try:
                from gaudi3_scale import GaudiAccelerator
                pl.Trainer(accelerator=eval(make_accelerator), devices=8, strategy=strategy, precision="bf16-mixed",
                           max_epochs=3, gradient_clip_val=1.0, accumulate_grad_batches=4)
            except UserInputError as exc:
                assert str(exc).startswith("Gaudi (HPU) was requested but no HPU is usable here"), exc
            else:
                raise AssertionError("a Trainer was built without Gaudi")
print("OK")
"""

ON_FAKE_GAUDI = """
import gaudi3_scale
import {namespace} as pl
from gaudi3_scale import GaudiAccelerator
from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.distributed.lightning_ns import plugins_for

ns = plugins_for(pl.__name__)
quiet = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
t = pl.Trainer(accelerator="hpu", devices=8, precision="bf16-mixed", **quiet)
assert type(t.strategy) is ns.ddp and isinstance(t.strategy, pl.strategies.DDPStrategy), type(t.strategy)
assert t.strategy.process_group_backend == "hccl" and len(t.strategy.parallel_devices) == 8
assert type(t.precision_plugin) is ns.precision and isinstance(t.precision_plugin, pl.plugins.precision.Precision)
assert t.precision_plugin.precision == "bf16-mixed"

t = pl.Trainer(accelerator=GaudiAccelerator(), devices=1, precision="bf16-true", **quiet)
assert type(t.strategy) is ns.single and isinstance(t.strategy, pl.strategies.SingleDeviceStrategy), type(t.strategy)
assert t.strategy.root_device.type == "hpu" and t.precision_plugin.precision == "bf16-true"

# In lazy mode the graph is cut after each backward and each optimizer step, on one HPU and over hccl alike (as
# lightning-habana's strategies did): the strategies' own hooks, whatever the user's LightningModule does.
import torch
import gaudi3_scale.distributed.hpu as hpu_strategies
marks = []
hpu_strategies.mark_step = lambda: marks.append("mark_step")
for strategy in (t.strategy, pl.Trainer(accelerator="hpu", devices=8, **quiet).strategy):
    strategy.post_backward(torch.ones(()))
    strategy.precision_plugin.optimizer_step = lambda optimizer, model, closure, **kwargs: "stepped"
    assert strategy.optimizer_step(None, lambda: None, model=pl.LightningModule()) == "stepped"
assert marks == ["mark_step"] * 4, marks

t = pl.Trainer(accelerator="hpu", devices=8, strategy="habana_fsdp", **quiet)
assert isinstance(t.strategy, pl.strategies.ModelParallelStrategy) and t.strategy.process_group_backend == "hccl"
assert t.precision_plugin.precision == "32-true"

t = pl.Trainer(accelerator="hpu", devices=2, plugins=[ns.precision("bf16-mixed", cache_fp32_weights=True)], **quiet)
assert t.precision_plugin.cache_fp32_weights

from gaudi3_scale.precision import GaudiMixedPrecision  # the seed's object (lightning.pytorch's), in either namespace
plugin = GaudiMixedPrecision("bf16-true")
t = pl.Trainer(accelerator="hpu", devices=2, plugins=[plugin], **quiet)
assert t.precision_plugin is plugin and type(plugin) is ns.precision and plugin.precision == "bf16-true"

try:
    pl.Trainer(accelerator="hpu", devices=8, precision="16-mixed", **quiet)
except UserInputError as exc:
    assert str(exc) == "precision='16-mixed' is not supported on Gaudi (HPU); allowed: bf16-mixed, bf16-true, 32-true"
else:
    raise AssertionError("16-mixed was accepted on Gaudi")

# The rest of Lightning is untouched: cpu keeps Lightning's own choices.
t = pl.Trainer(accelerator="cpu", devices=1, precision="bf16-mixed", **quiet)
assert type(t.strategy) is pl.strategies.SingleDeviceStrategy and type(t.precision_plugin).__name__ == "MixedPrecision"
print("OK")
"""


def _start(code: str, *, fake_gaudi: bool) -> subprocess.Popen[str]:
    paths = [str(Path("src").resolve())] + ([str(FAKE_HABANA)] if fake_gaudi else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_the_description_script_runs_as_written_in_both_namespaces() -> None:
    # Four fresh interpreters side by side: each import order, then the Gaudi defaults in each namespace.
    procs = [
        _start(NO_GAUDI.format(first="gaudi3_scale", second="pytorch_lightning"), fake_gaudi=False),
        _start(NO_GAUDI.format(first="pytorch_lightning", second="gaudi3_scale"), fake_gaudi=False),
        _start(ON_FAKE_GAUDI.format(namespace="pytorch_lightning"), fake_gaudi=True),
        _start(ON_FAKE_GAUDI.format(namespace="lightning.pytorch"), fake_gaudi=True),
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0 and out.strip().endswith("OK"), err[-3000:]


def test_registration_never_imports_lightning_by_itself() -> None:
    code = "import sys, gaudi3_scale; print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'lightning', 'pytorch_lightning')))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"


def test_unknown_namespace_is_named() -> None:
    from gaudi3_scale.distributed.lightning_ns import plugins_for

    with pytest.raises(
        ValueError, match=r"unknown Lightning namespace 'lightning\.fabric'; allowed: lightning"
    ):
        plugins_for("lightning.fabric")
