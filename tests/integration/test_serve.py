"""`gaudi3 serve` against a real tiny model: real server processes on 127.0.0.1, real HTTP, real signals.

One llama-tiny run (BPE tokenizer, 2 steps) is trained per module; two servers start side by side: one on the run
directory (batch 4) and one on its safetensors export (batch 1, queue 1), the latter for back-pressure and
shutdown (its last test sends SIGTERM). References come from the library: `models.generate.generate`.
"""

from __future__ import annotations

import http.client
import json
import re
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import CliResult
from gaudi3_scale.artifacts import export as exporter
from gaudi3_scale.artifacts.export import export_checkpoint
from gaudi3_scale.artifacts.inference import load_for_generation
from gaudi3_scale.config.core import parse_overrides
from gaudi3_scale.data.tokenizers import ByteTokenizer
from gaudi3_scale.models import build_model, count_parameters, get_model_config
from gaudi3_scale.models.generate import generate, sample_next_token
from gaudi3_scale.serve import loading
from gaudi3_scale.serve.decoding import CachedDecoder, RecomputeDecoder, last_position_logits
from gaudi3_scale.serve.engine import Engine
from gaudi3_scale.serve.protocol import CompletionRequest
from gaudi3_scale.train import GaudiTrainer, build_run_config

pytestmark = pytest.mark.integration

GAUDI3 = [sys.executable, "-m", "gaudi3_scale.cli"]
START_TIMEOUT_S = 90.0
SERVING = re.compile(r"^serving (\S+) \(([\d,]+) parameters\) on http://127\.0\.0\.1:(\d+)$")
CLIENT_TIMEOUT_S = 2.0  # the export server's --client-timeout-s: a stalled request is a 408 this soon


@dataclass
class Server:
    proc: subprocess.Popen[str]
    port: int
    name: str
    start_line: str
    stderr_path: Path

    def request(
        self, method: str, path: str, body: Any = None, *, raw: bytes | None = None
    ) -> tuple[int, Any]:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def complete(self, **body: Any) -> dict[str, Any]:
        status, answer = self.request("POST", "/v1/completions", body)
        assert status == 200, answer
        return answer

    def stream(self, **body: Any) -> list[dict[str, Any] | str]:
        """The `data:` payloads of a streamed completion, parsed ("[DONE]" kept as a string)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}))
        resp = conn.getresponse()
        assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
        events = resp.read().decode().split("\n\n")
        conn.close()
        assert events[-1] == "" and all(e.startswith("data: ") for e in events[:-1]), events
        return [e[6:] if e == "data: [DONE]" else json.loads(e[6:]) for e in events[:-1]]

    def health(self) -> dict[str, Any]:
        status, body = self.request("GET", "/health")
        assert status == 200
        return body

    def stderr(self) -> str:
        return self.stderr_path.read_text()


def _start(args: list[str], stderr_path: Path) -> subprocess.Popen[str]:
    with stderr_path.open("w") as err:
        return subprocess.Popen([*GAUDI3, "serve", *args, "--port", "0"], stdout=subprocess.PIPE, stderr=err,
                                text=True)  # fmt: skip


def _await_start(proc: subprocess.Popen[str], stderr_path: Path) -> Server:
    """The server once it prints its line (the port comes from it)."""
    assert proc.stdout is not None
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and selector.select(timeout=deadline - time.monotonic()):
        line = proc.stdout.readline().strip()
        if match := SERVING.match(line):
            return Server(proc, int(match.group(3)), match.group(1), line, stderr_path)
        if not line and proc.poll() is not None:
            break
    proc.kill()
    pytest.fail(f"gaudi3 serve did not start: {stderr_path.read_text()[-3000:]}")


def _stop(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.terminate()
    server.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real llama-tiny run: 2 steps, BPE tokenizer (characters span several tokens), one committed checkpoint."""
    out = tmp_path_factory.mktemp("serve") / "run"
    overrides = ["--out_dir", str(out), "--train.threads", "2", "--train.max_steps", "2", "--model.name",
                 "llama-tiny", "--optim.warmup_steps", "1", "--train.val_every_steps", "0",
                 "--checkpoint.every_steps", "2", "--data.tokenizer", "bpe", "--data.vocab_size", "384"]  # fmt: skip
    GaudiTrainer(build_run_config(None, parse_overrides(overrides)), progress=False).fit()
    return out


@pytest.fixture(scope="module")
def servers(run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    logs = tmp_path_factory.mktemp("serve-logs")
    export = run_dir.parent / "export-hf"  # the format a model registry holds (ckpt export --register)
    export_checkpoint(run_dir / "checkpoints" / "step-00000002", export, fmt="hf")
    small = [
        "--max-batch-size",
        "1",
        "--max-queue",
        "1",
        "--max-tokens-limit",
        "4096",
        "--name",
        "tiny-export",
        "--client-timeout-s",
        str(CLIENT_TIMEOUT_S),
        "--kv-cache",
        "static",  # the run's server uses the default, dynamic
    ]
    procs = [  # started together: their imports overlap
        _start([str(run_dir), "--max-batch-size", "4"], logs / "run.err"),
        _start([str(export), *small], logs / "export.err"),
    ]
    started = (_await_start(procs[0], logs / "run.err"), _await_start(procs[1], logs / "export.err"))
    yield started
    for server in started:
        _stop(server)


@pytest.fixture(scope="module")
def server(servers: tuple[Server, Server]) -> Server:
    return servers[0]


@pytest.fixture(scope="module")
def export_server(servers: tuple[Server, Server]) -> Server:
    return servers[1]


@pytest.fixture(scope="module")
def reference(run_dir: Path) -> Callable[..., str]:
    """The completion text `models.generate.generate` gives for the same request, one sequence alone."""
    model, tok = load_for_generation(run_dir / "checkpoints" / "step-00000002")

    def complete(prompt: str, max_tokens: int, temperature: float = 0.0, seed: int = 0, **kw: Any) -> str:
        ids = tok.encode(prompt)
        out = generate(model, torch.tensor([ids]), max_new_tokens=max_tokens, temperature=temperature,
                       generator=torch.Generator().manual_seed(seed), **kw)  # fmt: skip
        return tok.decode(out[0, len(ids) :].tolist())

    return complete


PROMPTS = ["ROMEO:", "First Citizen:\nBefore we proceed", "KING", "O, what a rogue",
           "To be, or not", "Speak, speak.", "All:\nResolved.", "MENENIUS:\nWhy, masters"]  # fmt: skip


# ---- the batched forward, without HTTP ----------------------------------------------------------------------


def _random_model(name: str) -> torch.nn.Module:
    cfg = replace(get_model_config(name), vocab_size=256, context_length=16)
    return build_model(cfg, seed=0).eval()


@pytest.mark.parametrize("name", ["llama-tiny", "shakespeare-char"])  # RoPE and learned positions
def test_right_padded_batch_gives_each_rows_own_logits(name: str) -> None:
    model = _random_model(name)
    generator = torch.Generator().manual_seed(1)
    contexts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (3, 16, 7, 1, 12)]
    with torch.inference_mode():
        batched = last_position_logits(model, contexts, 256)
        alone = torch.cat([model(torch.tensor([c]))[:, -1, :256] for c in contexts])
    assert batched.shape == (5, 256)
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=0)  # float rounding only, ~2e-7 here
    assert not torch.allclose(batched[0], batched[2])  # rows are not all the same context


def test_engine_batches_requests_exactly_like_generate_alone() -> None:
    """6 requests, batch of 4: two wait and join mid-way; contexts outgrow context_length (16) and are cropped."""
    model, tok = _random_model("llama-tiny"), ByteTokenizer()
    engine = Engine(model, tok, max_batch_size=4, max_queue=8).start()
    cases = [("abc", 20, 0.0, None), ("hello there", 30, 0.0, None), ("x", 12, 0.9, 7),
             ("a longer prompt!", 25, 1.0, 11), ("zz", 5, 0.0, None), ("seeded", 18, 0.7, 3)]  # fmt: skip
    completions = []
    for prompt, max_tokens, temperature, seed in cases:
        request = CompletionRequest(model="m", prompt=prompt, max_tokens=max_tokens, temperature=temperature,
                                    top_p=None, top_k=None, seed=seed, stream=False, stop=(), echo=False)  # fmt: skip
        completions.append(engine.submit(tok.encode(prompt), request))
    texts = ["".join(d.text for d in c.deltas()) for c in completions]
    assert engine.close(grace_s=5.0) == 0
    for (prompt, max_tokens, temperature, seed), text in zip(cases, texts, strict=True):
        ids = torch.tensor([tok.encode(prompt)])
        out = generate(model, ids, max_new_tokens=max_tokens, temperature=temperature,
                       generator=torch.Generator().manual_seed(seed or 0))  # fmt: skip
        assert text == tok.decode(out[0, ids.shape[1] :].tolist()), prompt
    stats = engine.stats()
    assert stats.largest_batch == 4 and stats.completed_requests == 6
    assert stats.generated_tokens == sum(c[1] for c in cases)
    assert stats.decode_steps < stats.generated_tokens / 2  # batching: far fewer forwards than tokens


def _engine_texts(model: torch.nn.Module, kv_cache: str, cases: list[tuple[str, int, float]]) -> list[str]:
    tok = ByteTokenizer()
    engine = Engine(model, tok, max_batch_size=3, max_queue=8, kv_cache=kv_cache).start()  # type: ignore[arg-type]
    completions = []
    for seed, (prompt, max_tokens, temperature) in enumerate(cases):
        request = CompletionRequest(model="m", prompt=prompt, max_tokens=max_tokens, temperature=temperature,
                                    top_p=None, top_k=None, seed=seed, stream=False, stop=(), echo=False)  # fmt: skip
        completions.append(engine.submit(tok.encode(prompt), request))
    texts = ["".join(d.text for d in c.deltas()) for c in completions]
    assert engine.close(grace_s=5.0) == 0
    return texts


@pytest.mark.parametrize("name", ["llama-tiny", "shakespeare-char"])
def test_kv_cache_engines_give_the_tokens_of_the_recompute_engine(name: str) -> None:
    """5 requests through 3 slots: two join mid-batch into freed (reused) slots, one prompt fills the context (16)
    and two run past it (recomputed from there); greedy and seeded sampling. Static shapes = dynamic = off."""
    model = _random_model(name)
    cases = [
        ("abc", 20, 0.0),
        ("a prompt of 16 b", 4, 0.0),
        ("x", 6, 0.9),
        ("joins later", 9, 0.0),
        ("zz", 3, 1.0),
    ]
    texts = {mode: _engine_texts(model, mode, cases) for mode in ("off", "dynamic", "static")}
    assert texts["dynamic"] == texts["off"]
    assert texts["static"] == texts["off"]
    assert len(set(texts["off"])) == len(cases)  # five different completions, none empty


@pytest.mark.parametrize("static_shapes", [False, True])
def test_cached_decoder_frees_and_reuses_slots(static_shapes: bool) -> None:
    """Slots stay contiguous: when a request leaves, the last one moves into its slot and keeps decoding right; a
    request joining a running batch takes the freed slot (static shapes: idle slots decode too, and must not
    disturb it)."""
    model = _random_model("llama-tiny")
    cached = CachedDecoder(model, 256, 3, static_shapes=static_shapes)
    recompute = RecomputeDecoder(model, 256)
    rows = {0: [5, 6, 7], 1: [8, 9], 2: [10, 11, 12, 13]}
    with torch.inference_mode():
        for step in range(6):
            if step == 2:
                del rows[0]  # request 0 ends: request 2 moves from slot 2 into slot 0
            if step == 3:
                rows[3] = [1, 2]  # and a new one takes the freed slot
            batch = sorted(rows.items())
            got, want = cached.next_logits(batch), recompute.next_logits(batch)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
            assert cached.slots_in_use == len(rows)
            for key, tokens in rows.items():
                tokens.append(int(want[[k for k, _ in batch].index(key)].argmax()))
    assert cached._keys == [2, 1, 3]


def test_static_decode_step_is_one_graph_for_every_step() -> None:
    """What `--kv-cache static` is for: torch.compile captures the decode step whole (fullgraph), once for all
    steps (positions change, shapes do not), and it computes what the eager step does."""
    cfg = replace(get_model_config("llama-tiny"), vocab_size=256, context_length=16, num_layers=2)
    model = build_model(cfg, seed=0).eval()
    eager, captured = (CachedDecoder(model, 256, 3, static_shapes=True) for _ in range(2))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    step = torch.compile(captured.decode_step, backend="eager", fullgraph=True, dynamic=False)
    with torch.inference_mode():
        for position in range(3):
            tokens, positions = torch.tensor([[1], [2], [3 + position]]), torch.tensor([[position]] * 3)
            assert torch.equal(step(tokens, positions, 16), eager.decode_step(tokens, positions, 16))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("kv_cache", ["dynamic", "static", "off"])
def test_a_failing_request_fails_alone_and_its_batch_finishes(kv_cache: str) -> None:
    """Four requests in one batch: one the sampler cannot handle (top_k 0, which only the HTTP layer refuses), one
    whose prompt id is outside the vocabulary (the batched forward raises on it) and two good ones. The two bad
    ones end with an error; the good ones get the tokens they get alone."""
    model, tok = _random_model("llama-tiny"), ByteTokenizer()
    engine = Engine(model, tok, max_batch_size=4, max_queue=8, kv_cache=kv_cache)  # type: ignore[arg-type]
    base = CompletionRequest(model="m", prompt="", max_tokens=10, temperature=0.8, top_p=None, top_k=None,
                             seed=5, stream=False, stop=(), echo=False)  # fmt: skip
    prompts = [([104, 105], base), ([104, 105], replace(base, top_k=0)), ([7, 300], base),
               ([120, 121, 122], replace(base, temperature=0.0))]  # fmt: skip
    completions = [engine.submit(ids, request) for ids, request in prompts]
    engine.start()  # after the four are queued: they join one batch
    last = [list(c.deltas()) for c in completions]
    assert engine.close(grace_s=5.0) == 0
    assert [d[-1].finish_reason for d in last] == ["length", "error", "error", "length"]
    assert str(last[1][-1].error).startswith("sampling failed: "), last[1][-1]
    assert str(last[2][-1].error).startswith("its forward failed: index out of range"), last[2][-1]
    for i in (0, 3):
        ids, request = prompts[i]
        out = generate(model, torch.tensor([ids]), max_new_tokens=10, temperature=request.temperature,
                       generator=torch.Generator().manual_seed(5))  # fmt: skip
        assert "".join(d.text for d in last[i]) == tok.decode(out[0, len(ids) :].tolist()), i
    stats = engine.stats()
    assert stats.largest_batch == 4 and stats.completed_requests == 2 and stats.generated_tokens == 20


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    generator = torch.Generator().manual_seed(0)
    draws = [int(sample_next_token(logits, 1.0, None, generator, top_p=0.7)) for _ in range(400)]
    assert set(draws) == {0, 1}  # 0.5 < 0.7 <= 0.5 + 0.3
    assert 0.55 < draws.count(0) / 400 < 0.70  # renormalized: 0.5 / 0.8 = 0.625
    assert {int(sample_next_token(logits, 1.0, None, generator, top_p=1e-6)) for _ in range(50)} == {0}


# ---- the HTTP server ----------------------------------------------------------------------------------------


def test_start_line_health_and_models(server: Server, run_dir: Path) -> None:
    model, _ = load_for_generation(run_dir / "checkpoints" / "step-00000002")
    assert server.name == "llama-tiny"
    assert f"({count_parameters(model.config):,} parameters)" in server.start_line
    health = server.health()
    assert health["status"] == "ok" and health["model"] == "llama-tiny"
    assert server.request("GET", "/v1/models") == (200, {"object": "list", "data": [
        {"id": "llama-tiny", "object": "model", "created": pytest.approx(time.time(), abs=600),
         "owned_by": "gaudi3-scale"}]})  # fmt: skip
    assert server.request("GET", "/v1/models/llama-tiny")[1]["id"] == "llama-tiny"


def test_greedy_completion_is_deterministic_and_equals_generate(
    server: Server, reference: Callable[..., str]
) -> None:
    answer = server.complete(model="llama-tiny", prompt="ROMEO:", max_tokens=24, temperature=0)
    assert answer["object"] == "text_completion" and answer["id"].startswith("cmpl-")
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "length" and choice["index"] == 0 and choice["logprobs"] is None
    assert choice["text"] == reference("ROMEO:", 24)
    prompt_tokens = answer["usage"]["prompt_tokens"]
    assert answer["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 24,
                               "total_tokens": prompt_tokens + 24}  # fmt: skip
    again = server.complete(prompt=["ROMEO:"], max_tokens=24, temperature=0)  # model left out: the served one
    assert again["choices"][0]["text"] == choice["text"] and again["id"] != answer["id"]


def test_seeded_sampling_is_reproducible(server: Server, reference: Callable[..., str]) -> None:
    body = {"prompt": "KING", "max_tokens": 20, "temperature": 0.9, "top_k": 50}
    first = server.complete(**body, seed=1234)["choices"][0]["text"]
    assert server.complete(**body, seed=1234)["choices"][0]["text"] == first
    assert first == reference("KING", 20, temperature=0.9, seed=1234, top_k=50)
    assert server.complete(**body, seed=4321)["choices"][0]["text"] != first


def _all_at_once(server: Server, bodies: list[dict[str, Any]]) -> list[tuple[int, Any] | None]:
    """(status, answer) of each completion request, all sent at the same moment from their own threads."""
    results: list[tuple[int, Any] | None] = [None] * len(bodies)
    start = threading.Barrier(len(bodies))

    def client(i: int) -> None:
        start.wait()
        results[i] = server.request("POST", "/v1/completions", bodies[i])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results


def test_concurrent_requests_each_get_their_own_completion(server: Server) -> None:
    """8 clients at once (batch 4): greedy and seeded, different lengths, so requests join and leave mid-batch."""
    bodies = [{"prompt": p, "max_tokens": 8 + 5 * i, "temperature": 0.8 if i % 2 else 0.0, "seed": 100 + i}
              for i, p in enumerate(PROMPTS)]  # fmt: skip
    answers = _all_at_once(server, bodies)
    assert all(a is not None and a[0] == 200 for a in answers), answers
    results = [a[1] for a in answers if a is not None]
    # Really batched, and never beyond --max-batch-size.
    assert 2 <= server.health()["engine"]["largest_batch"] <= 4
    assert len({r["id"] for r in results}) == len(bodies)
    for body, result in zip(bodies, results, strict=True):
        alone = server.complete(**body)
        assert result["choices"][0]["text"] == alone["choices"][0]["text"], body
        assert result["usage"]["completion_tokens"] == body["max_tokens"]


# Inside the validator's ranges, at their edges: each must sample, in any batch. The first four are greedy in effect
# (a temperature below the sampler's greedy threshold; a top_p below the most likely token's probability, which
# always stays); top_k 1 is greedy by definition.
SAMPLING_EDGES: list[tuple[dict[str, Any], bool]] = [
    ({"temperature": 5e-324}, True),
    ({"temperature": 1e-300, "top_k": 3}, True),
    ({"temperature": 1.0, "top_p": 1e-300}, True),
    ({"temperature": 2.0, "top_p": 5e-324}, True),
    ({"temperature": 2.0, "top_k": 1}, True),
    ({"temperature": 2.0, "top_p": 1.0}, False),
    ({"temperature": 2.0, "top_k": 2**31, "top_p": 0.999999999}, False),
    ({"temperature": 1e-5 * 1.0001, "top_p": 1.0}, False),  # just above the threshold: sampled, sharply
]


def test_extreme_valid_sampling_values_complete_in_any_batch(
    server: Server, reference: Callable[..., str]
) -> None:
    """Every edge at once (8 clients, batch 4): each gets 200 with all its tokens, none fails its batch, and the
    greedy ones give the greedy text (a tiny temperature is temperature 0, whatever the seed)."""
    greedy = reference("KING", 12)
    bodies = [
        {"prompt": "KING", "max_tokens": 12, "seed": 7 + i, **edge}
        for i, (edge, _) in enumerate(SAMPLING_EDGES)
    ]
    answers = _all_at_once(server, bodies)
    for (edge, is_greedy), answer in zip(SAMPLING_EDGES, answers, strict=True):
        assert answer is not None and answer[0] == 200, (edge, answer)
        assert answer[1]["usage"]["completion_tokens"] == 12, edge
        if is_greedy:
            assert answer[1]["choices"][0]["text"] == greedy, edge


def test_stream_concatenates_to_the_completion(server: Server) -> None:
    body = {"prompt": "O, what a rogue", "max_tokens": 30, "temperature": 0.7, "seed": 5}
    events = server.stream(**body)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if isinstance(e, dict)]
    assert len(chunks) == len(events) - 1 >= 10  # token by token, not one blob
    assert len({c["id"] for c in chunks}) == 1 and all(c["object"] == "text_completion" for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    text = server.complete(**body)["choices"][0]["text"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    echoed = server.stream(**body, echo=True)
    assert "".join(c["choices"][0]["text"] for c in echoed[:-1]) == body["prompt"] + text


def test_stop_strings_end_the_completion_before_them(server: Server) -> None:
    body = {"prompt": "To be, or not", "max_tokens": 40, "temperature": 0}
    full = server.complete(**body)["choices"][0]["text"]
    match = re.search(r"[A-Za-z]{2}", full[3:])  # a stop string that really occurs, past the first tokens
    assert match, full
    stop = match.group()
    expected = full[: full.index(stop)]
    answer = server.complete(**body, stop=["never-appears", stop])
    assert answer["choices"][0] == {"text": expected, "index": 0, "logprobs": None, "finish_reason": "stop"}
    assert answer["usage"]["completion_tokens"] < 40
    events = server.stream(**body, stop=stop)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [
        (b'{"prompt": "ROMEO:", ', 400, None, ["not valid JSON"]),
        ({"prompt": "word " * 200}, 400, "prompt", ["over this server's limit of 64 tokens"]),
        ({"prompt": "ROMEO:", "max_tokens": 600}, 400, "max_tokens", ["max_tokens is 600", "limit of 512"]),
        ({"prompt": "ROMEO:", "max_tokens": "many"}, 400, "max_tokens", ["integer from 1 to 512"]),
        ({"prompt": "ROMEO:", "temperature": [1]}, 400, "temperature", ["number"]),
        ({"prompt": {"text": "ROMEO:"}}, 400, "prompt", ["must be a string"]),
        ({"prompt": ""}, 400, "prompt", ["encodes to no tokens"]),
        ({"prompt": "ROMEO:", "n": 3}, 400, "n", ["not supported"]),
        ({"prompt": "ROMEO:", "model": "gpt-4"}, 404, "model", ["does not exist", "llama-tiny"]),
    ],
)
def test_bad_requests_are_refused_with_one_clear_sentence(
    server: Server, body: Any, status: int, param: str | None, words: list[str]
) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    got, answer = server.request("POST", "/v1/completions", raw=raw)
    assert got == status
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and "\n" not in error["message"] and error["message"].endswith(".")
    for word in words:
        assert word in error["message"], error["message"]


def test_unknown_paths_methods_and_huge_bodies(server: Server) -> None:
    status, answer = server.request("GET", "/v1/chat/completions")
    assert status == 404 and "POST /v1/completions" in answer["error"]["message"]
    assert server.request("GET", "/v1/models/other")[0] == 404
    status, answer = server.request("GET", "/v1/completions")
    assert status == 405 and "use POST" in answer["error"]["message"]
    assert server.request("DELETE", "/health")[0] == 405
    assert server.request("OPTIONS", "/health")[0] == 405
    huge = json.dumps({"prompt": "a" * (2 << 20)}).encode()  # sent in full; the answer still arrives
    status, answer = server.request("POST", "/v1/completions", raw=huge)
    assert status == 413 and "limit of 1048576 bytes" in answer["error"]["message"]
    assert server.health()["status"] == "ok"  # and the server is still up


def _raw(port: int, data: bytes) -> tuple[int, dict[str, str], bytes, float]:
    """Send bytes as they are (no client library to tidy them up); (status, headers, body, seconds)."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(data)
        response = http.client.HTTPResponse(sock, method=data.split(b" ", 1)[0].decode("latin-1"))
        response.begin()
        body = response.read()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, body, time.monotonic() - start


def _post(body: bytes, content_length: int | None = None) -> bytes:
    length = len(body) if content_length is None else content_length
    return b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (length, body)


HOSTILE = [  # (name, request bytes, status, param, words in the message)
    ("max_tokens of 5,000 digits", _post(b'{"prompt": "KING", "max_tokens": ' + b"9" * 5000 + b"}"), 400,
     "max_tokens", "(5000 digits)"),
    ("seed of 5,000 digits", _post(b'{"prompt": "KING", "seed": -' + b"9" * 5000 + b"}"), 400, "seed", "digits"),
    ("JSON nested 1,000 deep", _post(b"[" * 1000 + b"]" * 1000), 400, None, "nests JSON too deeply"),
    ("JSON nested 100,000 deep", _post(b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"), 400, None,
     "nests JSON too deeply"),
    ("NaN", _post(b'{"prompt": "KING", "temperature": NaN}'), 400, None, "NaN is not a JSON number"),
    ("lone surrogate, echoed", _post(b'{"prompt": "K\\udc00", "echo": true}'), 400, "prompt", "surrogate"),
    ("OPTIONS", b"OPTIONS /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n", 405, None, "use POST"),
    ("HEAD on a POST path", b"HEAD /v1/completions HTTP/1.1\r\n\r\n", 405, None, None),
    ("an unknown method", b"BREW /health HTTP/1.1\r\n\r\n", 405, None, "use GET or HEAD"),
    ("a garbage request line", b"\x00\x01garbage\r\n\r\n", 400, None, "Bad request syntax"),
    ("HTTP/9.9", b"GET /health HTTP/9.9\r\n\r\n", 505, None, "Invalid HTTP version"),
    ("a 70,000-byte URL", b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n", 414, None, "over 65536 bytes"),
    ("200 headers", b"GET /health HTTP/1.1\r\n" + b"X-A: 1\r\n" * 200 + b"\r\n", 431, None, "100 headers"),
    ("Content-Length: \u00b2", _post(b"").replace(b"Length: 0", b"Length: \xb2"), 400, None,
     "Content-Length must be a number"),
    ("Content-Length of 5,000 digits", _post(b"").replace(b"Length: 0", b"Length: " + b"9" * 5000), 413, None,
     "over this server's limit"),
    # the second sweep (2026-11-30)
    ("a field named by a lone surrogate", _post(b'{"\\ud800": 1}'), 400, "\ud800", "Unrecognized request argument"),
    ("a 60,000-byte path", b"GET /" + b"a" * 60_000 + b" HTTP/1.1\r\n\r\n", 404, None, "Invalid URL (GET /aaa"),
    ("a 60,000-byte method", b"B" * 60_000 + b" /health HTTP/1.1\r\n\r\n", 405, None, "use GET or HEAD"),
    ("Content-Lengths that differ", b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 1\r\n"
     b"\r\n{}", 400, None, "Content-Length headers that differ"),
    ("Transfer-Encoding: gzip", b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: gzip\r\nContent-Length: 2\r\n"
     b"\r\n{}", 501, None, "Transfer-Encoding 'gzip' is not supported"),
    ("n: true", _post(b'{"prompt": "KING", "n": true}'), 400, "n", "n=true is not supported"),
    ("n: 1.0", _post(b'{"prompt": "KING", "n": 1.0}'), 400, "n", "n=1.0 is not supported"),
    ("user: 5", _post(b'{"prompt": "KING", "user": 5}'), 400, "user", "user must be a string, got 5"),
    ("a body that is null", _post(b"null"), 400, None, "must be a JSON object, got a JSON null"),
    ("an empty request line", b"   \r\n\r\n", 400, None, "an empty request line"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "data", "status", "param", "words"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_requests_get_an_openai_shaped_4xx(
    server: Server, name: str, data: bytes, status: int, param: str | None, words: str | None
) -> None:
    got, headers, body, _ = _raw(server.port, data)
    assert got == status, (name, got, body[:300])
    assert headers["content-type"] == "application/json"
    if status == 405:
        assert headers["allow"] == ("POST" if b"/v1/completions" in data else "GET, HEAD")
    if data.startswith(b"HEAD"):
        assert body == b"" and int(headers["content-length"]) > 0
        return
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert "\n" not in error["message"] and len(error["message"]) < 400 and words in error["message"], error
    assert server.health()["status"] == "ok"


def test_head_health_is_a_bodiless_200(server: Server) -> None:
    status, headers, body, _ = _raw(server.port, b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (status, body, headers["content-type"]) == (200, b"", "application/json")
    assert int(headers["content-length"]) == len(json.dumps(server.health()).encode()) > 0


def test_a_stalled_request_is_a_408_after_the_client_timeout(export_server: Server) -> None:
    """A body shorter than its Content-Length, and a head that never ends: both 408 after --client-timeout-s."""
    stalled = [_post(b'{"prompt":', content_length=100), b"GET /health HTTP/1.1\r\nHost: x"]
    results: list[tuple[int, dict[str, str], bytes, float]] = []
    threads = [
        threading.Thread(target=lambda d=d: results.append(_raw(export_server.port, d))) for d in stalled
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(results) == 2
    for status, _, body, seconds in results:
        error = json.loads(body)["error"]
        assert status == 408 and error["code"] == "request_timeout", error
        assert f"within {CLIENT_TIMEOUT_S:g} s" in error["message"]
        assert CLIENT_TIMEOUT_S * 0.9 < seconds < CLIENT_TIMEOUT_S + 10
    assert any("got 10 of 100 body bytes" in json.loads(r[2])["error"]["message"] for r in results)


def test_a_burst_of_200_clients_gets_200_or_503_never_a_reset(export_server: Server) -> None:
    """Batch 1, queue 1: 200 clients connect at once; every one gets an HTTP answer (the listen backlog holds the
    burst, the engine refuses what it cannot queue), none a reset or a timeout."""
    clients = 200
    outcomes: list[Any] = [None] * clients
    start = threading.Barrier(clients)
    body = json.dumps({"prompt": "KING", "max_tokens": 2}).encode()

    def client(i: int) -> None:
        start.wait()
        try:
            conn = http.client.HTTPConnection("127.0.0.1", export_server.port, timeout=60)
            conn.request("POST", "/v1/completions", body)
            response = conn.getresponse()
            answer = json.loads(response.read())
            conn.close()
            outcomes[i] = (response.status, answer.get("error", {}).get("code"))
        except OSError as exc:
            outcomes[i] = type(exc).__name__

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    counts = {o: outcomes.count(o) for o in set(outcomes)}
    assert set(counts) == {(200, None), (503, "queue_full")}, counts
    assert export_server.health()["engine"]["active_requests"] == 0


def test_client_timeout_option_is_checked(gaudi3_cli: Callable[..., CliResult], run_dir: Path) -> None:
    for value in ("nan", "inf", "0", "-1", "1e9"):
        message = _one_line_error(gaudi3_cli("serve", str(run_dir), "--client-timeout-s", value))
        assert "--client-timeout-s" in message and "expected seconds in (0, 3600]" in message, message


def test_safetensors_export_loads_the_checkpoints_model(run_dir: Path) -> None:
    export = run_dir.parent / "export-safetensors"
    export_checkpoint(run_dir / "checkpoints" / "step-00000002", export)
    served = loading.load_served_model(loading.resolve_source(export))
    reference, tokenizer = load_for_generation(run_dir / "checkpoints" / "step-00000002")
    assert served.tokenizer.to_json() == tokenizer.to_json() and served.name == "llama-tiny"
    tokens = torch.randint(0, 384, (2, 64))
    with torch.no_grad():
        assert torch.equal(served.model(tokens), reference(tokens))


def test_hf_export_serves_the_same_model(export_server: Server, server: Server) -> None:
    """The same text from the export served with a static-shape KV cache as from the run with a dynamic one."""
    assert export_server.name == "tiny-export" and export_server.health()["model"] == "tiny-export"
    body = {"prompt": "Speak, speak.", "max_tokens": 16, "temperature": 0}
    assert (export_server.complete(**body)["choices"][0]["text"]
            == server.complete(**body)["choices"][0]["text"])  # fmt: skip
    assert export_server.request("POST", "/v1/completions", {**body, "model": "llama-tiny"})[0] == 404


def _wait_for(server: Server, key: str, value: int) -> None:
    deadline = time.monotonic() + 20
    while server.health()["engine"][key] != value:
        assert time.monotonic() < deadline, server.health()
        time.sleep(0.01)


def test_full_queue_is_503_and_a_gone_client_frees_its_slot(export_server: Server) -> None:
    """Batch 1, queue 1: A streams (active), B waits (queued), C is refused; A hangs up and B is served."""
    long = http.client.HTTPConnection("127.0.0.1", export_server.port, timeout=60)
    long.request(
        "POST", "/v1/completions", json.dumps({"prompt": "KING", "max_tokens": 4096, "stream": True})
    )
    response = long.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: {")  # A is in the batch
    queued: list[tuple[int, Any]] = []
    waiter = threading.Thread(target=lambda: queued.append(
        export_server.request("POST", "/v1/completions", {"prompt": "KING", "max_tokens": 4})))  # fmt: skip
    waiter.start()
    _wait_for(export_server, "queued_requests", 1)
    status, answer = export_server.request("POST", "/v1/completions", {"prompt": "KING"})
    assert status == 503 and answer["error"]["code"] == "queue_full"
    assert "1 requests are already waiting" in answer["error"]["message"]
    response.close()
    long.close()  # A's handler fails to write, cancels A; B takes its slot
    waiter.join(timeout=30)
    assert queued and queued[0][0] == 200 and queued[0][1]["usage"]["completion_tokens"] == 4
    assert export_server.health()["engine"]["completed_requests"] >= 1


def test_sigterm_finishes_the_request_in_flight_then_exits_0(export_server: Server) -> None:
    """Runs last on this server: SIGTERM stops accepting, the request in flight still gets all its tokens."""
    results: list[tuple[int, Any]] = []
    body = {"prompt": "MENENIUS:", "max_tokens": 600, "temperature": 0}  # ~1.5 s of decoding here
    client = threading.Thread(
        target=lambda: results.append(export_server.request("POST", "/v1/completions", body))
    )
    client.start()
    _wait_for(export_server, "active_requests", 1)
    export_server.proc.send_signal(signal.SIGTERM)
    client.join(timeout=60)
    assert export_server.proc.wait(timeout=60) == 0, export_server.stderr()
    status, answer = results[0]
    assert status == 200 and answer["usage"]["completion_tokens"] == 600
    assert answer["choices"][0]["finish_reason"] == "length"
    assert export_server.proc.stdout is not None
    assert "stopped after" in export_server.proc.stdout.read()
    with pytest.raises(OSError):  # nobody listens any more
        socket.create_connection(("127.0.0.1", export_server.port), timeout=5)


# ---- refusals at start ----------------------------------------------------------------------------------------


def _one_line_error(result: CliResult) -> str:
    code, out, err = result
    assert code == 2 and out == "", (code, out, err)
    assert err.startswith("gaudi3: error: ") and err.count("\n") == 1, err
    return err


def test_loading_spells_the_exporters_file_names() -> None:
    assert (loading.EXPORT_CONFIG, loading.HF_CONFIG, loading.EXPORT_TOKENIZER_DIR) == (
        exporter.MODEL_CONFIG_NAME, exporter.HF_CONFIG_NAME, exporter.TOKENIZER_DIR)  # fmt: skip


def test_bad_model_paths_exit_2_with_one_line(
    gaudi3_cli: Callable[..., CliResult], run_dir: Path, tmp_path: Path
) -> None:
    assert "does not exist" in _one_line_error(gaudi3_cli("serve", str(tmp_path / "missing"), "--port", "0"))
    not_llama = tmp_path / "hf-export"
    not_llama.mkdir()
    (not_llama / "config.json").write_text('{"model_type": "mistral"}')
    (not_llama / "model.safetensors").write_bytes(b"")
    (not_llama / "tokenizer.json").write_text('{"type": "byte"}')
    message = _one_line_error(gaudi3_cli("serve", str(not_llama), "--port", "0"))
    assert "model_type 'mistral' is not supported; allowed: Llama" in message
    (not_llama / "config.json").write_bytes((run_dir.parent / "export-hf" / "config.json").read_bytes())
    message = _one_line_error(gaudi3_cli("serve", str(not_llama), "--port", "0"))
    assert "model.safetensors is not a readable safetensors file" in message
    broken = tmp_path / "step-00000002"
    broken.mkdir()
    state = (run_dir / "checkpoints" / "step-00000002" / "state.ckpt").read_bytes()
    (broken / "state.ckpt").write_bytes(state[: len(state) // 2])
    (broken / "manifest.json").write_bytes(
        (run_dir / "checkpoints" / "step-00000002" / "manifest.json").read_bytes()
    )
    assert "not usable" in _one_line_error(gaudi3_cli("serve", str(broken), "--port", "0"))
    empty_run = tmp_path / "empty-run"
    (empty_run / "checkpoints").mkdir(parents=True)
    assert "no checkpoint that verifies" in _one_line_error(
        gaudi3_cli("serve", str(empty_run), "--port", "0")
    )


def test_busy_port_exits_2_with_one_line(gaudi3_cli: Callable[..., CliResult], run_dir: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        message = _one_line_error(gaudi3_cli("serve", str(run_dir), "--port", port))
    assert f"--port {port}: cannot listen there" in message and "in use" in message
