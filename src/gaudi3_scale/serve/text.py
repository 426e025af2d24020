"""A completion's text as its tokens arrive: what is final, and where a stop string ends it.

Text is decoded from all the completion's ids every time, not token by token: byte-level tokenizers split one
character over several tokens, and a prefix of them decodes to U+FFFD until the rest arrives. Text that may still
change is held back: a trailing U+FFFD, and a tail that could be the start of a stop string (so that a stop string
is never sent in part, as OpenAI leaves it out of the completion). No torch here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["TextStream"]

REPLACEMENT = "\ufffd"  # what a decoder writes for an unfinished UTF-8 sequence (errors="replace")


class TextStream:
    """Feed token ids with `push`; each call returns the text that became final. `stopped` once a stop string
    appeared (the text before it has then all been returned)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stop = tuple(stop)
        self._ids: list[int] = []
        self._sent = 0  # characters of the decoded text returned so far
        self.stopped = False

    def push(self, token_id: int) -> str:
        assert not self.stopped, "push after a stop string"
        self._ids.append(token_id)
        text = self._decode(self._ids)
        end = self._first_stop(text)
        if end is not None:
            self.stopped = True
            return self._take(text, end)
        return self._take(text, len(text) - self._unsettled_tail(text))

    def flush(self) -> str:
        """The held-back rest, when the completion ends for another reason (its length)."""
        return self._take(self._decode(self._ids), None)

    def _take(self, text: str, end: int | None) -> str:
        end = len(text) if end is None else end
        if end <= self._sent:
            return ""
        piece, self._sent = text[self._sent : end], end
        return piece

    def _first_stop(self, text: str) -> int | None:
        # Only text not yet sent can hold a new stop string, plus the longest stop's length before it.
        start = max(0, self._sent - max((len(s) for s in self._stop), default=0))
        found = [i for i in (text.find(s, start) for s in self._stop) if i >= 0]
        return min(found) if found else None

    def _unsettled_tail(self, text: str) -> int:
        """Characters at the end of `text` that may still change or become part of a stop string."""
        undecoded = len(text) - len(text.rstrip(REPLACEMENT))
        settled = text[: len(text) - undecoded]
        longest = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(settled)), longest, -1):
                if settled.endswith(stop[:size]):
                    longest = size
                    break
        return undecoded + longest
