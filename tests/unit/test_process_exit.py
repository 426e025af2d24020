"""The process entry points exit without the final garbage collections (`process_exit.skip_exit_collection`):
`python -m gaudi3_scale.cli`, the console scripts' functions and every rank's `python -m gaudi3_scale.train` leave
the collector frozen after the last atexit hook; a program that calls `cli.main.main([...])` keeps its collector.

Each case is a fresh interpreter whose first atexit hook (so the last to run) prints `gc.get_freeze_count()`.
What the skip saves is measured by benchmarks/bench_process_exit.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Registered before anything else, so it runs after every other atexit hook: what finalization then starts from.
PROBE = (
    "import atexit, gc, sys\n"
    "atexit.register(lambda: print('frozen objects at exit:', gc.get_freeze_count(), file=sys.stderr))\n"
)


def _frozen_at_exit(body: str) -> int:
    proc = subprocess.run([sys.executable, "-c", PROBE + body], capture_output=True, text=True, timeout=120)
    [line] = [line for line in proc.stderr.splitlines() if line.startswith("frozen objects at exit:")]
    return int(line.rsplit(" ", 1)[1])


@pytest.mark.parametrize(
    "body",
    [
        # `python -m gaudi3_scale.cli --version`
        "import runpy\nsys.argv = ['gaudi3', '--version']\nrunpy.run_module('gaudi3_scale.cli', run_name='__main__')",
        # the `gaudi3` console script: `sys.exit(main())`
        "from gaudi3_scale.cli.main import main\nsys.argv = ['gaudi3', 'models']\nsys.exit(main())",
        # the `gaudi3-train` console script
        "from gaudi3_scale.cli.main import train_alias\nsys.argv = ['gaudi3-train', '--print-config']\n"
        "sys.exit(train_alias())",
        # a rank: `python -m gaudi3_scale.train`, the command every launcher starts in each rank
        "import runpy\nsys.argv = ['train', '--print-config']\n"
        "runpy.run_module('gaudi3_scale.train', run_name='__main__')",
    ],
    ids=["python-m-cli", "gaudi3", "gaudi3-train", "python-m-train"],
)
def test_an_entry_point_exits_with_the_collector_frozen(body: str) -> None:
    assert _frozen_at_exit(body) > 1000


def test_a_program_calling_main_keeps_its_collector() -> None:
    body = "from gaudi3_scale.cli.main import main\nmain(['models'])\nimport torch"
    assert _frozen_at_exit(body) == 0
