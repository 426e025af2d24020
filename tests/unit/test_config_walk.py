"""The run config stays at the top: from `gaudi3 train` (cli/train_cmd.py:run_training) the whole `RunConfig`
reaches only the CLI, the trainer's assembly and preflight; every component below takes its own section or a plan.

The walk is static (tests/config_walk.py): it follows the value itself through calls, aliases, attributes of
`self` and dataclass fields, not its sections.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import gaudi3_scale
from config_walk import Package, walk

ROOT = Path(gaudi3_scale.__file__).parent

# Who may hold the whole run config on the way from `gaudi3 train` to the fit: the CLI, the config's own helpers,
# the trainer's assembly (worker → GaudiTrainer → the parts after each step, whose checkpoints hold the whole config
# and its hash), preflight and the resume decision (its part of preflight), the benchmark record the CLI writes
# after a run, and the forecast's assembly (forecast.run resolves the run's plans for `gaudi3 plan` and the forecast
# `gaudi3 train` records; the forecast model below it takes the plans and the train and checkpoint sections).
MAY_SEE_THE_RUN_CONFIG = {
    "gaudi3_scale.cli.train_cmd",
    "gaudi3_scale.config.core",
    "gaudi3_scale.train.config",  # the RunConfig's own module: config_dict, its file form
    "gaudi3_scale.train.worker",
    "gaudi3_scale.train.trainer",
    "gaudi3_scale.train.parts",
    "gaudi3_scale.train.preflight",
    "gaudi3_scale.train.resume",
    "gaudi3_scale.bench.cell",
    "gaudi3_scale.forecast.run",
}


def test_the_run_config_reaches_only_the_cli_the_assembly_and_preflight() -> None:
    reached = walk(Package(ROOT), "gaudi3_scale.cli.train_cmd", "run_training", "cfg")
    assert len(reached.modules) <= 20, reached.modules
    assert set(reached.modules) - MAY_SEE_THE_RUN_CONFIG == set(), reached.reached
    assert "gaudi3_scale.train.trainer" in reached.modules  # the walk does reach the assembly


def test_the_walk_follows_aliases_attributes_fields_and_reexports(tmp_path: Path) -> None:
    """The walker can fail: a synthetic package where the value travels each way the walk follows."""
    pkg = tmp_path / "pkg"
    (pkg / "low").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "low/__init__.py": '_LAZY = {"Holder": "pkg.low.holder"}\n',
        "low/holder.py": """
            from dataclasses import dataclass
            from pkg.low.sink import consume

            @dataclass
            class Holder:
                cfg: object
                def use(self):
                    consume(self.cfg)
            """,
        "low/sink.py": "def consume(value):\n    return value\n\ndef narrow(section):\n    return section\n",
        "low/runner.py": """
            from pkg.low import Holder

            class Runner:
                def __init__(self, config=None):
                    config = config or object()
                    self.config = config
                def go(self):
                    c = self.config
                    Holder(c)
            """,
        "top.py": """
            from pkg.low import sink
            from pkg.low.runner import Runner

            def main(cfg):
                sink.narrow(cfg.section)  # a section: not followed
                Runner(config=cfg)
            """,
    }
    for name, text in files.items():
        (pkg / name).write_text(textwrap.dedent(text))
    reached = walk(Package(pkg), "pkg.top", "main", "cfg")
    assert reached.modules == ["pkg.top", "pkg.low.runner", "pkg.low.holder", "pkg.low.sink"]
    assert ("pkg.low.sink", "narrow") not in reached.reached
    assert ("pkg.low.sink", "consume") in reached.reached
