"""Logit processing before a token is chosen, and the log-probabilities a request may ask for.

The steps of one sampled row, in vLLM's order (sampling.Choices calls them):

1. `process(logits, params, tokens, prompt_len)`: logit_bias (added), repetition_penalty (over the prompt and
   the generated tokens: a positive logit divided by it, a negative one multiplied, as CTRL / transformers),
   frequency_penalty (minus penalty x the token's count among the generated tokens) and presence_penalty
   (minus penalty once the token was generated), as OpenAI defines them. Greedy is the argmax of the result.
2. temperature, then `min_p_mask` (tokens whose probability is below min_p x the largest are dropped, on
   the temperature-scaled distribution), then top_k and top_p (sampling.sample_token).

`token_logprobs` gives a chosen token's log-probability and the k most likely tokens' from log_softmax of the
row's RAW logits: before logit_bias, penalties and temperature (vLLM's default, "raw_logprobs"), so a logprob
says what the model thinks, whatever the request did to the choice. A token constraint's mask (constraint.py)
applies before all of this (its forbidden tokens are -inf here too, as in vLLM).

A row needs the host (`needs_host`) when any of these apply: the greedy rows without them are chosen on the
device (sampling.Choices) and may run one step ahead (overlap.py).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from .params import SamplingParams


def processes(p: SamplingParams) -> bool:
    """Whether `process` changes anything for these params."""
    return bool(p.logit_bias) or p.repetition_penalty != 1.0 or p.frequency_penalty != 0 or p.presence_penalty != 0


def needs_host(p: SamplingParams) -> bool:
    """Whether a row under these params is chosen on the host from its logits (not a device argmax)."""
    return p.temperature != 0 or processes(p) or p.logprobs is not None


def process(logits: torch.Tensor, p: SamplingParams, tokens: Sequence[int], prompt_len: int) -> torch.Tensor:
    """logits [V] float32 (host) after logit_bias and the penalties; `tokens` = prompt + generated so far."""
    if not processes(p):
        return logits
    x = logits.clone()
    vocab = x.numel()
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
        x.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=x.dtype))
    if p.repetition_penalty != 1.0:
        seen = torch.unique(torch.tensor(list(tokens), dtype=torch.long))
        v = x[seen]
        x[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
    if p.frequency_penalty != 0 or p.presence_penalty != 0:
        out = list(tokens[prompt_len:])
        if out:
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=vocab).to(x.dtype)
            x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(x.dtype)
    return x


def min_p_mask(x: torch.Tensor, min_p: float) -> torch.Tensor:
    """x: temperature-scaled logits whose largest is 0; drop tokens of probability < min_p x the largest's."""
    if min_p <= 0:
        return x
    return x.masked_fill(x < math.log(min_p), float("-inf"))


def token_logprobs(raw: torch.Tensor, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """(log-probability of `token`, the k most likely tokens' [(id, logprob)], most likely first) of the raw
    logits [V] (float64 log_softmax)."""
    lp = torch.log_softmax(raw.double(), dim=0)
    top = []
    if k > 0:
        vals, ids = torch.topk(lp, min(k, lp.numel()))
        top = list(zip(ids.tolist(), vals.tolist()))
    return float(lp[token]), top
