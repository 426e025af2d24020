"""`gaudi3 serve`: an OpenAI-compatible completion server with continuous batching, on the standard library.

    protocol   request validation, response / error / stream bodies (no torch)
    text       incremental detokenization and stop strings (no torch)
    engine     the decode thread: iteration-level batching, per-request sampling
    decoding   next-token logits of the batch: a KV cache slot per request, or the context recomputed
    loading    what can be served (run, checkpoint, safetensors export) and loading it
    server     HTTP handler on `http.server.ThreadingHTTPServer`
    lifecycle  bind, serve until SIGTERM / SIGINT, drain

Names load on first access, so importing the package does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gaudi3_scale.lazy import lazy_exports

if TYPE_CHECKING:
    from gaudi3_scale.serve.decoding import last_position_logits
    from gaudi3_scale.serve.engine import Engine
    from gaudi3_scale.serve.loading import ServedModel, load_served_model, resolve_source
    from gaudi3_scale.serve.protocol import CompletionRequest, RequestError, parse_completion_request

__all__ = [
    "CompletionRequest",
    "Engine",
    "RequestError",
    "ServedModel",
    "last_position_logits",
    "load_served_model",
    "parse_completion_request",
    "resolve_source",
]

_LAZY = {
    "CompletionRequest": "gaudi3_scale.serve.protocol",
    "RequestError": "gaudi3_scale.serve.protocol",
    "parse_completion_request": "gaudi3_scale.serve.protocol",
    "Engine": "gaudi3_scale.serve.engine",
    "last_position_logits": "gaudi3_scale.serve.decoding",
    "ServedModel": "gaudi3_scale.serve.loading",
    "load_served_model": "gaudi3_scale.serve.loading",
    "resolve_source": "gaudi3_scale.serve.loading",
}

__getattr__ = lazy_exports(__name__, _LAZY)
