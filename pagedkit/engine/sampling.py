"""Per-request token choice from one position's logits, and n-gram prompt-lookup drafts.

sample_token(logits [V] float32, params, generator): greedy argmax at temperature 0, else one draw
from softmax(logits / temperature) restricted to the top_k largest (top_k > 0) and to the smallest
set of most likely tokens whose probability reaches top_p (top_p < 1). The draw uses the request's
own torch.Generator, one draw per generated token, so a seeded request gives the same tokens whatever
else shares its batches, and speculative decoding (which draws once per emitted token too) gives the
same tokens as plain decoding.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from . import logits as lp
from .params import SamplingParams


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """The next token from logits [V] (any float dtype, CPU) under `params`."""
    if logits.dim() != 1:
        raise ValueError(f"sample_token: logits should be [vocab], got shape {tuple(logits.shape)}")
    logits = logits.float()
    if params.temperature == 0:
        return int(host_argmax(logits))
    # shifted so that the largest is 0, scaled in float64: a tiny temperature (1e-40, 5e-324) sends the others to
    # -inf (greedy in the limit) instead of overflowing to inf, or of a float32 temperature of 0 (softmax nan: the
    # draw raised, failing the whole engine step)
    x = ((logits.double() - logits.max()) / params.temperature).float()
    x = lp.min_p_mask(x, params.min_p)
    if 0 < params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        order = torch.argsort(x, descending=True)
        probs = torch.softmax(x[order], dim=0)
        before = torch.cumsum(probs, dim=0) - probs  # mass of the more likely tokens
        drop = before >= params.top_p  # the first token always stays
        x = x.clone()
        x[order[drop]] = float("-inf")
    probs = torch.softmax(x, dim=0)
    return int(torch.multinomial(probs, 1, generator=generator))


def greedy_rows(logits: torch.Tensor) -> torch.Tensor:
    """int64 [R] argmax of logits [R, V] on their device: on CUDA the two-launch Triton argmax
    (kernels/triton/argmax.py: torch's one-kernel reduction took 36 us of an H200 decode step at V = 128256),
    on the CPU numpy's for float32 / float16 (`host_argmax`), else torch.argmax; the same indices (ties and NaN
    to the lowest)."""
    if logits.is_cuda:
        from ..kernels.triton import common

        if common.HAVE_TRITON:
            from ..kernels.triton.argmax import argmax_rows

            return argmax_rows(logits)
    return host_argmax(logits)


def host_argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) as int64, through numpy for CPU float32 / float16 tensors: torch's CPU argmax took 500 us on
    [8, 49152] float32 (one thread), numpy's 23 us; both give the first maximum, and the first NaN if any."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float16) and x.numel():
        return torch.from_numpy(np.asarray(np.argmax(x.detach().numpy(), -1), dtype=np.int64))
    return x.argmax(-1)


class Choices:
    """The token choices of one step's sampled rows, logits [R, V] on the run device: the greedy rows' argmax
    is taken on the device in one call and copied as R ints (not R x V floats); the other rows (sampled, or
    processed / with logprobs: logits.needs_host) are copied to the host once, as float32, and drawn from only
    when asked (`token`), so a request's generator draws exactly once per emitted token."""

    def __init__(self, logits: torch.Tensor, params: Sequence[SamplingParams]):
        if logits.dim() != 2 or logits.shape[0] != len(params):
            raise ValueError(f"Choices: logits should be [{len(params)}, vocab], got {tuple(logits.shape)}")
        self.params = list(params)
        greedy = [i for i, p in enumerate(self.params) if not lp.needs_host(p)]
        drawn = [i for i, p in enumerate(self.params) if lp.needs_host(p)]
        self._argmax: dict[int, int] = {}
        if greedy:
            sel = logits if len(greedy) == len(self.params) else logits[greedy]
            self._argmax = dict(zip(greedy, greedy_rows(sel).tolist()))
        self._host: dict[int, torch.Tensor] = {}
        if drawn:
            host = logits[drawn].float().cpu()
            self._host = {i: host[k] for k, i in enumerate(drawn)}

    def token(self, i: int, generator: torch.Generator, tokens: Sequence[int] = (), prompt_len: int = 0) -> int:
        """Row i's token: its argmax (greedy), else one draw under its params with `generator`; `tokens` (prompt +
        generated so far, the prompt's first `prompt_len`) feed the penalties (logits.process)."""
        if i in self._argmax:
            return int(self._argmax[i])
        p = self.params[i]
        x = lp.process(self._host[i], p, tokens, prompt_len)
        return int(torch.argmax(x)) if p.temperature == 0 else sample_token(x, p, generator)

    def logprobs(self, i: int, token: int) -> tuple[float, list[tuple[int, float]]] | None:
        """Row i's (logprob of `token`, top-k) under its params' `logprobs` (None when not asked)."""
        k = self.params[i].logprobs
        return None if k is None else lp.token_logprobs(self._host[i], token, k)


def ngram_draft(tokens: Sequence[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Prompt-lookup drafts: for n from max_ngram down to min_ngram, find the latest earlier occurrence
    of the last n tokens in `tokens` (prompt + generated) and propose up to k tokens that followed it;
    [] when no n-gram recurs."""
    if k < 1:
        return []
    tokens = list(tokens)
    size = len(tokens)
    for n in range(max_ngram, min_ngram - 1, -1):
        if size <= n:
            continue
        tail = tokens[size - n:]
        for start in range(size - n - 1, -1, -1):  # latest first; the tail itself excluded
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []


def request_generator(seed: int | None) -> torch.Generator:
    """A CPU torch.Generator for one request: seeded, or from fresh entropy when seed is None."""
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen
