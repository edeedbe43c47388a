"""One request's state inside the engine: its tokens, what the KV cache holds of them, what was
streamed, and the stop rules.

Token layout: `tokens` = prompt + generated (the `output`); `num_computed` leading tokens of `tokens`
have their K/V in the cache (== KVCacheManager.length while running). A running request's next step
feeds tokens[num_computed:] (a prefill chunk, or the one last sampled token while decoding); after a
preemption num_computed drops to 0 (or to the prefix-cache hit), so prompt + generated is prefilled
again (recompute) and the already-streamed tokens are not emitted again (`num_emitted`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .params import RequestOutput, SamplingParams
from .sampling import request_generator

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    stop_ids: frozenset[int]  # eos (unless ignore_eos) + stop_token_ids
    max_total: int  # most tokens prompt + generated may reach (max_seq_len + 1)
    drafter: Callable[[list[int]], list[int]] | None = None
    constraint: object | None = None  # the request's token constraint (SamplingParams.constraint's product)
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_emitted: int = 0
    status: str = WAITING
    admitted: int = -1  # admission order while running (the preemption victim is the largest)
    finish_reason: str | None = None
    reason: str | None = None  # why it was aborted
    num_preemptions: int = 0
    logprobs: list | None = None  # per generated token (SamplingParams.logprobs): (logprob, top-k)
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache held at the first admission
    siblings: list["Request"] = field(default_factory=list)  # Engine.add_group: forked once this prompt is cached

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.prompt)

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def decoding(self) -> bool:
        """Everything but the last sampled token is cached: the next step feeds one token (+ drafts)."""
        return len(self.tokens) - self.num_computed == 1

    @property
    def finished(self) -> bool:
        return self.status == FINISHED

    def append(self, token: int, logprob=None) -> bool:
        """Add one generated token (and its logprobs entry, when the request asks for them); True when it
        finishes the request (finish_reason set)."""
        self.tokens.append(int(token))
        if self.constraint is not None:
            try:
                complete = self.constraint.accept(int(token))
            except Exception as exc:
                return self.finish("abort", f"the request's token constraint failed: {type(exc).__name__}: {exc}"[:500])
        if self.params.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.append(logprob)
        out_len = self.num_output
        for seq in self.params.stop_sequences:
            n = len(seq)
            if out_len >= n and tuple(self.tokens[-n:]) == seq:
                del self.tokens[-n:]  # the matched sequence is not part of the output
                if self.logprobs is not None:
                    del self.logprobs[-n:]
                self.num_emitted = min(self.num_emitted, self.num_output)
                return self.finish("stop")
        if token in self.stop_ids or (self.constraint is not None and complete):
            return self.finish("stop")
        if out_len >= self.params.max_new_tokens or len(self.tokens) >= self.max_total:
            return self.finish("length")
        return False

    def finish(self, reason: str, why: str | None = None) -> bool:
        self.status, self.finish_reason, self.reason = FINISHED, reason, why
        return True

    def _holdback(self) -> int:
        """Trailing generated tokens that may begin a stop sequence: not streamed yet."""
        if self.finished or not self.params.stop_sequences:
            return 0
        out = self.output
        best = 0
        for seq in self.params.stop_sequences:
            for h in range(min(len(seq) - 1, len(out)), best, -1):
                if tuple(out[-h:]) == seq[:h]:
                    best = h
                    break
        return best

    def emit(self) -> RequestOutput | None:
        """The output of this step: the newly visible tokens, or None when nothing changed."""
        p = len(self.prompt)  # slices of tokens, not of two fresh copies of the whole output
        upto = self.num_output - self._holdback()
        new = self.tokens[p + self.num_emitted:p + upto] if upto > self.num_emitted else []
        if not new and not self.finished:
            return None
        lps = None if self.params.logprobs is None else (self.logprobs or [])[self.num_emitted:self.num_emitted + len(new)]
        self.num_emitted = max(self.num_emitted, upto)
        return RequestOutput(self.request_id, new, self.tokens[p:p + self.num_emitted], self.finished,
                             self.finish_reason, self.reason, lps, self.num_cached_tokens or 0)


def new_request(prompt: Sequence[int], params: SamplingParams | None, request_id: str | None, drafter,
                *, vocab_size: int | None, max_seq_len: int, eos_token_ids: Sequence[int]) -> Request:
    """A checked Request: a ValueError / TypeError names the argument (prompt_token_ids, params,
    request_id, drafter) and what it should be."""
    try:
        prompt = list(prompt)
    except TypeError:
        raise ValueError(f"prompt_token_ids must be a list of token ids, got {prompt!r}"[:200]) from None
    if not prompt:
        raise ValueError("prompt_token_ids must hold at least one token id, got []")
    for t in prompt:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
            raise ValueError(f"prompt_token_ids must hold token ids in [0, {vocab_size if vocab_size is not None else 'vocab'}), "
                             f"got {t!r}")
    if len(prompt) > max_seq_len:
        raise ValueError(f"prompt_token_ids has {len(prompt)} tokens, beyond the model's max_seq_len {max_seq_len}")
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams or None, got {type(params).__name__}")
    if drafter is not None and not callable(drafter):
        raise TypeError(f"drafter must be a callable (token ids so far -> draft token ids) or None, "
                        f"got {type(drafter).__name__}")
    bad = [t for t in (params.logit_bias or {}) if vocab_size is not None and t >= vocab_size]
    if bad:
        raise ValueError(f"SamplingParams.logit_bias: token ids must be < the vocabulary size {vocab_size}, got {bad[0]}")
    if request_id is None:
        request_id = uuid.uuid4().hex
    elif not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id must be a non-empty str or None, got {request_id!r}")
    stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    try:
        constraint = params.constraint() if params.constraint is not None else None
    except Exception as exc:
        raise ValueError(f"params.constraint: the factory failed ({type(exc).__name__}: {exc})"[:500]) from None
    return Request(request_id, [int(t) for t in prompt], params, request_generator(params.seed), frozenset(stop),
                   max_total=max_seq_len + 1, drafter=drafter, constraint=constraint)
