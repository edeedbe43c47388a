"""Node-level GroupQueryAttention <-> PagedAttention rules (issue 10, item 2), on onnx-ir.

Both operators share their features with identical math (design §3: same attribute names, defaults and
scale layouts). A rewrite of one node is a *rule set*: small rules, each with
  pattern  - does the feature occur on this node?
  check    - can the target operator express it exactly? (None, or the reason it cannot)
  rewrite  - move it: attributes, inputs, and helper nodes (Cast / Reshape / Gather) where layouts differ.
A node is converted only when every rule whose pattern matches passes its check; otherwise it is refused
with every reason (never half-converted, a feature is never dropped). The created attention node goes
through pagedkit's validator (`validate_node`) before it is returned.

What a node-level rule cannot know is where the *other* operator's step tensors come from (block table,
sequence lengths, caches, the packing of a padded batch): the caller says so with `PagedIO` (GQA ->
PagedAttention) or `GqaIO` (PagedAttention -> GQA). The whole-model passes (gqa_to_paged.py,
paged_to_gqa.py) build those once per model.

Modules: base.py (NodeFacts, Target, Rule, run_rules, make_node and the rules both directions share),
to_paged.py (GQA -> PagedAttention: `PagedIO`, `GQA_TO_PAGED`, `gqa_node_to_paged`), to_gqa.py (PagedAttention
-> GQA: `GqaIO`, `PAGED_TO_GQA`, `paged_node_to_gqa`); this module re-exports their public names and holds
`node_pass`, which runs either direction over a whole graph. How each direction maps a padded [B, S] batch
to packed [T] tokens and back: to_paged.py, to_gqa.py.
"""

from __future__ import annotations

from typing import Callable

import onnx_ir as ir

from pagedkit.validators.contract import DOMAIN

from .base import (  # noqa: F401 (re-exported)
    BF16, F16, F32, I32, I64, PAGED_T, NodeFacts, Refused, Rule, Target, make_node, run_rules,
)
from .to_gqa import PAGED_TO_GQA, GqaIO, paged_node_to_gqa
from .to_paged import GQA_TO_PAGED, PagedIO, gqa_node_to_paged


def node_pass(model: ir.Model, to: str, io_for: Callable[[ir.Node], object], rules: tuple[Rule, ...] | None = None):
    """Convert every main-graph attention node of the source operator (GroupQueryAttention for to="paged",
    PagedAttention for to="gqa") in place; `io_for(node)` gives its PagedIO / GqaIO (or raises Refused).
    A refused node is left unchanged and reported with the reason. Consumers of the old outputs and graph
    outputs are rewired to the new values. Returns a RewriteReport (changed, skipped, rules per node)."""
    from ..report import RewriteReport

    if to not in ("paged", "gqa"):
        raise ValueError(f"to should be 'paged' or 'gqa', got {to!r}")
    src_op, fn = ("GroupQueryAttention", gqa_node_to_paged) if to == "paged" else ("PagedAttention", paged_node_to_gqa)
    rules = rules if rules is not None else (GQA_TO_PAGED if to == "paged" else PAGED_TO_GQA)
    g = model.graph
    report = RewriteReport(f"node pass -> {to}")
    for i, node in enumerate([n for n in g if n.op_type == src_op and n.domain == DOMAIN]):
        name = node.name or f"{src_op}_{i}"
        try:
            new_nodes, replaces, applied = fn(node, io_for(node), rules)
        except Refused as exc:
            report.skipped.append((name, str(exc)))
            continue
        g.insert_before(node, new_nodes)
        for old, new in replaces.items():
            if old in g.outputs:
                idx = g.outputs.index(old)
                keep = old.name
                old.name = f"{keep}/replaced"
                new.name = keep
                g.outputs[idx] = new
            old.replace_all_uses_with(new)
        g.remove(node, safe=True)
        report.changed.append(name)
        report.rules[name] = applied
    return report


__all__ = ["GQA_TO_PAGED", "PAGED_TO_GQA", "GqaIO", "NodeFacts", "PagedIO", "Refused", "Rule", "Target", "node_pass",
           "gqa_node_to_paged", "make_node", "paged_node_to_gqa", "run_rules"]
