"""Incremental detokenization with stop strings: the text of a generation, released piece by piece.

`TextStream.push(token_ids)` takes the tokens a step produced and returns the text that may be shown now.
Tokens are decoded with a sliding window (the text of ids[prefix:] minus the text of ids[prefix:read],
as Hugging Face's text-generation-inference does), so a token that only completes a character (UTF-8
split over byte tokens, shown as U+FFFD until complete) is held back until it does. Text that could be the
start of a stop string is held back too: the stream never releases text past a stop string. When the text
contains a stop string, `stopped` becomes True, the text is cut before it and nothing more is released
(the caller aborts the engine request). `finish()` releases what was held back (a partial stop-string
match that never completed, an unfinished character).

Stop strings are matched in linear time: one Knuth-Morris-Pratt automaton per stop string is fed each new
character once, and its state (the longest prefix of that stop string the text ends with) is both the
match (state == its length) and the partial match to hold back; the unreleased tail is the only text kept
apart from the released pieces. So the work of a token is proportional to its characters times the number
of stop strings, never to the length of the text so far (the server bounds both: protocol.py).

The same object serves streaming and non-streaming requests, so the streamed pieces concatenated equal the
non-streamed text of the same generation.
"""

from __future__ import annotations

from typing import Callable, Sequence

Decode = Callable[[list[int]], str]


def _failure(stop: str) -> list[int]:
    """KMP failure function: fail[i] = length of the longest proper border of stop[:i + 1]."""
    fail, k = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = fail[k - 1]
        if stop[i] == stop[k]:
            k += 1
        fail[i] = k
    return fail


class StopMatcher:
    """The stop strings' automata over a text given piece by piece (`feed`)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self._fail = [_failure(s) for s in self.stops]
        self.state = [0] * len(self.stops)  # per stop string: the longest prefix of it the text ends with

    def feed(self, piece: str, offset: int) -> int | None:
        """Append `piece` (its first character at position `offset` of the text); returns where the earliest
        stop string completed inside it starts, else None (the automata are then past the match: stop there)."""
        best = None
        for i, stop in enumerate(self.stops):
            k, fail, n = self.state[i], self._fail[i], len(stop)
            for j, c in enumerate(piece):
                while k and c != stop[k]:
                    k = fail[k - 1]
                if c == stop[k]:
                    k += 1
                    if k == n:
                        start = offset + j + 1 - n
                        best = start if best is None else min(best, start)
                        break
            self.state[i] = k
        return best

    def partial(self) -> int:
        """Characters at the end of the text that could begin a stop string (the longest partial match)."""
        return max((k for k, s in zip(self.state, self.stops) if k < len(s)), default=0)


class TextStream:
    def __init__(self, decode: Decode, stops: Sequence[str] = ()):
        self._decode = decode
        self._matcher = StopMatcher(stops)
        self.stops = self._matcher.stops
        self._ids: list[int] = []
        self._prefix = 0  # ids[prefix:read] is the window already turned into text
        self._read = 0
        self._released: list[str] = []  # the pieces handed out
        self._released_len = 0
        self._tail = ""  # the text decoded but not handed out yet (a partial stop match, at most)
        self.stopped = False  # a stop string was found
        self.num_tokens = 0  # tokens consumed (up to and including the one that completed a stop string)

    @property
    def text(self) -> str:
        """All the text decoded so far (up to the stop string once stopped)."""
        return "".join(self._released) + self._tail

    def _decode_new(self, final: bool) -> str:
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before):]
        return ""

    def _append(self, new: str) -> None:
        """text += new, cut before the first stop string (the automata see each character once)."""
        if not new:
            return
        end = self._released_len + len(self._tail)
        hit = self._matcher.feed(new, end) if self.stops else None
        self._tail += new
        if hit is not None:  # never inside the released text: a partial match is held back until it fails
            self._tail = self._tail[:max(0, hit - self._released_len)]
            self.stopped = True

    def _release(self, final: bool) -> str:
        keep = 0 if final or self.stopped else min(self._matcher.partial(), len(self._tail))
        piece = self._tail[:len(self._tail) - keep]
        if piece:
            self._tail = self._tail[len(piece):]
            self._released.append(piece)
            self._released_len += len(piece)
        return piece

    def push(self, token_ids: Sequence[int]) -> str:
        """Add newly generated tokens; returns the text that can be released now ('' if none)."""
        for tok in token_ids:
            if self.stopped:
                break
            self._ids.append(int(tok))
            self.num_tokens += 1
            self._append(self._decode_new(final=False))
        return self._release(final=False)

    def finish(self) -> str:
        """The generation ended: the rest of the text (held back partial matches, unfinished characters)."""
        if not self.stopped and self._read < len(self._ids):
            self._append(self._decode_new(final=True))
        return self._release(final=True)
