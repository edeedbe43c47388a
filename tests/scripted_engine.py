"""A real pagedkit Engine whose model is scripted: `ScriptedModel(engine, next_logits)` replaces
`engine.model.run`, so every step goes through the engine's own scheduling, KV plans, commits, sampling
(`Choices`), stop rules and streaming, but the logits of each sampled position come from a test function of
the request and its context (prompt + tokens so far), not from a network. Deterministic tokens at any point
of a generation (eos at step k, a stop sequence after partial matches...), and fixed distributions for the
sampling tests, without a model that happens to produce them.

The engine is built on examples/tiny-paged (vocab 128, context 128, block size 16, eos 2): its session is
loaded but never run while the script is in place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import torch

from pagedkit.engine import Engine

REPO = Path(__file__).resolve().parents[1]
TINY_PAGED = REPO / "examples" / "tiny-paged"  # vocab 128, context_length 128, block 16, eos 2
VOCAB = 128


def scripted_engine(**kw) -> Engine:
    kw.setdefault("max_batch_size", 8)
    return Engine(TINY_PAGED, **kw)


def one_hot(token: int, vocab: int = VOCAB, high: float = 20.0) -> torch.Tensor:
    """Logits whose argmax is `token` by a wide margin (greedy picks it)."""
    row = torch.zeros(vocab)
    row[token] = high
    return row


class ScriptedModel:
    """engine.model.run replaced: the logits of flat position t (sequence s, absolute position p) are
    next_logits(request of s, context = the request's tokens[:past] + the ids fed up to t) -> [V]."""

    def __init__(self, engine: Engine, next_logits: Callable[[object, list[int]], torch.Tensor]):
        self.engine = engine
        self.next_logits = next_logits
        self.steps = 0
        self.fed: list[tuple] = []  # (seq ids, query lens) of every step run
        engine.model.run = self.run

    def run(self, plan, token_ids: Sequence[int], rows: Sequence[int] | None = None, device_ids=None) -> torch.Tensor:
        assert device_ids is None, "the scripted model serves plain (non-overlapped) steps only"
        live = {r.request_id: r for r in self.engine.running}
        where = []  # flat position -> (request, context)
        flat = 0
        for sid, q, past in zip(plan.seq_ids, plan.query_lens, plan.past_lens):
            r = live[sid]
            assert len(r.tokens) >= past, (sid, past)
            base = list(r.tokens[:past])
            for j in range(q):
                where.append((r, base + [int(t) for t in token_ids[flat - j:flat + 1]]))
                flat += 1
        assert flat == len(token_ids)
        self.steps += 1
        self.fed.append((tuple(plan.seq_ids), tuple(plan.query_lens)))
        rows = range(len(token_ids)) if rows is None else rows
        out = torch.stack([self.next_logits(*where[i]).float() for i in rows]) if len(rows) else \
            torch.empty(0, VOCAB)
        return out


def continuation_script(scripts: dict[tuple[int, ...], Sequence[int]], filler: int = 3):
    """next_logits of requests told apart by their prompt: generated token k is scripts[prompt][k]
    (one-hot logits; `filler` once the script is exhausted)."""

    def next_logits(req, context):
        script = scripts[tuple(req.prompt)]
        k = len(context) - len(req.prompt)  # tokens generated before the one this row chooses
        return one_hot(script[k] if k < len(script) else filler)

    return next_logits


def drive(engine: Engine, max_steps: int = 5000) -> dict[str, list]:
    """Step until nothing is unfinished; every RequestOutput per request id, in order."""
    outs: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outs
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    raise AssertionError(f"the engine did not finish within {max_steps} steps")
