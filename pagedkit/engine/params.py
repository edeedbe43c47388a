"""Request-level types of the engine: SamplingParams (what a request asks for) and RequestOutput (what
a step reports). Both are plain dataclasses; SamplingParams checks its fields at construction, so a bad
value is a ValueError naming the field and the expected range before anything is queued."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

FINISH_REASONS = ("stop", "length", "abort")


def _int(value, field: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"SamplingParams.{field} must be an integer >= {minimum}, got {value!r}")
    return value


def _token_ids(values, field: str) -> tuple[int, ...]:
    try:
        ids = tuple(values)
    except TypeError:
        raise ValueError(f"SamplingParams.{field} must be a sequence of token ids (ints >= 0), got {values!r}") from None
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"SamplingParams.{field} must hold token ids (ints >= 0), got {t!r} in {values!r}")
    return ids


@dataclass
class SamplingParams:
    """How one request is decoded.

    max_new_tokens: most tokens generated (finish_reason "length"); the context length also ends a
    request with "length" (prompt + generated <= max_seq_len + 1: the last token is never cached).
    temperature: 0 -> greedy (argmax; top_p / top_k are then unused); > 0 -> sample from
    softmax(logits / temperature) restricted by top_k (0 = off) and top_p (1.0 = off, nucleus).
    seed: seeds the request's own torch.Generator (same seed -> same tokens); None -> a random seed.
    stop_token_ids: finish with "stop" on these (kept in the output, like the eos ids), in addition to
    the model's eos ids unless ignore_eos. stop_sequences: token-id sequences matched against the
    generated tokens; the matched sequence is removed from the output (and never streamed: tokens that
    may start a stop sequence are held back until they cannot).
    num_draft_tokens: k > 0 -> speculative decoding with up to k draft tokens a step (n-gram prompt
    lookup, or the request's drafter); the output equals non-speculative decoding.
    Logit processing (logits.py; vLLM's order): logit_bias ({token id: bias} added to the logits),
    repetition_penalty (1 = off; over prompt + generated tokens, CTRL's: a positive logit divided by it, a
    negative one multiplied), frequency_penalty and presence_penalty (0 = off; minus penalty x count, minus
    penalty if present, over the generated tokens), then temperature (greedy is the argmax of the processed
    logits), then min_p (0 = off: drop tokens whose probability is below min_p x the largest), top_k, top_p.
    logprobs: None -> none; k >= 0 -> each generated token's log-probability and the k most likely tokens'
    (RequestOutput.new_logprobs), from log_softmax of the model's raw logits (before any processing).
    constraint: None, or a factory called once per request that returns its token constraint (a grammar state:
    mask() / accept(token) / rollback(n), engine/constraint.py): the logits of the tokens it disallows are set to
    -inf before the choice (greedy and sampled), and the request finishes with "stop" once it is complete.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    ignore_eos: bool = False
    num_draft_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_p: float = 0.0
    logprobs: int | None = None
    constraint: Callable[[], object] | None = None

    def __post_init__(self):
        _int(self.max_new_tokens, "max_new_tokens", 1)
        _int(self.top_k, "top_k", 0)
        _int(self.num_draft_tokens, "num_draft_tokens", 0)
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"SamplingParams.top_p must be a number in (0, 1] (1 = off), got {p!r}")
        if self.seed is not None:
            _int(self.seed, "seed", 0)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"SamplingParams.ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.constraint is not None and not callable(self.constraint):
            raise ValueError("SamplingParams.constraint must be None or a callable returning a token constraint, "
                             f"got {type(self.constraint).__name__}")
        self.stop_token_ids = _token_ids(self.stop_token_ids, "stop_token_ids")
        try:
            seqs = tuple(self.stop_sequences)
        except TypeError:
            raise ValueError("SamplingParams.stop_sequences must be a sequence of token-id sequences, "
                             f"got {self.stop_sequences!r}") from None
        self.stop_sequences = tuple(_token_ids(s, "stop_sequences[]") for s in seqs)
        if any(not s for s in self.stop_sequences):
            raise ValueError(f"SamplingParams.stop_sequences must not hold an empty sequence, got {self.stop_sequences!r}")
        self._check_processing()

    def _check_processing(self) -> None:
        """The logit-processing fields (penalties, logit_bias, min_p) and logprobs."""
        for name, lo, hi, lo_open in (("presence_penalty", -2.0, 2.0, False), ("frequency_penalty", -2.0, 2.0, False),
                                      ("repetition_penalty", 0.0, math.inf, True), ("min_p", 0.0, 1.0, False)):
            v = getattr(self, name)
            if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < lo or v > hi
                    or (lo_open and v == lo)):
                raise ValueError(f"SamplingParams.{name} must be a finite number in {'(' if lo_open else '['}{lo}, "
                                 f"{hi}], got {v!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"SamplingParams.logit_bias must be a dict {{token id: bias}}, got {self.logit_bias!r}")
            for t, b in self.logit_bias.items():
                if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                    raise ValueError(f"SamplingParams.logit_bias keys must be token ids (ints >= 0), got {t!r}")
                if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b):
                    raise ValueError(f"SamplingParams.logit_bias values must be finite numbers, got {b!r}")
        if self.logprobs is not None:
            _int(self.logprobs, "logprobs", 0)


@dataclass
class RequestOutput:
    """One request's progress after a step.

    new_token_ids: the tokens this step made visible (streaming; concatenated over the steps they give
    token_ids). token_ids: every generated token visible so far (the prompt is not included).
    finish_reason: "stop" (eos / stop token / stop sequence), "length" (max_new_tokens or the context
    length), "abort" (Engine.abort, or a request the KV cache can never hold), None while running.
    reason: why an "abort" happened (also logged), else None.
    new_logprobs: with SamplingParams.logprobs, one (logprob, [(token id, logprob)] of the k most likely) per
    new token; else None. num_cached_tokens: prompt tokens found in the prefix cache at admission.
    """

    request_id: str
    new_token_ids: list[int]
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    reason: str | None = None
    new_logprobs: list | None = None
    num_cached_tokens: int = 0
