"""One tensor-parallel rank's graph, built by the family's own code over the rank's slices of the weights.

`build_rank(hf_model, opts, plan, rank)` runs the family's `build` with
- every parameter a rule of plan.py cuts replaced by the rank's slice (lazily: lazy.py's LazyTensors, so a slice
  reads only its rows when the initializer is written), and the layers' head counts in the ModelSpec set to the
  rank's (query heads / N; KV heads / N, or the one replicated KV head; MLA keeps its single latent head);
- the family wrapped (`TPFamily`, first in the method order) so that the attention block's and the feed-forward
  block's outputs, partial sums after their row-parallel products (o / down / experts' fc2), go through one
  com.microsoft::AllReduce each before they reach the residual stream (or a post-norm); one per block however
  the block is composed (DeepSeek's routed + shared experts: their Add of two partial sums is itself a partial
  sum, reduced once);
- the LM head vocabulary-parallel: rank r computes the logits of its ceil(V / N) vocabulary rows (the last rank's
  padded with zero rows), then com.microsoft::AllGather (axis 1, group_size N) gives every rank all of them
  (a Slice drops the padding); the embedding table is replicated (a tied head reads its rows of it).

onnxruntime's AllReduce takes float16 / float / double: a bfloat16 graph reduces in float32 between Casts (and
its logits are float32 already). AllGather: float16 / float / double / int64 / bool.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Iterator

import onnx
import torch
from onnx import TensorProto

from ...interface import names as N
from ..families.base import ExportContext, ExportOptions
from ..graph import MS_DOMAIN, GraphBuilder, cast
from ..lazy import lazy_parameters
from ..registry import family_for
from .plan import _TOP, ShardPlan, rule_for, shard

REDUCE_TYPES = (TensorProto.FLOAT16, TensorProto.FLOAT, TensorProto.DOUBLE)  # onnxruntime's AllReduce T
GATHER_TYPES = REDUCE_TYPES + (TensorProto.INT64, TensorProto.BOOL)  # AllGather T
I64 = TensorProto.INT64


def all_reduce(g: GraphBuilder, x: str, name: str) -> str:
    """x summed over the ranks (com.microsoft::AllReduce), in x's type (float32 between Casts for bfloat16)."""
    t, shape = g.vi[x]
    y = x if t in REDUCE_TYPES else cast(g, x, TensorProto.FLOAT, f"{name}/input/Cast")
    y = g.node("AllReduce", [y], name, domain=MS_DOMAIN, out_type=g.vi[y][0], out_shape=shape)
    return cast(g, y, t, f"{name}/output/Cast")


def all_gather(g: GraphBuilder, x: str, world: int, name: str, outputs: list[str] | None = None) -> str:
    """x [rows, n] of every rank concatenated along axis 1 -> [rows, world * n] (com.microsoft::AllGather)."""
    t, (rows, n) = g.vi[x]
    if t not in GATHER_TYPES:
        x = cast(g, x, TensorProto.FLOAT, f"{name}/input/Cast")
        t = TensorProto.FLOAT
    return g.node("AllGather", [x], name, domain=MS_DOMAIN, outputs=outputs, axis=1, group_size=int(world),
                  out_type=t, out_shape=(rows, world * n))


class TPFamily:
    """Mixin placed before a family's class: the collectives of one rank (module docstring)."""

    tp_plan: ShardPlan
    tp_rank: int
    _tp_depth = 0  # > 0 inside a feed-forward block already being reduced (ffn -> mlp)

    def attention(self, ctx: ExportContext, i: int, attn, x: str) -> str:
        return all_reduce(ctx.g, super().attention(ctx, i, attn, x), f"/model/layers.{i}/attn/AllReduce")

    def _reduced(self, ctx: ExportContext, i: int, run) -> str:
        if self._tp_depth:
            return run()
        self._tp_depth += 1
        try:
            y = run()
        finally:
            self._tp_depth -= 1
        return all_reduce(ctx.g, y, f"/model/layers.{i}/mlp/AllReduce")

    def ffn(self, ctx: ExportContext, i: int, layer, x: str) -> str:
        return self._reduced(ctx, i, lambda: super(TPFamily, self).ffn(ctx, i, layer, x))

    def mlp(self, ctx: ExportContext, i: int, mlp, x: str) -> str:
        return self._reduced(ctx, i, lambda: super(TPFamily, self).mlp(ctx, i, mlp, x))

    def lm_head(self, ctx: ExportContext, x: str) -> str:
        g, plan, head = ctx.g, self.tp_plan, ctx.model.lm_head
        lo, hi = plan.vocab_range(self.tp_rank)
        per = plan.vocab_per_rank
        saved = dict(head._parameters)
        for name in ("weight", "bias"):
            p = saved.get(name)
            if p is None:
                continue
            rows = p[lo:hi]
            if hi - lo < per:  # the last rank's rows padded with zeros (their logits are sliced off)
                rows = torch.cat([rows, torch.zeros((per - (hi - lo),) + tuple(p.shape[1:]), dtype=p.dtype)])
            head._parameters[name] = rows  # a tied head: its own slice of the table, no longer `is` the embedding
        try:
            super().lm_head(ctx, x)
        finally:
            head._parameters.update(saved)
        shard_name = "/lm_head/shard/output_0"
        for node in g.nodes:
            for j, o in enumerate(node.output):
                if o == N.LOGITS:
                    node.output[j] = shard_name
        g.vi[shard_name] = g.vi.pop(N.LOGITS)
        g.outputs[:] = [o for o in g.outputs if o.name != N.LOGITS]
        vocab, full = plan.vocab, plan.world * per
        y = all_gather(g, shard_name, plan.world, "/lm_head/AllGather", [N.LOGITS] if full == vocab else None)
        t, rows = g.vi[y][0], g.vi[y][1][0]
        if full != vocab:
            g.node("Slice", [y, g.const([0], I64), g.const([vocab], I64), g.const([1], I64)], "/lm_head/Slice",
                   outputs=[N.LOGITS])
        g.vi[N.LOGITS] = (t, (rows, vocab))
        g.output(N.LOGITS, t, (rows, vocab))
        return N.LOGITS


def tp_family(family, plan: ShardPlan, rank: int):
    """`family` (an instance) as one rank's family: a subclass with TPFamily first."""
    cls = type(f"TP{type(family).__name__}", (TPFamily, type(family)), {})
    out = cls()
    out.tp_plan, out.tp_rank = plan, rank
    return out


@contextlib.contextmanager
def sharded_parameters(model: torch.nn.Module, plan: ShardPlan, rank: int) -> Iterator[torch.nn.Module]:
    """Within the block, every parameter a rule cuts is rank `rank`'s slice (of whatever the module holds: a
    LazyTensor under lazy_parameters); restored on exit."""
    swapped = []
    for module_name, module in model.named_modules():
        for pname, p in list(module._parameters.items()):
            full = f"{module_name}.{pname}" if module_name else pname
            if p is None or full in _TOP:
                continue
            rule = rule_for(plan.family, full)
            if rule is not None:
                swapped.append((module, pname, p))
                module._parameters[pname] = shard(plan, rule, p, rank)
    try:
        yield model
    finally:
        for module, pname, p in reversed(swapped):
            module._parameters[pname] = p


def rank_options(opts: ExportOptions, plan: ShardPlan, rank: int) -> ExportOptions:
    """opts with calibrated static K / V scales cut to the rank's KV heads (PER_CHANNEL [kv_heads, 1, D])."""
    def cut(s):
        if s is None or s.dim() < 2 or plan.latent or s.shape[0] != plan.kv_heads:
            return s
        lo, hi = plan.unit_range("kv", plan.kv_heads, rank)
        return s[lo:hi]

    return replace(opts, kv_scales={i: (cut(k), cut(v)) for i, (k, v) in opts.kv_scales.items()})


def build_rank(hf_model: torch.nn.Module, opts: ExportOptions, plan: ShardPlan, rank: int, *,
               external=None, min_external_bytes: int = 0) -> tuple[onnx.ModelProto, object]:
    """Rank `rank`'s graph and ModelSpec (its layers' head counts the rank's). external: a file the weights are
    written to as each initializer is evaluated (GraphBuilder.model), when they exceed min_external_bytes."""
    family = tp_family(family_for(hf_model.config), plan, rank)
    ctx = ExportContext(family, hf_model, rank_options(opts, plan, rank))
    for l in ctx.spec.layers:
        l.num_heads = plan.heads_per_rank
        if l.layout != "LATENT":
            l.kv_num_heads = plan.kv_per_rank
    with torch.no_grad(), lazy_parameters(hf_model), sharded_parameters(hf_model, plan, rank):
        family.build(ctx, range(len(family.layers(hf_model))))
    doc = (f"pagedkit export of {hf_model.config.model_type} (family {plan.family}), tensor-parallel rank {rank} of "
           f"{plan.world}")
    name = f"pagedkit_{plan.family}_tp{rank}of{plan.world}"
    if external is not None and ctx.g.nbytes() <= min_external_bytes:
        external = None
    return ctx.g.model(name, "pagedkit", doc, external=external), ctx.spec
