"""Every public import path in a fresh interpreter, in each order a user's script may write it: the package first,
`lightning.pytorch` first, `pytorch_lightning` first.

The paths are found, not listed: each public module of the package (its `__all__`; a name exported lazily gets its
own statement per home module, since only its first access imports that home) and every `gaudi3_scale` import
written in README.md and the docs site's pages (docs/**/*.md). Package first is one interpreter per statement: the statement is the first thing
the interpreter imports, so no earlier import can have loaded Lightning for it. Lightning first is one interpreter
per namespace running every statement (Lightning is loaded before any of them, so nothing is hidden). After each,
every Lightning namespace loaded must already hold our plugins, and the seed's `GaudiMixedPrecision` object must be
taken as it is by a Trainer of either namespace.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import re
import subprocess
import sys
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lightning.pytorch  # noqa: F401  (first: listing the paths here reads every name; orders run in subprocesses)
import pytest

import gaudi3_scale

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
NAMESPACES = ("lightning.pytorch", "pytorch_lightning")
IMPORT = re.compile(r"\b(from gaudi3_scale(?:\.\w+)* import \w+(?:, \w+)*|import gaudi3_scale(?:\.\w+)*)")
CHAINS = 3  # interpreters side by side for the package-first order
EXTRA = [
    "import gaudi3_scale.device.gaudi_accelerator"
]  # the accelerator's own module, as issue #36 imports it

# After each statement: every Lightning namespace it loaded already holds our plugins. In the package-first order
# the interpreter then stops once Lightning is loaded (the next statements would no longer run ahead of it), and
# the next interpreter starts after that statement.
AFTER = """
loaded = {"lightning.pytorch", "pytorch_lightning"} & set(sys.modules)
for name in loaded:
    pl = sys.modules[name]
    assert "hpu" in pl.accelerators.AcceleratorRegistry, name
    assert {"habana_ddp", "habana_fsdp"} <= set(pl.strategies.StrategyRegistry), name
print("done", flush=True)
"""
STOP = "if loaded:\n    sys.exit(0)"

# The seed's plugin object, taken as it is by a Trainer of each namespace (and back again).
PLUGIN_TAKEN = """
import lightning.pytorch, pytorch_lightning
from gaudi3_scale.precision import GaudiMixedPrecision
quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
plugin = GaudiMixedPrecision("bf16-mixed", use_flash_attention_v2=True)
for pl in (pytorch_lightning, lightning.pytorch, pytorch_lightning):
    trainer = pl.Trainer(accelerator="cpu", devices=1, plugins=[plugin], **quiet)
    assert trainer.precision_plugin is plugin and isinstance(plugin, pl.plugins.precision.Precision), pl.__name__
    assert plugin.use_flash_attention_v2 and plugin.precision == "bf16-mixed"
"""


def _module_statements(name: str) -> list[str]:
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    if exported is None:
        return [f"import {name}"]
    eager = [n for n in exported if n in vars(module)]
    lazy: dict[str, list[str]] = defaultdict(list)  # home module (or the name itself) -> names
    for n in exported:
        if n not in vars(module):
            home = getattr(getattr(module, n), "__module__", None)
            lazy[home if isinstance(home, str) else n].append(n)
    return [
        f"from {name} import {', '.join(eager)}" if eager else f"import {name}",
        *(f"from {name} import {', '.join(names)}" for names in lazy.values()),
    ]


def public_statements() -> list[str]:
    modules = ["gaudi3_scale"] + [
        f"gaudi3_scale.{info.name}"
        for info in pkgutil.iter_modules(gaudi3_scale.__path__)
        if not info.name.startswith("_")
    ]
    found = [s for name in modules for s in _module_statements(name)]
    found += [m for doc in DOCS for m in IMPORT.findall(doc.read_text(encoding="utf-8"))]
    return list(dict.fromkeys(found + EXTRA))


STATEMENTS = public_statements()


def _script(first: str | None, statements: list[str]) -> str:
    lines = ["import sys"] + ([first] if first else [])
    for statement in statements:
        lines.append(statement)
        if "GaudiMixedPrecision" in statement:
            lines.append(PLUGIN_TAKEN)
        lines += [AFTER] if first else [AFTER, STOP]
    return "\n".join(lines)


def _run(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def _package_first(statements: list[str]) -> dict[str, str]:
    """Each statement ahead of Lightning, in as few fresh interpreters as that allows; the failures' last lines."""
    failures: dict[str, str] = {}
    while statements:
        result = _run(_script(None, statements))
        ran = result.stdout.count("done\n")
        if result.returncode != 0:
            failures[statements[ran]] = (result.stderr.strip().splitlines() or [f"exit {result.returncode}"])[
                -1
            ]
            ran += 1
        statements = statements[ran:]
    return failures


def test_the_paths_cover_the_package_and_the_seed_snippets() -> None:
    # The discovery itself can fail: these must be among what it found.
    for statement in (
        "from gaudi3_scale import GaudiAccelerator",
        "from gaudi3_scale import GaudiOptimizer",
        "from gaudi3_scale.precision import GaudiMixedPrecision",
        "from gaudi3_scale.train import GaudiTrainer, build_run_config",
        "import gaudi3_scale.device.gaudi_accelerator",
    ):
        assert statement in STATEMENTS, STATEMENTS
    assert len(STATEMENTS) > 30


@pytest.mark.parametrize("first", ["package", *NAMESPACES])
def test_every_public_import_path_in_a_fresh_interpreter(first: str) -> None:
    if first == "package":
        chains = [STATEMENTS[i::CHAINS] for i in range(CHAINS)]  # side by side; each chain in order
        with ThreadPoolExecutor(CHAINS) as pool:
            failures = {k: v for found in pool.map(_package_first, chains) for k, v in found.items()}
        assert not failures, failures
    else:
        result = _run(_script(f"import {first}", STATEMENTS))
        assert result.returncode == 0 and result.stdout.count("done\n") == len(STATEMENTS), result.stderr[
            -3000:
        ]
