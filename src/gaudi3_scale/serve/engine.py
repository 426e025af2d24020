"""The decode loop: one thread owns the model and batches every active request at each step (continuous batching).

Iteration-level scheduling as in Orca (Yu et al., OSDI 2022): requests join the batch between decode steps and
leave it as soon as they finish, so a short request never waits for a long one. Each step gets every row's
next-token logits from ONE decode forward (`serve/decoding.py`: a KV cache slot per request by default, or the
whole context recomputed with `kv_cache="off"`), plus one prefill forward when requests joined.

Sampling is per request with its own `torch.Generator`, so a seeded request gives the same tokens whatever it is
batched with (up to float rounding of the batched matmuls, ~1e-7 here).

A request fails alone: what raises in its sampling or its text ends it with an error and the batch goes on; when the
batched forward raises, each request's logits are computed alone for that step, so only the one(s) whose own forward
raises fail.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import queue
import secrets
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch
from torch import nn

from gaudi3_scale.data.tokenizers import Tokenizer
from gaudi3_scale.models.config import ModelConfig
from gaudi3_scale.models.generate import sample_next_token
from gaudi3_scale.serve.decoding import KvCacheMode, build_decoder
from gaudi3_scale.serve.protocol import CompletionRequest
from gaudi3_scale.serve.text import TextStream

__all__ = ["CLIENT_POLL_S", "Completion", "Delta", "Engine", "EngineClosed", "QueueFull"]

# How often a waiting handler checks that its client is still connected: a gone client's request leaves the queue
# or the batch this soon (a select() per waiting request, microseconds).
CLIENT_POLL_S = 0.1


class QueueFull(Exception):
    """More requests wait than the queue holds (the HTTP layer answers 503)."""


class EngineClosed(Exception):
    """The server is shutting down and takes no new requests."""


@dataclass(frozen=True)
class Delta:
    """New text of one completion; the last one has `finish_reason` ("length", "stop" or "error")."""

    text: str
    finish_reason: str | None = None
    completion_tokens: int = 0
    error: str | None = None  # with finish_reason "error": why the completion was cut short


class Completion:
    """A submitted request as its HTTP handler sees it: `deltas()` until the last one, `cancel()` to drop it."""

    def __init__(self, engine: Engine, prompt_ids: list[int], request: CompletionRequest) -> None:
        self.prompt_ids, self.request = prompt_ids, request
        self._engine = engine
        self._queue: queue.SimpleQueue[Delta] = queue.SimpleQueue()
        self.cancelled = threading.Event()

    def put(self, delta: Delta) -> None:
        self._queue.put(delta)

    def cancel(self) -> None:
        """The client went away: a queued request gives up its place now, an active one leaves the batch at the
        engine's next step."""
        self.cancelled.set()
        self._engine.withdraw(self)

    def deltas(self, client_gone: Callable[[], bool] | None = None) -> Iterator[Delta]:
        """The completion's deltas through the last one. With `client_gone`, it is asked every `CLIENT_POLL_S`
        while the request waits or decodes; once it says True the completion is cancelled and the deltas end
        early (`cancelled` is then set): nobody is left to answer."""
        next_poll_s = time.monotonic() + CLIENT_POLL_S
        while True:
            if client_gone is not None and time.monotonic() >= next_poll_s:
                next_poll_s = time.monotonic() + CLIENT_POLL_S
                if client_gone():
                    self.cancel()
                    return
            try:
                delta = self._queue.get(timeout=CLIENT_POLL_S)
            except queue.Empty:
                if self._engine.is_alive():
                    continue
                try:  # the loop has ended: its last delta may have come just after the wait
                    delta = self._queue.get_nowait()
                except queue.Empty:  # never wait forever on a loop that is gone
                    yield Delta("", "error", error="the decode loop stopped")
                    return
            yield delta
            if delta.finish_reason is not None:
                return


@dataclass
class _Active:
    """A request in the batch: its tokens so far, its generator and its text."""

    completion: Completion
    tokens: list[int]
    generator: torch.Generator
    text: TextStream
    key: int  # unique while the engine runs: names the request's KV cache slot
    generated: int = 0
    finished: bool = False  # its last token is out ("length" or "stop")
    failed: bool = False  # it ended with an error


@dataclass
class EngineStats:
    """Counters since start (`GET /health` shows them); generated_tokens / decode_steps is the mean batch size."""

    completed_requests: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    largest_batch: int = 0
    active_requests: int = 0
    queued_requests: int = 0


class Engine:
    """Owns the model; `submit` queues a request (bounded), the decode thread batches up to `max_batch_size`.

    `kv_cache`: "dynamic" (a cache slot per request, decode shapes follow the batch), "static" (every slot decoded
    over the whole context at every step: fixed shapes) or "off" (recompute the context every step)."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Tokenizer,
        *,
        max_batch_size: int,
        max_queue: int,
        kv_cache: KvCacheMode = "dynamic",
    ) -> None:
        assert max_batch_size >= 1 and max_queue >= 1, (max_batch_size, max_queue)
        config = model.config
        assert isinstance(config, ModelConfig) and config.vocab_size is not None, "a model from build_model"
        self.model, self.tokenizer = model.eval(), tokenizer
        # Never sample an id the tokenizer cannot decode (a model may pad its vocabulary beyond the tokenizer's).
        self.vocab_size = min(config.vocab_size, tokenizer.vocab_size)
        self.max_batch_size, self.max_queue = max_batch_size, max_queue
        self._decoder = build_decoder(model, self.vocab_size, max_batch_size, kv_cache)
        self._keys = itertools.count()
        self._pending: collections.deque[Completion] = collections.deque()
        self._active: list[_Active] = []
        self._wakeup = threading.Condition()
        self._accepting, self._cancel_all = True, False
        self._hurry = threading.Event()
        self._stats = EngineStats()
        self._started, self._finished = threading.Event(), threading.Event()

    def start(self) -> Engine:
        """Run the decode loop in a background thread (`gaudi3 serve` runs it in the main thread instead)."""
        threading.Thread(target=self.run, name="gaudi3-serve-engine", daemon=True).start()
        return self

    def is_alive(self) -> bool:
        """False once the decode loop has ended (and before, while it has not been started)."""
        return not self._finished.is_set()

    def submit(self, prompt_ids: list[int], request: CompletionRequest) -> Completion:
        completion = Completion(self, prompt_ids, request)
        with self._wakeup:
            if not self._accepting:
                raise EngineClosed("the server is shutting down")
            if len(self._pending) >= self.max_queue:
                raise QueueFull(f"{len(self._pending)} requests are already waiting")
            self._pending.append(completion)
            self._wakeup.notify()
        return completion

    def withdraw(self, completion: Completion) -> None:
        """A cancelled request leaves the queue now, so its place goes to a live client (one in the batch leaves
        it at the next step)."""
        # ValueError: it is already in the batch, finished, or gone at shutdown
        with self._wakeup, contextlib.suppress(ValueError):
            self._pending.remove(completion)

    def stats(self) -> EngineStats:
        with self._wakeup:
            return replace(self._stats, active_requests=len(self._active), queued_requests=len(self._pending))

    @property
    def accepting(self) -> bool:
        return self._accepting

    def hurry(self) -> None:
        """End a `close` now: whatever is still in flight is cancelled."""
        self._hurry.set()

    def stop_accepting(self) -> None:
        """Refuse new requests (`submit` raises EngineClosed); the ones held go on."""
        with self._wakeup:
            self._accepting = False
            self._wakeup.notify()

    def close(self, grace_s: float) -> int:
        """Take no new requests; finish the ones in flight (queued included) for up to `grace_s`, then cancel the
        rest. Returns how many were cancelled."""
        self.stop_accepting()
        deadline = time.monotonic() + grace_s
        while self.is_alive() and time.monotonic() < deadline and not self._hurry.wait(0.02):
            with self._wakeup:
                if not self._active and not self._pending:
                    break
        with self._wakeup:
            left = len(self._active) + len(self._pending)
            self._cancel_all = True
            self._wakeup.notify()
        if self._started.is_set():
            self._finished.wait()
        return left

    def run(self) -> None:
        """The decode loop, in the calling thread, until `close` (from another thread) ends it."""
        assert not self._started.is_set(), "the decode loop runs once"
        self._started.set()
        try:
            with torch.inference_mode():
                while self._admit():
                    try:
                        self._step()
                    except Exception as exc:  # a bug outside any one request: never strand the batch
                        print(
                            f"gaudi3 serve: decode step failed: {type(exc).__name__}: {exc}", file=sys.stderr
                        )
                        for state in self._active:
                            state.completion.put(
                                Delta("", "error", state.generated, error=f"decode failed: {exc}")
                            )
                        self._active.clear()
                        self._decoder.reset()
        finally:
            self._finished.set()

    def _admit(self) -> bool:
        """Wait for work, move waiting requests into the batch; False when the loop should end."""
        with self._wakeup:
            while not (self._pending or self._active or self._cancel_all):
                if not self._accepting:
                    return False
                self._wakeup.wait()
            if self._cancel_all:
                for completion in [*(s.completion for s in self._active), *self._pending]:
                    completion.put(Delta("", "error", error="the server shut down before it finished"))
                self._active.clear()
                self._pending.clear()
                return False
            self._active = [s for s in self._active if not s.completion.cancelled.is_set()]
            while self._pending and len(self._active) < self.max_batch_size:
                completion = self._pending.popleft()
                if not completion.cancelled.is_set():
                    self._active.append(self._activate(completion))
            self._stats.largest_batch = max(self._stats.largest_batch, len(self._active))
            return True

    def _activate(self, completion: Completion) -> _Active:
        request = completion.request
        seed = request.seed if request.seed is not None else secrets.randbits(63)
        device = next(self.model.parameters()).device
        generator = torch.Generator(device=device).manual_seed(seed)
        return _Active(completion, list(completion.prompt_ids), generator,
                       TextStream(self.tokenizer.decode, request.stop), next(self._keys))  # fmt: skip

    def _step(self) -> None:
        if not self._active:
            return
        logits = self._next_logits()
        sampling, next_ids = [], []
        for row, state in enumerate(self._active):
            if state.failed:
                continue
            request = state.completion.request
            try:
                next_ids.append(sample_next_token(logits[row : row + 1], request.temperature, request.top_k,
                                                  state.generator, top_p=request.top_p))  # fmt: skip
            except Exception as exc:
                self._fail(state, "sampling", exc)
                continue
            sampling.append(state)
        tokens = torch.cat(next_ids).view(-1).tolist() if next_ids else []  # one device sync for the batch
        for state, token in zip(sampling, tokens, strict=True):
            try:
                state.finished = self._advance(state, int(token))
            except Exception as exc:
                self._fail(state, "decoding its text", exc)
        with self._wakeup:
            self._stats.decode_steps += 1
            self._stats.generated_tokens += len(tokens)
            self._stats.completed_requests += sum(s.finished for s in self._active)
            self._active = [s for s in self._active
                            if not (s.finished or s.failed or s.completion.cancelled.is_set())]  # fmt: skip

    def _next_logits(self) -> torch.Tensor:
        """Every request's next-token logits, from one batched forward. When that raises, each request's alone: a
        request whose own forward raises fails (its row stays 0), the others go on."""
        rows = [(state.key, state.tokens) for state in self._active]
        try:
            return self._decoder.next_logits(rows)
        except Exception:
            self._decoder.reset()  # the slots' contents are not trusted after a failed forward
        logits = torch.zeros(len(rows), self.vocab_size, device=next(self.model.parameters()).device)
        for row, (state, one) in enumerate(zip(self._active, rows, strict=True)):
            try:
                logits[row] = self._decoder.next_logits([one])[0]
            except Exception as exc:
                self._decoder.reset()
                self._fail(state, "its forward", exc)
        return logits

    def _fail(self, state: _Active, what: str, exc: Exception) -> None:
        """End one request with an error (the HTTP layer answers 500, or an error event once streaming)."""
        print(f"gaudi3 serve: a request failed in {what}: {type(exc).__name__}: {exc}", file=sys.stderr)
        state.completion.put(Delta("", "error", state.generated, error=f"{what} failed: {exc}"))
        state.failed = True

    def _advance(self, state: _Active, token: int) -> bool:
        """Append one sampled token and send its text; True if the request is done (it then leaves the batch)."""
        state.tokens.append(token)
        state.generated += 1
        text = state.text.push(token)
        finish = None
        if state.text.stopped:
            finish = "stop"
        elif state.generated >= state.completion.request.max_tokens:
            finish, text = "length", text + state.text.flush()
        if text or finish:
            state.completion.put(Delta(text, finish, state.generated))
        return finish is not None
