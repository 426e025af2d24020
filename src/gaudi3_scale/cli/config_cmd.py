"""Config resolution and listings shared by the CLI verbs."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from gaudi3_scale.config.core import field_help, iter_fields, type_name
from gaudi3_scale.train.config import RunConfig

__all__ = ["list_config_fields", "print_models", "wide_console"]


def wide_console() -> Console:
    """Tables stay readable when stdout is a pipe or a file (rich assumes 80 columns there)."""
    console = Console()
    return console if console.is_terminal else Console(width=140)


def list_config_fields() -> None:
    table = Table(show_header=True, header_style="bold")
    table.add_column("field")
    table.add_column("type")
    table.add_column("help")
    for name, tp, f in iter_fields(RunConfig):
        table.add_row(f"--{name}", type_name(tp), field_help(f))
    wide_console().print(table)


def print_models() -> None:
    from gaudi3_scale.models import count_parameters, get_model_config, list_models

    table = Table(show_header=True, header_style="bold")
    for column in ("name", "arch", "layers", "heads", "kv heads", "dim", "context", "vocab", "parameters"):
        table.add_column(column, justify="left" if column in ("name", "arch") else "right")
    for name in list_models():
        cfg = get_model_config(name)
        params = f"{count_parameters(cfg):,}" if cfg.vocab_size else "(vocab from data)"
        if cfg.vocab_size and cfg.num_experts:  # mixture of experts: what one token uses, too
            params += f" ({count_parameters(cfg, active=True):,} active)"
        table.add_row(
            name,
            cfg.arch,
            str(cfg.num_layers),
            str(cfg.num_heads),
            str(cfg.kv_heads),
            str(cfg.dim),
            str(cfg.context_length),
            str(cfg.vocab_size or "data"),
            params,
        )
    wide_console().print(table)
