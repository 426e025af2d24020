"""`gaudi3 serve`'s request validation and its streamed text, without a model or a server."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gaudi3_scale.data.tokenizers import ByteTokenizer, CharTokenizer, Tokenizer
from gaudi3_scale.serve.protocol import (
    RequestError,
    completion_body,
    encode_prompt,
    parse_completion_request,
    stream_chunk,
)
from gaudi3_scale.serve.text import TextStream

MODEL = "tiny"


def _parse(**body: Any) -> Any:
    return parse_completion_request(json.dumps(body).encode(), served_model=MODEL, max_tokens_limit=64)


def _refused(raw: bytes | dict[str, Any]) -> RequestError:
    data = raw if isinstance(raw, bytes) else json.dumps(raw).encode()
    with pytest.raises(RequestError) as info:
        parse_completion_request(data, served_model=MODEL, max_tokens_limit=64)
    message = info.value.message
    assert "\n" not in message and message.endswith("."), message  # one sentence, one line
    return info.value


def test_defaults_are_openais() -> None:
    request = _parse(prompt="hi")
    assert (request.model, request.prompt, request.max_tokens, request.temperature) == (MODEL, "hi", 16, 1.0)
    assert (request.top_p, request.top_k, request.seed, request.stream, request.stop, request.echo) == (
        None, None, None, False, (), False)  # fmt: skip
    full = _parse(model=MODEL, prompt=["hi"], max_tokens=64, temperature=0, top_p=0.5, top_k=3, seed=7,
                  stream=True, stop="\n", echo=True, n=1, best_of=1, logprobs=None, user="u")  # fmt: skip
    assert (full.prompt, full.max_tokens, full.temperature, full.top_p, full.top_k, full.seed) == (
        "hi", 64, 0.0, 0.5, 3, 7)  # fmt: skip
    assert full.stream and full.echo and full.stop == ("\n",)
    assert _parse(prompt="a", stop=["x", "yz"]).stop == ("x", "yz")


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"prompt": "a", "max_tokens": 65}, "max_tokens", ["65", "limit of 64"]),
        ({"prompt": "a", "max_tokens": "ten"}, "max_tokens", ["integer from 1 to 64", '"ten"']),
        ({"prompt": "a", "max_tokens": True}, "max_tokens", ["integer"]),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens", ["from 1 to 64", "got 0"]),
        ({"prompt": "a", "temperature": "hot"}, "temperature", ["number from 0 to 2"]),
        ({"prompt": "a", "temperature": 2.5}, "temperature", ["from 0 to 2", "2.5"]),
        ({"prompt": "a", "top_p": 0}, "top_p", ["above 0"]),
        ({"prompt": "a", "top_k": 0}, "top_k", ["from 1"]),
        ({"prompt": "a", "seed": -1}, "seed", ["from 0"]),
        ({"prompt": "a", "stream": "yes"}, "stream", ["true or false"]),
        ({"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, "stop", ["1 to 4"]),
        ({"prompt": "a", "stop": [""]}, "stop", ["non-empty"]),
        ({"prompt": 5}, "prompt", ["string"]),
        ({"prompt": ["a", "b"]}, "prompt", ["exactly one string"]),
        ({}, "prompt", ["string"]),
        ({"prompt": "a", "n": 2}, "n", ["not supported", "1"]),
        ({"prompt": "a", "logprobs": 5}, "logprobs", ["not supported"]),
        ({"prompt": "a", "frobnicate": 1}, "frobnicate", ["Unrecognized", "frobnicate", "max_tokens"]),
    ],
)
def test_bad_fields_are_400_naming_the_field(body: dict[str, Any], param: str, words: list[str]) -> None:
    error = _refused(body)
    assert (error.status, error.param, error.kind) == (400, param, "invalid_request_error")
    for word in words:
        assert word in error.message, (word, error.message)


def test_body_and_model_errors() -> None:
    assert "not valid JSON" in _refused(b"{bad").message
    assert "not valid JSON" in _refused(b"\xff\xfe").message
    assert "JSON object" in _refused(b"[1, 2]").message
    wrong = _refused({"model": "gpt-4", "prompt": "a"})
    assert (wrong.status, wrong.code, wrong.param) == (404, "model_not_found", "model")
    assert "'tiny'" in wrong.message and '"gpt-4"' in wrong.message
    assert wrong.body() == {"error": {"message": wrong.message, "type": "invalid_request_error",
                                      "param": "model", "code": "model_not_found"}}  # fmt: skip


def _encode_refused(prompt: str, tokenizer: Tokenizer, max_prompt_tokens: int) -> RequestError:
    with pytest.raises(RequestError) as info:
        encode_prompt(prompt, tokenizer, max_prompt_tokens=max_prompt_tokens)
    assert info.value.status == 400 and info.value.param == "prompt"
    return info.value


def test_prompt_encoding_limits() -> None:
    tok = ByteTokenizer()
    assert encode_prompt("héllo", tok, max_prompt_tokens=6) == list("héllo".encode())
    too_long = _encode_refused("x" * 9, tok, 8)
    assert too_long.code == "context_length_exceeded"
    assert "9 tokens" in too_long.message and "limit of 8" in too_long.message
    assert "no tokens" in _encode_refused("", tok, 8).message
    assert "'!'" in _encode_refused("ab!", CharTokenizer("ab"), 8).message


def test_response_shapes() -> None:
    body = completion_body("cmpl-1", MODEL, text="yo", finish_reason="stop", prompt_tokens=3,
                           completion_tokens=2, created_s=5)  # fmt: skip
    assert body == {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": MODEL,
                    "choices": [{"text": "yo", "index": 0, "logprobs": None, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}  # fmt: skip
    event = stream_chunk("cmpl-1", MODEL, 5, "é")
    assert event.startswith(b"data: {") and event.endswith(b"}\n\n")
    assert json.loads(event[len(b"data: ") :])["choices"][0] == {"text": "é", "index": 0, "logprobs": None,
                                                                  "finish_reason": None}  # fmt: skip


def _feed(stream: TextStream, ids: list[int]) -> list[str]:
    pieces = []
    for token in ids:
        pieces.append(stream.push(token))
        if stream.stopped:
            return pieces
    return [*pieces, stream.flush()]


def test_text_stream_holds_back_split_characters_and_stop_prefixes() -> None:
    decode = ByteTokenizer().decode
    assert _feed(TextStream(decode), list("aé".encode())) == ["a", "", "é", ""]  # é is 2 bytes
    stop = TextStream(decode, ["bc"])
    assert _feed(stop, list(b"abcd")) == ["a", "", ""] and stop.stopped  # "b" held back, then "bc" is a stop
    released = TextStream(decode, ["bc"])
    assert _feed(released, list(b"abd")) == ["a", "", "bd", ""] and not released.stopped
    tail = TextStream(decode, ["xyz"])
    assert _feed(tail, list(b"axy")) == ["a", "", "", "xy"]  # the end of the completion releases the tail


def _reference(ids: list[int], stops: list[str]) -> str:
    """What the completion text must be: the first decoded prefix holding a stop, cut before it; else all."""
    decode = ByteTokenizer().decode
    for end in range(1, len(ids) + 1):
        text = decode(ids[:end])
        found = [i for i in (text.find(s) for s in stops) if i >= 0]
        if found:
            return text[: min(found)]
    return decode(ids)


@given(
    text=st.text(alphabet="abcé€ ", max_size=30),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=3), max_size=3),
)
def test_text_stream_equals_whole_decoding(text: str, stops: list[str]) -> None:
    ids = list(text.encode())
    assert "".join(_feed(TextStream(ByteTokenizer().decode, stops), ids)) == _reference(ids, stops)


# ---- hostile bodies: always a 400 in one short sentence, never an exception of another kind --------------------


def _short_refusal(raw: bytes) -> RequestError:
    error = _refused(raw)
    assert error.status == 400 and len(error.message) < 400, error.message
    return error


@pytest.mark.parametrize("field", ["max_tokens", "seed", "top_k", "temperature", "top_p", "n"])
def test_integers_of_thousands_of_digits_are_400_naming_the_field(field: str) -> None:
    for digits in ("9" * 5000, "-" + "9" * 5000, "1" + "0" * 100_000, "9" * 21):
        raw = b'{"prompt": "a", "%s": %s}' % (field.encode(), digits.encode())
        error = _short_refusal(raw)
        assert error.param == field and f"({len(digits.lstrip('-'))} digits)" in error.message, error.message


def test_json_nested_past_the_parsers_limit_is_400() -> None:
    for depth in (1_000, 100_000):
        assert "nests JSON too deeply" in _short_refusal(b"[" * depth + b"]" * depth).message
        _short_refusal(b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}")
    stop = _short_refusal(b'{"prompt": "a", "stop": ' + b"[" * 200 + b"]" * 200 + b"}")
    assert stop.param == "stop" and "got [[[…]]]." in stop.message


@pytest.mark.parametrize("constant", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_json_numbers_are_400(constant: bytes) -> None:
    error = _short_refusal(b'{"prompt": "a", "temperature": ' + constant + b"}")
    assert f"{constant.decode().lstrip('-')} is not a JSON number" in error.message


def test_huge_values_are_quoted_short() -> None:
    huge = "x" * 1_000_000
    for body, param in (({"prompt": "a", "n": huge}, "n"), ({"prompt": {huge: 1}}, "prompt"),
                        ({"prompt": "a", huge: 1}, huge[:60]), ({"prompt": "a", "stop": [huge] * 9}, "stop"),
                        ({"prompt": "a", "stop": [[[[[[1]]]]]]}, "stop")):  # fmt: skip
        assert _short_refusal(json.dumps(body).encode()).param == param
    infinite = _short_refusal(b'{"prompt": "a", "temperature": 1e999}')  # a float literal too large: inf
    assert infinite.param == "temperature" and "got Infinity" in infinite.message
    lone = _short_refusal(b'{"prompt": "ab\\ud800"}')
    assert lone.param == "prompt" and "unpaired surrogate at character 2" in lone.message


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(["prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stream",
                                        "stop", "echo", "n", "logit_bias", "model", "user", "x"]), _JSON))  # fmt: skip
def test_any_json_body_is_a_request_or_a_one_line_400_or_404(body: dict[str, Any]) -> None:
    try:
        request = parse_completion_request(json.dumps(body).encode(), served_model=MODEL, max_tokens_limit=64)
    except RequestError as error:
        assert error.status in (400, 404) and "\n" not in error.message and len(error.message) < 400
    else:
        assert isinstance(request.prompt, str) and 1 <= request.max_tokens <= 64
