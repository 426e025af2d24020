"""The OpenAI completions API as `gaudi3 serve` speaks it: request validation, response and error bodies.

Shapes follow OpenAI's legacy completions reference (https://platform.openai.com/docs/api-reference/completions):
the request fields below, `text_completion` objects, `data: {chunk}` Server-Sent Events ending in `data: [DONE]`,
and errors as `{"error": {"message", "type", "param", "code"}}`. `top_k` is an extension (vLLM has it too).
No torch here: the HTTP layer validates a request before the engine sees it.

Hostile bodies are 400s like any other bad request: a number with thousands of digits is kept as `Oversized` (never
converted: Python refuses ints over 4,300 digits, and converting is quadratic), NaN and Infinity are not JSON, a
body nested deeper than the parser's recursion limit is refused, and a message quotes a value at most
`QUOTE_CHARS` long and two levels deep.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from gaudi3_scale.config import strict_json
from gaudi3_scale.config.errors import UserInputError
from gaudi3_scale.data.tokenizers import Tokenizer

__all__ = [
    "MAX_STOP_STRINGS",
    "CompletionRequest",
    "Oversized",
    "RequestError",
    "completion_body",
    "encode_prompt",
    "error_body",
    "new_completion_id",
    "parse_completion_request",
    "shown",
    "sse_event",
    "stream_chunk",
]

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
MAX_STOP_STRINGS = 4  # OpenAI: "up to 4 sequences"
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a 64-bit seed
MAX_INT_DIGITS = 20  # every integer field fits (MAX_SEED has 19 digits); longer ones stay text (`Oversized`)
QUOTE_CHARS = 60  # the longest rendering of a client's value inside an error message
# Fields of OpenAI's request that we accept only at their default (the value that changes nothing).
_ONLY_DEFAULT: dict[str, Any] = {
    "n": 1,
    "best_of": 1,
    "logprobs": None,
    "suffix": None,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logit_bias": None,
}
_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stream", "stop", "echo",
           "user", *_ONLY_DEFAULT}  # fmt: skip


class Oversized:
    """An integer literal of more than `MAX_INT_DIGITS` digits, as sent: out of every field's range."""

    def __init__(self, literal: str) -> None:
        self.literal = literal

    def __repr__(self) -> str:
        return f"{self.literal[:12]}…({len(self.literal.lstrip('-'))} digits)"


def _parse_int(literal: str) -> int | Oversized:
    return int(literal) if len(literal.lstrip("-")) <= MAX_INT_DIGITS else Oversized(literal)


def _not_json(constant: str) -> Any:
    raise RequestError(400, f"The request body is not valid JSON ({constant} is not a JSON number); "
                            "send a JSON object.")  # fmt: skip


def _sketch(value: Any, depth: int) -> str:
    """JSON-like, down to `depth` containers and 4 items each (bounded, however deep the client nested)."""
    if isinstance(value, dict | list):
        if depth == 0:
            return "{…}" if isinstance(value, dict) else "[…]"
        if isinstance(value, dict):
            parts = [f"{json.dumps(str(k))}: {_sketch(v, depth - 1)}" for k, v in list(value.items())[:4]]
        else:
            parts = [_sketch(v, depth - 1) for v in value[:4]]
        inner = ", ".join(parts + (["…"] if len(value) > 4 else []))
        return f"{{{inner}}}" if isinstance(value, dict) else f"[{inner}]"
    if isinstance(value, str):
        return json.dumps(value[: QUOTE_CHARS + 1])  # `shown` cuts it to length
    if isinstance(value, Oversized):
        return repr(value)
    return json.dumps(value)  # a number, true, false or null


def shown(value: Any) -> str:
    """A client's value as an error message quotes it: JSON-like, at most `QUOTE_CHARS` characters."""
    return clipped(_sketch(value, depth=2))


def clipped(text: str) -> str:
    """A client's text (a path, a method) as an error message quotes it: at most `QUOTE_CHARS` characters."""
    return text if len(text) <= QUOTE_CHARS else text[: QUOTE_CHARS - 1] + "…"


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type: object, array, string, number, boolean or null."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    kinds = ((dict, "object"), (list, "array"), (str, "string"), (int | float, "number"))
    return next((name for kind, name in kinds if isinstance(value, kind)), type(value).__name__)


class RequestError(Exception):
    """A request the server refuses: an HTTP status and OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return error_body(self.message, param=self.param, code=self.code, kind=self.kind)


def error_body(
    message: str, *, param: str | None = None, code: str | None = None, kind: str = "invalid_request_error"
) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True, kw_only=True)
class CompletionRequest:
    """A validated `POST /v1/completions` body."""

    model: str
    prompt: str
    max_tokens: int
    temperature: float  # 0 = greedy
    top_p: float | None
    top_k: int | None
    seed: int | None  # None: a fresh random seed per request
    stream: bool
    stop: tuple[str, ...]
    echo: bool


def _invalid(message: str, param: str | None = None) -> RequestError:
    return RequestError(400, message, param=param)


def _number(body: dict[str, Any], name: str, default: float | None, low: float, high: float) -> float | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, Oversized):
        raise _invalid(f"{name} must be from {low:g} to {high:g}, got {shown(value)}.", name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _invalid(f"{name} must be a number from {low:g} to {high:g}, got {shown(value)}.", name)
    if not low <= value <= high:
        raise _invalid(f"{name} must be from {low:g} to {high:g}, got {value:g}.", name)
    return float(value)


def _integer(body: dict[str, Any], name: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, Oversized) or (isinstance(value, int) and not low <= value <= high):
        raise _invalid(f"{name} must be from {low} to {high}, got {shown(value)}.", name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid(f"{name} must be an integer from {low} to {high}, got {shown(value)}.", name)
    return value


def _boolean(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _invalid(f"{name} must be true or false, got {shown(value)}.", name)
    return value


def _max_tokens(body: dict[str, Any], limit: int) -> int:
    value = body.get("max_tokens")
    if value is None:
        return min(DEFAULT_MAX_TOKENS, limit)
    if isinstance(value, Oversized):
        raise _invalid(f"max_tokens must be from 1 to {limit}, got {shown(value)}.", "max_tokens")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _invalid(f"max_tokens must be an integer from 1 to {limit}, got {shown(value)}.", "max_tokens")
    if value > limit:
        raise _invalid(
            f"max_tokens is {value}, over this server's limit of {limit} (gaudi3 serve --max-tokens-limit); "
            f"ask for at most {limit}.",
            "max_tokens",
        )
    return value


def _prompt(body: dict[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise _invalid(
            f"prompt must be a string (or a list of exactly one string), got {shown(prompt)}.",
            "prompt",
        )
    try:
        prompt.encode()
    except (
        UnicodeEncodeError
    ) as exc:  # JSON allows "\ud800" alone; no tokenizer (nor a UTF-8 reply) can hold it
        raise _invalid(f"prompt is not valid Unicode: an unpaired surrogate at character {exc.start}.",
                       "prompt") from None  # fmt: skip
    return prompt


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stops, list)
        or not 0 < len(stops) <= MAX_STOP_STRINGS
        or not all(isinstance(s, str) and s for s in stops)
    ):
        raise _invalid(
            f"stop must be a non-empty string or a list of 1 to {MAX_STOP_STRINGS} non-empty strings, "
            f"got {shown(stop)}.",
            "stop",
        )
    return tuple(stops)


def _check_fields(body: dict[str, Any]) -> None:
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise _invalid(
            f"Unrecognized request argument {shown(unknown[0])}; accepted: {', '.join(sorted(_FIELDS))}.",
            unknown[0][:QUOTE_CHARS],
        )
    for name, default in _ONLY_DEFAULT.items():
        value = body.get(name, default)
        # a JSON boolean is not the number 1 or 0; n and best_of are integers (1.0 is not one)
        wrong_type = isinstance(value, bool) or (name in ("n", "best_of") and not isinstance(value, int))
        if (
            value is not None
            and (wrong_type or value != default)
            and not (name == "logit_bias" and value == {})
        ):
            raise _invalid(
                f"{name}={shown(value)} is not supported by this server; "
                f"leave it out or set it to {json.dumps(default)}.",
                name,
            )


def _load_body(raw: bytes) -> Any:
    try:
        return json.loads(raw, parse_int=_parse_int, parse_constant=_not_json)
    except RecursionError:
        raise _invalid("The request body nests JSON too deeply to parse; a completion request is a JSON "
                       "object of plain fields.") from None  # fmt: skip
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise _invalid(
            f"The request body is not valid JSON ({_one_line(exc)}); send a JSON object."
        ) from None


def _one_line(exc: Exception) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 2 * QUOTE_CHARS else text[: 2 * QUOTE_CHARS - 1] + "…"


def parse_completion_request(raw: bytes, *, served_model: str, max_tokens_limit: int) -> CompletionRequest:
    """A `POST /v1/completions` body checked field by field; `RequestError` names the first problem."""
    body = _load_body(raw)
    if not isinstance(body, dict):
        raise _invalid(f"The request body must be a JSON object, got a JSON {json_type(body)}.")
    _check_fields(body)
    if body.get("user") is not None and not isinstance(body["user"], str):  # OpenAI's end-user id: a string
        raise _invalid(f"user must be a string, got {shown(body['user'])}.", "user")
    model = body.get("model", served_model)
    if model != served_model:
        raise RequestError(
            404,
            f"The model {shown(model)} does not exist; this server serves {served_model!r}.",
            param="model",
            code="model_not_found",
        )
    max_tokens = _max_tokens(body, max_tokens_limit)
    temperature = _number(body, "temperature", DEFAULT_TEMPERATURE, 0.0, MAX_TEMPERATURE)
    assert temperature is not None
    top_p = _number(body, "top_p", None, 0.0, 1.0)
    if top_p == 0.0:
        raise _invalid("top_p must be above 0 and at most 1, got 0.", "top_p")
    return CompletionRequest(
        model=served_model,
        prompt=_prompt(body),
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=_integer(body, "top_k", None, 1, 2**31),
        seed=_integer(body, "seed", None, 0, MAX_SEED),
        stream=_boolean(body, "stream"),
        stop=_stop(body),
        echo=_boolean(body, "echo"),
    )


def encode_prompt(prompt: str, tokenizer: Tokenizer, *, max_prompt_tokens: int) -> list[int]:
    """The prompt's token ids, or a 400 when it encodes to nothing, to unknown symbols, or to too many tokens."""
    try:
        ids = tokenizer.encode(prompt)
    except UserInputError as exc:  # e.g. a character outside a char tokenizer's alphabet
        raise _invalid(f"prompt cannot be encoded: {exc}.", "prompt") from None
    if not ids:
        raise _invalid(
            "prompt encodes to no tokens; send at least one character (there is no start-of-text token).",
            "prompt",
        )
    if len(ids) > max_prompt_tokens:
        raise RequestError(
            400,
            f"prompt is {len(ids)} tokens long, over this server's limit of {max_prompt_tokens} tokens "
            "(gaudi3 serve --max-prompt-tokens); shorten it.",
            param="prompt",
            code="context_length_exceeded",
        )
    return ids


def new_completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def _choice(text: str, finish_reason: str | None) -> dict[str, Any]:
    return {"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}


def completion_body(
    completion_id: str,
    model: str,
    *,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    created_s: int | None = None,
) -> dict[str, Any]:
    """A finished completion: OpenAI's `text_completion` object with `usage`."""
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": int(time.time()) if created_s is None else created_s,
        "model": model,
        "choices": [_choice(text, finish_reason)],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def stream_chunk(
    completion_id: str, model: str, created_s: int, text: str, finish_reason: str | None = None
) -> bytes:
    """One Server-Sent Event of a streamed completion (OpenAI sends no `usage` in these by default)."""
    chunk = {"id": completion_id, "object": "text_completion", "created": created_s, "model": model,
             "choices": [_choice(text, finish_reason)]}  # fmt: skip
    return sse_event(chunk)


def sse_event(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else strict_json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()
