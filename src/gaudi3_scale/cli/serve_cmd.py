"""`gaudi3 serve`: an OpenAI-compatible completion server (POST /v1/completions) over a checkpoint or an export."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from gaudi3_scale.cli.options import Count, Number, Port
from gaudi3_scale.config.errors import UserInputError

# requests one server holds at once, per kind (waiting, decoding): the kernel's listen() backlog is their sum
MAX_CONNECTIONS = 2**16

if TYPE_CHECKING:
    from gaudi3_scale.serve.decoding import KvCacheMode

__all__ = ["serve"]


MAX_CLIENT_TIMEOUT_S = 3600.0


@click.command()
@click.argument("model_or_checkpoint")
@click.option("--host", default="127.0.0.1", show_default=True, metavar="ADDRESS",
              help="address to bind (0.0.0.0: every interface; there is no authentication)")  # fmt: skip
@click.option("--port", type=Port(), default=8000, show_default=True,
              help="TCP port (0: any free port, printed on start)")  # fmt: skip
@click.option("--max-batch-size", type=Count(high=MAX_CONNECTIONS), default=8, show_default=True,
              help="requests decoded together in one forward pass")  # fmt: skip
@click.option("--max-queue", type=Count(high=MAX_CONNECTIONS), default=64, show_default=True,
              help="requests waiting for a batch slot; more are refused with 503")  # fmt: skip
@click.option("--kv-cache", type=click.Choice(["dynamic", "static", "off"]), default="dynamic", show_default=True,
              help="dynamic: a KV cache slot per request, each decode step as wide as the batch; static: every "
                   "step decodes all --max-batch-size slots over the whole context (fixed shapes, for CUDA graphs); "
                   "off: recompute the context at every token")  # fmt: skip
@click.option("--max-prompt-tokens", type=Count(), default=None,
              help="longest prompt in tokens (default: the model's context length)")  # fmt: skip
@click.option("--max-tokens-limit", type=Count(), default=512, show_default=True,
              help="largest max_tokens a request may ask for")  # fmt: skip
@click.option("--client-timeout-s", default=15.0, show_default=True,
              type=Number(integer=False, above=0, high=MAX_CLIENT_TIMEOUT_S,
                          expected=f"expected seconds in (0, {MAX_CLIENT_TIMEOUT_S:g}]"),
              help="seconds a client has to send its whole request (else 408), and to take each write of the "
                   "answer (else it is dropped)")  # fmt: skip
@click.option("--tokenizer", "tokenizer_dir", type=click.Path(file_okay=False, path_type=Path),
              help="directory with tokenizer.json (default: the run's or the export's tokenizer/)")  # fmt: skip
@click.option("--name", help="model name clients send as `model` (default: the model config's name)")
@click.option("--tracking-uri", metavar="URI",
              help="MLflow registry for a models:/NAME/VERSION argument (default: $MLFLOW_TRACKING_URI)")  # fmt: skip
def serve(
    model_or_checkpoint: str,
    host: str,
    port: int,
    max_batch_size: int,
    max_queue: int,
    kv_cache: KvCacheMode,
    max_prompt_tokens: int | None,
    max_tokens_limit: int,
    client_timeout_s: float,
    tokenizer_dir: Path | None,
    name: str | None,
    tracking_uri: str | None,
) -> None:
    """Serve a run, checkpoint, `ckpt export` directory or registered model (models:/NAME/VERSION) over OpenAI's
    completions API."""
    from gaudi3_scale.serve.loading import resolve_source

    path = Path(model_or_checkpoint)
    if tracking_uri is not None and not model_or_checkpoint.startswith("models:/"):
        raise UserInputError("--tracking-uri is for a registered model argument (models:/NAME/VERSION) only")
    if model_or_checkpoint.startswith("models:/"):
        from gaudi3_scale.artifacts.register import fetch_registered
        from gaudi3_scale.data.sources import default_cache_dir

        path = fetch_registered(model_or_checkpoint, tracking_uri, default_cache_dir() / "registry")
        name = name or model_or_checkpoint.split("/")[1]
    source = resolve_source(path)  # before the slow imports: a bad path fails at once
    from gaudi3_scale.serve.lifecycle import bind_server, build_app, serve_until_signal, server_url
    from gaudi3_scale.serve.server import listen_backlog

    # before loading: a busy port fails at once too
    server = bind_server(host, port, backlog=listen_backlog(max_queue, max_batch_size),
                         client_timeout_s=client_timeout_s)  # fmt: skip
    try:
        app = build_app(source, tokenizer_dir=tokenizer_dir, name=name, max_batch_size=max_batch_size,
                        max_queue=max_queue, kv_cache=kv_cache, max_prompt_tokens=max_prompt_tokens,
                        max_tokens_limit=max_tokens_limit)  # fmt: skip
    except BaseException:
        server.server_close()
        raise
    served = app.served
    ready_line = f"serving {served.name} ({served.num_parameters:,} parameters) on {server_url(host, server)}"
    serve_until_signal(server, app, click.echo, ready_line=ready_line)
