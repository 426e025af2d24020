"""`gaudi3 dashboard`: serve the read-only web dashboard over a runs directory."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import click

from gaudi3_scale.cli.options import Port
from gaudi3_scale.config.errors import UserInputError

__all__ = ["dashboard"]

_INSTALL = "pip install 'gaudi3-scale[dashboard]'"
# = dashboard.security.TOKEN_ENV, spelled out so that `gaudi3` does not import the dashboard (Jinja, psutil…) to start
TOKEN_ENV = "GAUDI3_DASHBOARD_TOKEN"


@click.command()
@click.option(
    "--runs",
    "runs_dir",
    default="runs",
    show_default=True,
    metavar="DIR",
    help="runs and benchmarks directory",
)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    metavar="ADDRESS",
    help="address to bind; anything but loopback requires a token",
)
@click.option(
    "--port", type=Port(), default=8080, show_default=True, metavar="PORT", help="TCP port (0: any free port)"
)
@click.option("--token", envvar=TOKEN_ENV, show_envvar=True, metavar="TOKEN",
              help="token every request must carry (default off loopback: a random one, printed with the URL)")  # fmt: skip
def dashboard(runs_dir: str, host: str, port: int, token: str | None) -> None:
    """Web dashboard: run list, live loss/throughput/MFU, resources, cost and TCO, benchmarks, checkpoints."""
    if importlib.util.find_spec("flask") is None:
        raise UserInputError(f"the dashboard needs Flask: {_INSTALL}")
    runs = Path(runs_dir)
    if not runs.is_dir():
        raise UserInputError(f"--runs: {runs_dir!r} is not a directory (train with --out {runs_dir}/NAME)")
    if not host.strip():
        raise UserInputError("--host: expected an address such as 127.0.0.1 or 0.0.0.0")
    from gaudi3_scale.dashboard.server import build_server, dashboard_url, resolve_token, serve

    required, generated = resolve_token(host, token)
    server = build_server(runs, host, port, required)
    url = dashboard_url(host, server.port, required if generated else None)
    click.echo(f"dashboard of {runs.resolve()} at {url}")
    if generated:
        click.echo(f"  bound to {host}: every request needs this token (set your own with --token or "
                   f"{TOKEN_ENV}); Ctrl-C stops")  # fmt: skip
    elif required is not None:
        click.echo(f"  every request needs the token given with --token or {TOKEN_ENV} (not printed); "
                   "open …/?token=TOKEN once, or send 'Authorization: Bearer TOKEN'")  # fmt: skip
    serve(server, click.echo)
