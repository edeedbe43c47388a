"""Speculative decoding's two halves for one request: the drafts its step feeds (n-gram prompt lookup, or the
request's own drafter) and their verification against the target's choices."""

from __future__ import annotations

from .sampling import Choices, ngram_draft


def drafts_for(r, room: int, vocab: int | None) -> list[int]:
    """Up to min(num_draft_tokens, room, what the request may still generate) draft ids for request r (checked:
    a list of ids in [0, vocab)); a drafter's own failure propagates (the engine aborts that request)."""
    k = min(r.params.num_draft_tokens, room, r.params.max_new_tokens - r.num_output - 1,
            r.max_total - len(r.tokens) - 1)
    if k < 1:
        return []
    drafts = r.drafter(list(r.tokens)) if r.drafter is not None else ngram_draft(r.tokens, k)
    try:
        drafts = [int(t) for t in list(drafts)[:k]]
    except (TypeError, ValueError):
        raise TypeError(f"request {r.request_id}: the drafter must return a list of token ids, got {drafts!r}"[:300])
    bad = [t for t in drafts if t < 0 or (vocab is not None and t >= vocab)]
    if bad:
        raise ValueError(f"request {r.request_id}: draft token ids must be in [0, {vocab}), got {bad}")
    return drafts


def verify(e, rows: Choices, start: int) -> list[int]:
    """Speculative verification of an entry's [last] + drafts (rows: their logits from `start`): the target's
    choice at each position (greedy, or one draw with the request's generator) while it equals the draft; the
    first differing choice, or the choice after the last draft, ends the list. Returns the accepted drafts
    plus that one token (for a point-mass drafter this keeps the target's distribution)."""
    r, toks = e.req, []
    for i in range(e.drafts + 1):  # the target's choice after [last] + drafts[:i]
        toks.append(rows.token(start + i, r.generator, r.tokens + e.ids[1:i + 1], len(r.prompt)))
        if i < e.drafts and toks[-1] != e.ids[i + 1]:
            break
    return toks
