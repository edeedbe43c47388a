"""Incremental detokenization with stop strings: the text of a generation, released piece by piece.

`TextStream.push(token_ids)` takes the tokens a step produced and returns the text that may be shown now.
Tokens are decoded with a sliding window (the text of ids[prefix:] minus the text of ids[prefix:read],
as Hugging Face's text-generation-inference does), so a token that only completes a character (UTF-8
split over byte tokens, shown as U+FFFD until complete) is held back until it does. Text that could be the
start of a stop string is held back too: the stream never releases text past a stop string. When the text
contains a stop string, `stopped` becomes True, the text is cut before it and nothing more is released
(the caller aborts the engine request). `finish()` releases what was held back (a partial stop-string
match that never completed, an unfinished character).

The same object serves streaming and non-streaming requests, so the streamed pieces concatenated equal the
non-streamed text of the same generation.
"""

from __future__ import annotations

from typing import Callable, Sequence

Decode = Callable[[list[int]], str]


def _partial_stop(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of one of the stop strings."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


class TextStream:
    def __init__(self, decode: Decode, stops: Sequence[str] = ()):
        self._decode = decode
        self.stops = tuple(s for s in stops if s)
        self._ids: list[int] = []
        self._prefix = 0  # ids[prefix:read] is the window already turned into text
        self._read = 0
        self.text = ""  # all the text decoded so far (up to the stop string once stopped)
        self._released = 0  # len of the text already handed out
        self.stopped = False  # a stop string was found
        self.num_tokens = 0  # tokens consumed (up to and including the one that completed a stop string)

    def _decode_new(self, final: bool) -> str:
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before):]
        return ""

    def _append(self, new: str) -> None:
        """text += new, cut before the first stop string (only the tail new can complete is searched)."""
        if not new:
            return
        start = max(0, len(self.text) - max((len(s) for s in self.stops), default=0))
        self.text += new
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if not final and not self.stopped:
            end -= _partial_stop(self.text, self.stops)
        end = max(end, self._released)
        piece = self.text[self._released:end]
        self._released = end
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
