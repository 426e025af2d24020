"""Click options shared by the commands that launch training (`train`, `repro`, `tune`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import click

__all__ = ["launch_options", "launch_overrides"]

F = TypeVar("F", bound=Callable[..., Any])

_LAUNCH_OPTIONS = (
    click.option("--nproc-per-node", type=int, help="ranks per node (= --parallel.nproc_per_node)"),
    click.option("--nnodes", type=int, help="nodes (= --parallel.nnodes)"),
    click.option("--node-rank", type=int, help="this node's rank (= --parallel.node_rank)"),
    click.option("--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous (= --parallel.rdzv_endpoint)"),
    click.option("--max-restarts", type=int, help="worker group restarts (= --parallel.max_restarts)"),
)


def launch_options(command: F) -> F:
    """Add the launch-geometry flags; the command receives them as keyword arguments (None when not given)."""
    for option in reversed(_LAUNCH_OPTIONS):
        command = option(command)
    return command


def launch_overrides(launch: Mapping[str, Any]) -> list[str]:
    """The given launch flags as `--parallel.FIELD=VALUE` config overrides."""
    return [f"--parallel.{key}={value}" for key, value in launch.items() if value is not None]
