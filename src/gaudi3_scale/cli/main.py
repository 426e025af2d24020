"""`gaudi3` command line: one table of verbs, each a thin function over the library.

Bad input never shows a traceback: `UserInputError` and click's usage errors become one line on stderr and exit
code 2.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click

from gaudi3_scale.cli.benchmark_cmd import benchmark
from gaudi3_scale.cli.ckpt_cmd import ckpt
from gaudi3_scale.cli.cost_cmd import cost
from gaudi3_scale.cli.dashboard_cmd import dashboard
from gaudi3_scale.cli.deploy_cmd import deploy
from gaudi3_scale.cli.doctor_cmd import doctor, doctor_before_training
from gaudi3_scale.cli.health_cmd import health
from gaudi3_scale.cli.options import Count, Number, Seed, launch_options, launch_overrides
from gaudi3_scale.cli.plan_cmd import plan
from gaudi3_scale.cli.repro_cmd import repro
from gaudi3_scale.cli.serve_cmd import serve
from gaudi3_scale.cli.smoke_cmd import smoke
from gaudi3_scale.cli.tune_cmd import tune
from gaudi3_scale.config.errors import INTERRUPTED_EXIT_CODE, UserInputError, print_error
from gaudi3_scale.process_exit import skip_exit_collection

__all__ = ["VERBS", "benchmark_alias", "cli", "deploy_alias", "main", "train_alias"]

_OVERRIDES = {"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": ["-h", "--help"]}


def _fail(message: str) -> None:
    print_error(message)
    sys.exit(2)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="gaudi3-scale")
def cli() -> None:
    """Train LLMs with one config from a laptop to multi-node GPU or Gaudi clusters."""


@cli.command(
    context_settings=_OVERRIDES,
    epilog="Any config field can be set as --section.field VALUE, e.g. --model.num_layers 6.",
)
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="run config YAML")
@click.option("--out", "out_dir", help="output directory (default runs/<name>)")
@click.option("--resume", help="auto (default), never, or a checkpoint path")
@click.option("--print-config", is_flag=True, help="print the resolved config as YAML and exit")
@click.option("--list-fields", is_flag=True, help="list every config field with its help and exit")
@click.option(
    "--sample-tokens",
    type=Count(low=0),
    default=200,
    show_default=True,
    help="tokens of text to sample after training",
)
@click.option("--progress/--no-progress", default=True, help="progress bar and summary table")
@click.option(
    "--profile",
    is_flag=False,
    flag_value="5:10",
    default=None,
    metavar="[START:END]",
    help="record optimizer steps START..END-1 (alone: 5:10) with torch.profiler into <out>/profile/",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="build the model on meta, print each rank's parameter shards and estimated peak memory; train nothing",
)
@launch_options
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
def train(
    config_path: str | None,
    out_dir: str | None,
    resume: str | None,
    print_config: bool,
    list_fields: bool,
    sample_tokens: int,
    progress: bool,
    profile: str | None,
    dry_run: bool,
    overrides: tuple[str, ...],
    **launch: Any,
) -> None:
    """Train a model (default: shakespeare-char on the bundled corpus); several ranks with --nproc-per-node."""
    from gaudi3_scale.cli.config_cmd import list_config_fields
    from gaudi3_scale.train.config import config_yaml, resolve_config
    from gaudi3_scale.train.worker import profile_overrides

    if list_fields:
        list_config_fields()
        return
    profile, overrides = _profile_value(profile, overrides)
    overrides = (*overrides, *launch_overrides(launch), *profile_overrides(profile))
    cfg = resolve_config(config_path, overrides, out_dir=out_dir, resume=resume)
    if print_config:
        click.echo(config_yaml(cfg), nl=False)
        return
    from gaudi3_scale.cli.train_cmd import print_dry_run, run_training

    if dry_run:
        print_dry_run(cfg)
        return
    doctor_before_training(config_path, out_dir, overrides)  # in the training image only

    worker_args = [
        *(["--config", config_path] if config_path else []),
        *(["--out", out_dir] if out_dir else []),
    ]
    worker_args += [*(["--resume", resume] if resume else []), "--sample-tokens", str(sample_tokens)]
    worker_args += [*([] if progress else ["--no-progress"]), *overrides]
    run_training(cfg, worker_args, sample_tokens=sample_tokens, progress=progress)


def _profile_value(profile: str | None, overrides: tuple[str, ...]) -> tuple[str | None, tuple[str, ...]]:
    """`--profile`'s value and the overrides without it. Click does not give an optional value that starts with
    '-' to its option (`--profile -1:2`, even `--profile=-1:2`): it leaves it among the overrides, where it would be
    refused as a stray argument. A signed START:END there is taken back, so `profile_overrides` refuses it naming
    --profile; no override is a bare argument of that shape."""
    if profile is not None:
        for i, arg in enumerate(overrides):
            if _SIGNED_WINDOW.fullmatch(arg):
                return arg, overrides[:i] + overrides[i + 1 :]
    return profile, overrides


_SIGNED_WINDOW = re.compile(r"-[0-9][^:]*:.*")


@cli.command()
@click.argument("sources", nargs=-1, required=True)
@click.option(
    "--tokenizer", default="char", show_default=True, help="char, byte, bpe, or a tokenizer.json path"
)
@click.option("--vocab-size", type=Count(), help="vocabulary size to train (bpe)")
@click.option(
    "--val-fraction",
    type=Number(integer=False),
    default=0.1,
    show_default=True,
    help="tail of each shard held out",
)
@click.option(
    "--seed", type=Seed(), default=0, show_default=True, help="split seed (recorded in the manifest)"
)
@click.option(
    "--shard-mb",
    type=Number(integer=False, above=0.0),
    default=64.0,
    show_default=True,
    help="source text per shard, MiB (the unit of parallel work)",
)
@click.option("--text-field", default="text", show_default=True, help="the text column of JSONL / Parquet")
@click.option(
    "--out",
    "out_dir",
    help="output directory (default: the cache directory), or an fsspec URL to publish to (s3://bucket/prefix)",
)
@click.option("--workers", type=Count(), default=1, show_default=True, help="tokenizer worker processes")
@click.option("--force", is_flag=True, help="rebuild even when the inputs are unchanged")
def prepare(sources: tuple[str, ...], **options: Any) -> None:
    """Tokenize text files, globs, directories or a bundled corpus into train/val token shards."""
    from gaudi3_scale.cli.prepare_cmd import run_prepare

    run_prepare(sources, **options)


@cli.command()
@click.argument("checkpoint", type=click.Path())
@click.option("--prompt", default="", help="text to continue (default: a newline)")
@click.option("--max-new-tokens", type=Count(low=0), default=200, show_default=True)
@click.option(
    "--temperature", type=Number(integer=False, low=0), default=0.8, show_default=True, help="0 = greedy"
)
@click.option("--top-k", type=Count(), default=200, show_default=True)
@click.option("--seed", type=Seed(), default=0, show_default=True)
@click.option("--tokenizer", "tokenizer_dir", help="tokenizer directory (default: <run>/tokenizer)")
def generate(
    checkpoint: str,
    prompt: str,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    seed: int,
    tokenizer_dir: str | None,
) -> None:
    """Sample text from a checkpoint (its step-X directory or state.ckpt)."""
    from gaudi3_scale.artifacts.inference import generate_text, load_for_generation

    model, tok = load_for_generation(Path(checkpoint), tokenizer_dir)
    click.echo(
        generate_text(
            model, tok, prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed
        )
    )


@cli.command(name="models")
def models_cmd() -> None:
    """List the model registry with parameter counts."""
    from gaudi3_scale.cli.config_cmd import print_models

    print_models()


cli.add_command(ckpt)
cli.add_command(repro)
cli.add_command(serve)
cli.add_command(smoke)
cli.add_command(tune)
cli.add_command(benchmark)
cli.add_command(cost)
cli.add_command(dashboard)
cli.add_command(deploy)
cli.add_command(doctor)
cli.add_command(health)
cli.add_command(plan)

VERBS: dict[str, Callable[..., Any]] = {name: cmd for name, cmd in cli.commands.items()}  # pinned by a test


def main(argv: Sequence[str] | None = None, *, prog_name: str = "gaudi3") -> None:
    """Run `gaudi3 ARGV…`; with no `argv`, this process's own command line (the `gaudi3` console script, `python -m
    gaudi3_scale.cli`), whose exit then skips the final garbage collections (`process_exit`)."""
    if argv is None:
        skip_exit_collection()
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        cli.main(args=args, prog_name=prog_name, standalone_mode=False)
    except click.exceptions.Abort:  # Ctrl-C (KeyboardInterrupt) or end of input at a prompt
        click.echo("gaudi3: interrupted", err=True)
        sys.exit(INTERRUPTED_EXIT_CODE)
    except click.exceptions.NoArgsIsHelpError as exc:
        click.echo(exc.ctx.get_help() if exc.ctx else str(exc))
        sys.exit(2)
    except click.ClickException as exc:
        _fail(exc.format_message().replace("\n", " "))
    except UserInputError as exc:
        _fail(str(exc))


def _alias(verb: str) -> None:
    """The `gaudi3-VERB` console script: `gaudi3 VERB` with this process's own arguments, its exit as `main`'s."""
    skip_exit_collection()
    main([verb, *sys.argv[1:]], prog_name=f"gaudi3-{verb}")


def benchmark_alias() -> None:
    """`gaudi3-benchmark …` is `gaudi3 benchmark …` (the name the seed promised)."""
    _alias("benchmark")


def deploy_alias() -> None:
    """`gaudi3-deploy …` is `gaudi3 deploy …`."""
    _alias("deploy")


def train_alias() -> None:
    """`gaudi3-train …` is `gaudi3 train …` (the name the seed promised)."""
    _alias("train")
