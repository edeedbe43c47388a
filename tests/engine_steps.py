"""Shared by the engine's padded-step tests (test_engine_graphs.py, test_prefill_graphs.py): teacher-forced decode
steps of a PagedModel on seeded ids."""

from __future__ import annotations

import random

import torch


def decode_steps(model, sids, steps: int, rng: random.Random, vocab: int = 144) -> list[torch.Tensor]:
    """`steps` decode steps of every sequence in `sids` (one seeded id each, teacher-forced), then the sequences
    freed; the logits [B, V] of each step as float32 CPU tensors."""
    mgr, out = model.mgr, []
    for _ in range(steps):
        ids = [rng.randrange(3, vocab) for _ in sids]
        plan = model.plan([(s, [t]) for s, t in zip(sids, ids)])
        out.append(model.run(plan, ids).float().cpu().clone())
        mgr.commit(plan)
    for s in sids:
        mgr.free(s)
    return out
