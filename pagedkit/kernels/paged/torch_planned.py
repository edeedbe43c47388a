"""PagedAttention on torch with the step's host bookkeeping planned once per run (variant "torch_planned").

The common decoder node (unquantized caches, packed or separate Q/K/V, RoPE, QK-norm, causal or not, local
window) as few torch calls as possible, for the CPU runtime's decode and prefill steps:
- plan (host, once per run scope, shared by every layer reading the same cumulative_sequence_length /
  past_seqlens / block_table: kernels/scope.py): positions, deduplicated write slots, per work item the
  flat cache slots to gather [Bg * C], the mask [Bg, 1, r, C] (None when nothing is masked; is_causal for a
  whole prompt without a prefix), the gathered rows to zero (stale or unmapped positions), the query rows
  with no admitted key (output 0); RoPE's cos / sin rows once per (cos_cache, plan);
- run (per layer): split, QK-norm, RoPE on Q and K together, Q rounded to T, one index_copy_ per cache,
  then per item an index_select per cache and one torch SDPA call with GQA (enable_gqa: K/V never
  repeated). Work items follow torch_sdpa: sequences of up to SMALL_STEP tokens are batched by token
  count, longer ones go alone in query-row chunks that keep rows x context <= BUDGET.
Same numerics as the reference (float32 compute, Q rounded to T, K/V stored in the cache dtype and read
back); quantized caches, softcap, head_sink, attention_bias, output_qk, slot_mapping, query_positions,
Hadamard rotation and LATENT go to torch_sdpa (dispatch refuses them here by feature).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F

from pagedkit.validators.contract import PAGED_ATTENTION

from ..attention_math import default_scale, rms_norm_heads
from ..scope import memo
from ..variant import KernelVariant
from . import prologue
from .prologue import as_torch, need

NAME = "torch_planned"
SMALL_STEP = 16  # sequences with at most this many tokens are batched by token count
BUDGET = 1 << 24  # query rows x context per attention call (bounds the mask and the score workspace)
_DEFAULTS = PAGED_ATTENTION.defaults()
_FEATURES = ("packed_qkv", "rotary", "qk_norm", "local_window", "non_causal", "attention_metadata")

def _cache_ok(info: Any) -> str | None:
    for side in (info.k_cache_format, info.v_cache_format):
        if side not in (None, "float16", "bfloat16", "float"):
            return f"cache format {side}: unquantized caches only"
    return None


VARIANT = KernelVariant(
    name=NAME,
    op="PagedAttention",
    entry=f"{__name__}:paged_attention",
    devices=("cpu", "cuda"),
    dtypes=("float16", "bfloat16"),
    capturable=False,
    features=_FEATURES,
    supports=_cache_ok,
    plans=("mixed",),
    description="Vectorized torch with the host bookkeeping (slots, gather indices, masks, RoPE rows) planned "
                "once per run and shared by every layer; one index_copy_ per cache and one SDPA call (GQA) per "
                "work item. The runtime's fast CPU path for unquantized caches.",
    limits="unquantized caches only (float16 / bfloat16 / float32 storage)",
    not_capturable_because="plans on the host from cumulative_sequence_length / past_seqlens / block_table "
                           "every run",
)


@dataclass
class _Item:
    """One SDPA call: `bg` sequences x rows [j0, j0 + rows) each, over a padded context of `ctx` keys."""

    tok: torch.Tensor | None  # [bg * rows] token indices (None: all N tokens in order)
    bg: int
    rows: int
    ctx: int
    gather: torch.Tensor  # [bg * ctx] flat cache slots (valid ids; padding reads slot 0, zeroed)
    stale: torch.Tensor | None  # flat positions of the gathered rows to zero
    mask: torch.Tensor | None  # [bg, 1, rows, ctx] bool, None: every key admitted
    causal: bool  # is_causal (a whole prompt, no prefix, no window)
    empty: torch.Tensor | None  # [bg * rows] bool: rows with no admitted key (output 0), None: none


@dataclass
class _Plan:
    positions: torch.Tensor  # [N] long
    top: int  # largest position of a token (RoPE rows needed)
    w_rows: torch.Tensor  # [W] long token rows written (the last of tokens sharing a slot)
    w_slots: torch.Tensor  # [W] long flat slots
    items: list[_Item]
    w_all: bool = False  # w_rows == arange(N): no row gather before the write


def supports(info: Any) -> str | None:
    """None when this variant serves the node (node_facts.NodeInfo), else the reason it does not."""
    return VARIANT.refusal(info)


def _plan(csl_t: torch.Tensor, past_t: torch.Tensor, table_t: torch.Tensor, n_tok: int, num_blocks: int,
          bs: int, causal: bool, window: int, dev: torch.device) -> _Plan:
    csl, past = csl_t.long().tolist(), past_t.long().tolist()
    need(len(csl) == len(past) + 1 and csl[-1] == n_tok, "input 'cumulative_sequence_length'",
         f"expected batch_size + 1 = {len(past) + 1} entries ending at token_count {n_tok}, got {csl}")
    lens = [csl[b + 1] - csl[b] for b in range(len(past))]
    need(min(lens, default=0) >= 0, "input 'cumulative_sequence_length'", f"should be non-decreasing, got {csl}")
    need(min(past, default=0) >= 0, "input 'past_seqlens'", f"entries should be >= 0, got {past}")
    table = table_t.long().cpu()  # [B, MB]
    mb = table.shape[1]
    valid_blk = (table >= 0) & (table < num_blocks)
    for b, (p, n) in enumerate(zip(past, lens)):
        need(p + n <= mb * bs, "input 'block_table'",
             f"sequence {b} holds {p + n} tokens but block_table covers {mb * bs} ({mb} blocks of {bs})")
    pos = torch.tensor([p + j for p, n in zip(past, lens) for j in range(n)], dtype=torch.long)
    seq = torch.tensor([b for b, n in enumerate(lens) for _ in range(n)], dtype=torch.long)
    blk = table[seq, pos // bs] if n_tok else torch.zeros(0, dtype=torch.long)
    slots = torch.where(valid_blk[seq, pos // bs], blk * bs + pos % bs, torch.full_like(blk, -1))
    s, order = torch.sort(slots, stable=True)  # of tokens sharing a slot the last one wins
    last = torch.ones_like(s, dtype=torch.bool)
    last[:-1] = s[1:] != s[:-1]
    keep = order[last & (s >= 0)]
    items = []
    groups: dict[int, list[int]] = {}
    for b, n in enumerate(lens):
        if n == 0:
            continue
        if n <= SMALL_STEP:
            groups.setdefault(n, []).append(b)
        else:
            rows = max(1, BUDGET // (past[b] + n))
            items += [_item([b], j0, min(n, j0 + rows), csl, past, lens, table, valid_blk, bs, causal, window)
                      for j0 in range(0, n, rows)]
    for n, seqs in groups.items():
        group: list[int] = []
        for b in sorted(seqs, key=lambda b: past[b]):
            if group and ((len(group) + 1) * n * (past[b] + n) > BUDGET or past[b] > 2 * past[group[0]] + 64):
                items.append(_item(group, 0, n, csl, past, lens, table, valid_blk, bs, causal, window))
                group = []
            group.append(b)
        items.append(_item(group, 0, n, csl, past, lens, table, valid_blk, bs, causal, window))
    if len(items) == 1 and items[0].bg == 1 and items[0].rows == n_tok:
        items[0].tok = None  # one sequence, all its rows: no gather / scatter of query rows
    for it in items:
        for name in ("tok", "gather", "stale", "mask", "empty"):
            t = getattr(it, name)
            if t is not None:
                setattr(it, name, t.to(dev))
    top = max((p + n - 1 for p, n in zip(past, lens) if n), default=0)
    w_all = bool(keep.numel() == n_tok and torch.equal(keep, torch.arange(n_tok)))
    return _Plan(pos.to(dev), top, keep.to(dev), slots[keep].to(dev), items, w_all)


def _item(seqs, j0, j1, csl, past, lens, table, valid_blk, bs, causal, window) -> _Item:
    rows = j1 - j0
    lo = [max(0, past[b] + j0 - window + 1) if window > 0 else 0 for b in seqs]  # first key a row can see
    hi = [min(past[b] + lens[b], past[b] + j1) if causal else past[b] + lens[b] for b in seqs]
    ctx = max(h - l for l, h in zip(lo, hi))
    kpos = torch.tensor(lo)[:, None] + torch.arange(ctx)  # [bg, C] key positions
    extent = torch.tensor(hi)[:, None]
    in_range = kpos < extent
    kcl = kpos.clamp(max=table.shape[1] * bs - 1)
    sidx = torch.tensor(seqs)[:, None]
    mapped = valid_blk[sidx, kcl // bs] & in_range
    gather = torch.where(mapped, table[sidx, kcl // bs] * bs + kcl % bs, torch.zeros_like(kpos))
    qpos = torch.tensor([past[b] + j0 for b in seqs])[:, None] + torch.arange(rows)  # [bg, r]
    allowed = mapped[:, None, :].expand(len(seqs), rows, ctx)
    if causal:
        allowed = allowed & (kpos[:, None, :] <= qpos[:, :, None])
    if window > 0:
        allowed = allowed & (kpos[:, None, :] >= qpos[:, :, None] - window + 1)
    full = bool(allowed.all())
    whole_prompt = len(seqs) == 1 and past[seqs[0]] == 0 and j0 == 0 and rows == ctx and bool(mapped.all())
    is_causal = causal and window <= 0 and whole_prompt
    mask = None if full or is_causal else allowed[:, None]
    empty = ~allowed.any(-1).reshape(-1)
    stale = (~mapped).reshape(-1).nonzero().squeeze(1)
    tok = torch.cat([torch.arange(csl[b] + j0, csl[b] + j1) for b in seqs])
    return _Item(tok, len(seqs), rows, ctx, gather.reshape(-1), stale if stale.numel() else None, mask,
                 is_causal, empty if bool(empty.any()) else None)


def _rope_rows(cos: torch.Tensor, sin: torch.Tensor, plan: _Plan, cdt: torch.dtype):
    need(plan.positions.numel() == 0 or plan.top < cos.shape[0], "input 'cos_cache'",
         f"has {cos.shape[0]} positions, a token needs position {plan.top}")
    return cos[plan.positions].to(cdt)[:, None, :], sin[plan.positions].to(cdt)[:, None, :]  # [N, 1, half]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, offset: int) -> torch.Tensor:
    """RoPE on channels [offset, offset + 2 * half) of x [N, H, D] (a fresh tensor; x is not modified)."""
    half = cos.shape[-1]
    seg = x[..., offset:offset + 2 * half]
    if interleaved:
        a, b = seg[..., 0::2], seg[..., 1::2]
        rot = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    else:
        a, b = seg[..., :half], seg[..., half:]
        rot = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
    if offset == 0 and 2 * half == x.shape[-1]:
        return rot
    out = x.clone()
    out[..., offset:offset + 2 * half] = rot
    return out


def paged_attention(inputs: Mapping[str, Any], *, outputs: Sequence[str] | None = None,
                    compute_dtype: torch.dtype = torch.float32, output_dtype: torch.dtype | None = None,
                    validate: bool = True, **attributes: Any) -> dict[str, torch.Tensor]:
    """com.microsoft::PagedAttention for the features this variant declares; same results as the reference."""
    if validate:
        prologue.require_valid_inputs(inputs, attributes, op_type="PagedAttention", outputs=outputs)
    x = {k: as_torch(v) for k, v in inputs.items() if v is not None}
    a = _DEFAULTS | attributes
    cdt = compute_dtype
    nh, hkv = int(a["num_heads"]), int(a["kv_num_heads"])
    query = x["query"]
    t_dtype, n_tok, dev = query.dtype, query.shape[0], query.device
    packed = "key" not in x
    d = query.shape[1] // (nh + 2 * hkv if packed else nh)
    kc, vc = x["key_cache"], x["value_cache"]  # [NB, BS, Hkv, D]
    causal, window = bool(int(a["is_causal"])), int(a["local_window_size"])
    csl, past, table = x["cumulative_sequence_length"], x["past_seqlens"], x["block_table"]
    # unvalidated, the plan checks every sequence's extent against the block table before any write
    key = ("paged_plan", id(csl), id(past), id(table), kc.shape[0], kc.shape[1], causal, window, str(dev))
    plan: _Plan = memo(key, lambda: _plan(csl, past, table, n_tok, kc.shape[0], kc.shape[1], causal, window, dev))

    q_all = query.to(cdt)
    if packed:
        q, k, v = q_all.split([nh * d, hkv * d, hkv * d], dim=1)
    else:
        q, k, v = q_all, x["key"].to(cdt), x["value"].to(cdt)
    q, k, v = q.reshape(n_tok, nh, d), k.reshape(n_tok, hkv, d), v.reshape(n_tok, hkv, d)
    if "q_norm_weight" in x:
        eps = float(a["qk_norm_epsilon"])
        q = rms_norm_heads(q, x["q_norm_weight"].to(cdt), eps)
        k = rms_norm_heads(k, x["k_norm_weight"].to(cdt), eps)
    if int(a["do_rotary"]):
        cos_t, sin_t = x["cos_cache"], x["sin_cache"]
        cos, sin = memo(("rope", key, id(cos_t), id(sin_t)), lambda: _rope_rows(cos_t, sin_t, plan, cdt))
        qk = _rope(torch.cat((q, k), dim=1), cos, sin, bool(int(a["rotary_interleaved"])), int(a["rotary_offset"]))
        q, k = qk[:, :nh], qk[:, nh:]
    q = q.to(t_dtype).to(cdt)  # the prologue's Q is a T tensor

    need(kc.is_contiguous() and vc.is_contiguous(), "inputs 'key_cache' / 'value_cache'",
         "should be contiguous (they are updated in place)")
    kflat, vflat = kc.view(-1, hkv, d), vc.view(-1, hkv, d)
    if plan.w_rows.numel():
        if plan.w_all:  # every token writes its own slot, in token order
            kflat.index_copy_(0, plan.w_slots, k.to(kc.dtype))
            vflat.index_copy_(0, plan.w_slots, v.to(vc.dtype))
        else:
            kflat.index_copy_(0, plan.w_slots, k.index_select(0, plan.w_rows).to(kc.dtype))
            vflat.index_copy_(0, plan.w_slots, v.index_select(0, plan.w_rows).to(vc.dtype))

    scale = default_scale(float(a["scale"]), d)
    out = None if len(plan.items) == 1 and plan.items[0].tok is None else \
        torch.zeros(n_tok, nh, d, dtype=cdt, device=dev)
    for it in plan.items:
        keys = kflat.index_select(0, it.gather).to(cdt)  # [bg * C, Hkv, D]
        vals = vflat.index_select(0, it.gather).to(cdt)
        if it.stale is not None:
            keys.index_fill_(0, it.stale, 0)
            vals.index_fill_(0, it.stale, 0)
        keys = keys.view(it.bg, it.ctx, hkv, d).transpose(1, 2)
        vals = vals.view(it.bg, it.ctx, hkv, d).transpose(1, 2)
        qi = q if it.tok is None else q.index_select(0, it.tok)
        qi = qi.view(it.bg, it.rows, nh, d).transpose(1, 2)  # [bg, H, r, D]
        o = F.scaled_dot_product_attention(qi, keys, vals, attn_mask=it.mask, is_causal=it.causal, scale=scale,
                                           enable_gqa=nh != hkv)
        o = o.transpose(1, 2).reshape(it.bg * it.rows, nh, d)
        if it.empty is not None:
            o = o.masked_fill(it.empty[:, None, None], 0)
        if out is None:
            out = o
        else:
            out.index_copy_(0, it.tok, o)
    if out is None:
        out = torch.zeros(n_tok, nh, d, dtype=cdt, device=dev)
    result = {"output": out.reshape(n_tok, nh * d).to(output_dtype or t_dtype), "key_cache_out": kc,
              "value_cache_out": vc}
    if outputs is not None:
        result = {n: t for n, t in result.items() if n in set(outputs)}
    return result
