"""Constrained decoding: a request's token constraint masks the logits of its sampled rows before the choice.

`SamplingParams.constraint` is a factory (a callable without arguments), called once per request when it is
added; what it returns holds the request's grammar state (paged-serve's are llguidance matchers:
apps/serve/structured.py) and has three methods:

    mask() -> torch.Tensor   the tokens allowed next: an int32 [ceil(V / 32)] packed bitmask on the host,
                             bit j of word i allowing token 32 i + j (llguidance's / xgrammar's layout)
    accept(token) -> bool    advance by one generated token; True once the constraint is complete (nothing may
                             follow): the request then finishes with "stop" (Request.append)
    rollback(n)              undo the last n accepted tokens (speculative drafts, below)

Where it acts, one step (Engine._execute): the model's step is launched; the host computes each constrained
row's mask from its request's state (host work, while the device runs); `apply` sends the packed masks to the
logits' device in one copy (pinned, non-blocking on CUDA) and sets the disallowed logits to -inf there; then
`Choices` picks as always (greedy argmax on the device, or the host draw), so the choice is always an allowed
token, greedy or sampled, and the step reads nothing more from the device than an unconstrained step does.

Speculative decoding: row i of a request with drafts chooses the token after [last] + drafts[:i]; its mask is
the state after accepting drafts[:i], computed by accepting the drafts one by one and rolling them back. A
draft the grammar refuses ends that walk: the (masked) choice before it cannot equal it, so verification stops
there and the rows after it are never used. The tokens the step keeps are then accepted for real
(Request.append). A constraint that raises ends its request with "abort" and the reason, not the batch.
"""

from __future__ import annotations

import torch


def allows(mask: torch.Tensor, token: int) -> bool:
    """Whether the packed bitmask `mask` allows `token`."""
    word = token >> 5
    return 0 <= word < mask.numel() and bool((int(mask[word]) >> (token & 31)) & 1)


def _walk(c, drafts: list[int]) -> list[torch.Tensor | None]:
    """The masks of a request's rows: after its tokens so far, then after each draft the grammar allows."""
    masks, taken = [c.mask()], 0
    try:
        for d in drafts:
            if not allows(masks[-1], d):
                break
            taken += 1
            if c.accept(d):  # complete: the request ends at this draft
                break
            masks.append(c.mask())
    finally:
        if taken:
            c.rollback(taken)
    return masks + [None] * (len(drafts) + 1 - len(masks))


def step_masks(picks, vocab: int) -> tuple[dict[int, torch.Tensor], dict[int, str]]:
    """The masks of one step's sampled rows over `vocab` logits. picks: (request, first row, drafts) of each
    entry that samples; returns ({row: packed mask}, {id(request): why its constraint failed})."""
    masks, failed, words = {}, {}, (vocab + 31) // 32
    for r, start, drafts in picks:
        c = r.constraint
        if c is None:
            continue
        try:
            mine = {}
            for i, m in enumerate(_walk(c, drafts)):
                if m is not None:
                    m = torch.as_tensor(m).reshape(-1)
                    if m.numel() < words or m.dtype != torch.int32:
                        raise ValueError(f"mask() gave {m.numel()} {m.dtype} words; {vocab} logits need {words} "
                                         "int32 words")
                    mine[start + i] = m[:words]
            masks.update(mine)
        except Exception as exc:  # a broken grammar state: this request ends, not the batch
            failed[id(r)] = f"the request's token constraint failed: {type(exc).__name__}: {exc}"[:500]
    return masks, failed


def apply(logits: torch.Tensor, masks: dict[int, torch.Tensor]) -> torch.Tensor:
    """logits [R, V] with the disallowed tokens of the masked rows set to -inf (a new tensor on the same device;
    logits itself when masks is empty). One host -> device copy of the masked rows' packed words and their row
    numbers (pinned, non-blocking on CUDA), unpacked on the device; nothing is read back."""
    if not masks:
        return logits
    vocab = logits.shape[1]
    order = sorted(masks)
    packed = torch.stack([masks[row] for row in order])  # [M, words] int32
    index = torch.tensor(order, dtype=torch.int64)
    if logits.is_cuda:
        packed = packed.pin_memory().to(logits.device, non_blocking=True)
        index = index.pin_memory().to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = ((packed.unsqueeze(-1) >> shifts) & 1).reshape(len(order), -1)[:, :vocab]  # [M, V]: 1 = allowed
    out = logits.clone()
    out[index] = logits[index].masked_fill(bits == 0, float("-inf"))
    return out
