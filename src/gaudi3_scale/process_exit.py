"""Exit a gaudi3 process without the interpreter's final garbage collections.

A process that imported Lightning tracks ~360,000 objects in the cyclic collector (`len(gc.get_objects())`,
2026-11-30: torch, and torch._dynamo, sympy and torchmetrics through Lightning), and CPython's finalization
collects them all more than once after the last atexit hook. A process that imported torch took 0.54 s to exit,
one with Lightning 1.16 s, a 12-step `gaudi3 train` 1.23 s; with the skip 0.12-0.16 s, and 0.4-1.1 s less CPU
(`benchmarks/bench_process_exit.py`, medians of 5, 2-core AMD EPYC, 2026-11-30:
`benchmarks/results/process_exit_cpu.json`). Every rank of a launch pays it before its launcher can exit, and so
does every `gaudi3` command.

`skip_exit_collection`, called first thing, freezes the collector's generations (`gc.freeze`) after every other
atexit hook has run; everything else finalization does — module teardown, the flush and close of sys.stdout and
sys.stderr, the atexit hooks themselves — is unchanged. What it skips is collecting the cycles still alive at
exit, whose finalizers CPython does not promise to run there anyway (the `object.__del__` reference: "It is not
guaranteed that __del__() methods are called for objects that still exist when the interpreter exits"). So nothing
of a run may rely on them: its files are written and closed (or renamed into place) by their owners, and the
interpreter joins the non-daemon threads before the first atexit hook. The test suite's runs, whose processes all
exit this way, check the files they leave.

Only process entry points call it (`python -m gaudi3_scale.train`, `python -m gaudi3_scale.cli`, the console
scripts), never code that runs inside another program: a test or a notebook that calls `cli.main.main([...])`
keeps its collector as it was.
"""

from __future__ import annotations

import atexit
import gc

__all__ = ["skip_exit_collection"]


def skip_exit_collection() -> None:
    """At this process's exit, skip the final cyclic collections; call it before the imports that register hooks."""
    # atexit runs its hooks last-registered-first: registered before torch's, Lightning's and the run's own hooks,
    # this one runs after all of them. One registered earlier still would run later: what it frees is younger than
    # the freeze and still collected.
    atexit.register(gc.freeze)
