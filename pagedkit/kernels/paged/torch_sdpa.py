"""PagedAttention vectorized in torch (variant "torch_sdpa"): the CPU path of the runtime, and a
device-agnostic one (the same code runs on CUDA tensors). The loop-based reference stays the oracle.

It shares the prologue with the reference (prologue.prepare: split, QK-norm, RoPE, rotation,
slots) and writes the caches with one index_put per cache. Attention then runs per work item instead of
per (sequence, head, query row):
- sequences with few tokens in the step (decode, speculative drafts) are batched by token count, their
  contexts padded to the longest; longer sequences (prefill) go alone, their query rows chunked so the
  score workspace stays bounded;
- each sequence gathers only its live blocks: up to its extent past[b] + n_b (causal: up to the chunk's
  last query position), and from the window start when local_window_size > 0 (design §9.2: blocks
  wholly below the window are skipped); block_table -1 entries read as masked;
- the blocks are dequantized, positions outside [0, extent) or in unmapped blocks are zeroed and masked
  (stale cache bytes never reach the math), and the boolean mask [rows, context] is built in one shot
  (extent, causal, window);
- GQA by reshape: the G = H / Hkv query heads sharing a KV head become G x rows query rows of that KV
  head, so K/V are never repeated per query head;
- torch.nn.functional.scaled_dot_product_attention with that mask when there is no softcap, head_sink,
  attention_bias or output_qk; else an explicit float32 matmul / softmax that adds the bias after the
  scale, soft-caps, puts the sink into the denominator only and returns the scores or probabilities.
A row with no admitted key gets output 0, like the reference.

Host reads of device tensors (CPU variant, not CUDA-graph capturable; the GPU engine uses Triton
kernels): cumulative_sequence_length and past_seqlens are read to the host to slice per sequence (so
are the window / causal block ranges derived from them), plus what prologue.py documents
(query_positions' max with RoPE, slot_mapping's range check, the slot deduplication of the cache write).
With query_positions the key range is not clamped (positions are device values): correct, less pruned.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F

from .. import quant
from ..attention_math import default_scale
from ..variant import OP_FEATURES, KernelVariant
from .extents import check_extents
from .prologue import Step, prepare
from .cache import PagedCacheSide

NAME = "torch_sdpa"
CAPTURABLE = False  # host reads per call (see the module docstring)
SMALL_STEP = 16  # sequences with at most this many tokens in the step are batched by token count
BUDGET = 1 << 22  # score elements (heads x query rows x context) per attention call

VARIANT = KernelVariant(
    name=NAME,
    op="PagedAttention",
    entry=f"{__name__}:paged_attention",
    devices=("cpu", "cuda"),
    dtypes=("float16", "bfloat16"),
    capturable=CAPTURABLE,
    features=OP_FEATURES["PagedAttention"],  # every feature of the contract
    plans=("mixed",),
    description="Vectorized torch: sequences batched by step length, live blocks gathered and dequantized, "
                "GQA by reshape, torch SDPA (an explicit float32 softmax with softcap / head_sink / "
                "attention_bias / output_qk). The runtime's CPU path; the same code runs on CUDA tensors.",
    not_capturable_because="reads cumulative_sequence_length / past_seqlens (and slot_mapping's range) on the "
                           "host every call",
)


def supports(info: Any) -> str | None:
    """None when this variant serves the node (node_facts.NodeInfo), else the reason it does not."""
    return VARIANT.refusal(info)


def paged_attention(
    inputs: Mapping[str, Any],
    *,
    outputs: Sequence[str] | None = None,
    compute_dtype: torch.dtype = torch.float32,
    output_dtype: torch.dtype | None = None,
    validate: bool = True,
    **attributes: Any,
) -> dict[str, torch.Tensor]:
    """com.microsoft::PagedAttention, same signature and results as reference.paged_attention.
    validate=False skips the contract validator (prologue.prepare) for an already validated node."""
    if not validate:
        check_extents(inputs)  # the validator's guard that matters before the cache writes
    step = prepare(inputs, attributes, outputs, compute_dtype, vectorized_write=True, validate=validate)
    q = step.q  # [N, H, D]
    n_tok, dev = q.shape[0], q.device
    out = torch.empty(n_tok, step.num_heads, step.v_head, dtype=q.dtype, device=dev)  # [N, H, Dv]
    qk_mode = int(step.attrs["qk_output"])
    qk = torch.zeros(step.num_heads, n_tok, step.capacity, dtype=q.dtype, device=dev) if qk_mode else None
    for seqs, j0, j1 in _work_items(step):
        _attend_item(step, seqs, j0, j1, out, qk)
    return step.finish(out, qk, outputs, output_dtype)


def _work_items(step: Step) -> list[tuple[list[int], int, int]]:
    """(sequences, j0, j1): query rows [j0, j1) of each listed sequence, all with the same row count.
    Sequences with at most SMALL_STEP tokens are grouped by token count (contexts within ~2x of each
    other, heads x rows x context <= BUDGET); longer ones go alone in row chunks within BUDGET."""
    heads, items = step.num_heads, []
    by_len: dict[int, list[int]] = {}
    for b in range(len(step.past)):
        n = step.csl[b + 1] - step.csl[b]
        if n == 0:
            continue
        extent = step.extent(b)
        if n <= SMALL_STEP:
            by_len.setdefault(n, []).append(b)
            continue
        rows = max(1, BUDGET // (heads * extent))
        items += [([b], j0, min(n, j0 + rows)) for j0 in range(0, n, rows)]
    for n, seqs in by_len.items():  # by extent, so padding to the group's widest stays bounded
        group: list[int] = []
        for b in sorted(seqs, key=step.extent):
            wide = step.extent(b)
            if group and ((len(group) + 1) * heads * n * wide > BUDGET or wide > 2 * step.extent(group[0]) + 64):
                items.append((group, 0, n))
                group = []
            group.append(b)
        items.append((group, 0, n))
    return items


def _block_range(step: Step, b: int, j0: int, j1: int) -> tuple[int, int]:
    """Blocks [first, end) of sequence b that rows [j0, j1) can admit (host ints)."""
    a, bs = step.attrs, step.block_size
    lo, hi = 0, step.extent(b)
    if "query_positions" not in step.x:  # positions are past[b] + j: clamp to what the rows can see
        if int(a["is_causal"]):
            hi = min(hi, step.past[b] + j1)
        window = int(a["local_window_size"])
        if window > 0:
            lo = max(0, step.past[b] + j0 - window + 1)
    return lo // bs, -(-hi // bs)


def _attend_item(step: Step, seqs: list[int], j0: int, j1: int, out: torch.Tensor,
                 qk: torch.Tensor | None) -> None:
    a, q, dev = step.attrs, step.q, step.q.device
    bg, rows, bs = len(seqs), j1 - j0, step.block_size
    hkv, group, d, dv = step.kv_heads, step.num_heads // step.kv_heads, step.head_size, step.v_head
    ranges = [_block_range(step, b, j0, j1) for b in seqs]
    nb = max(end - first for first, end in ranges)
    ctx = nb * bs  # padded context of the item

    # live blocks of each sequence [Bg, nb] (-1: padding / beyond its range) and their key positions
    meta = torch.tensor([[f, e, b, step.extent(b), step.csl[b] + j0] for b, (f, e) in zip(seqs, ranges)],
                        dtype=torch.long)  # host: first block, end block, sequence, extent, first token
    cols = meta[:, :1] + torch.arange(nb)  # [Bg, nb] block_table columns
    entries = step.block_table[meta[:, 2:3].to(dev), cols.clamp(max=step.block_table.shape[1] - 1).to(dev)]
    blocks = torch.where((cols < meta[:, 1:2]).to(dev), entries, torch.full_like(entries, -1)).reshape(-1)
    kpos = (cols[:, :, None] * bs + torch.arange(bs)).reshape(bg, ctx).to(dev)  # [Bg, C] logical positions
    extent = meta[:, 3:4].to(dev)  # [Bg, 1]

    mapped = (blocks >= 0) & (blocks < step.kside.num_blocks)  # [Bg*nb]
    key_ok = mapped[:, None].expand(bg * nb, bs).reshape(bg, ctx) & (kpos < extent)  # [Bg, C]
    safe = torch.where(mapped, blocks, torch.zeros_like(blocks))  # unmapped / padding: block 0, zeroed
    stale = (~key_ok).reshape(-1).nonzero().squeeze(1)  # flat positions to zero
    keys = _read(step.kside, safe, stale, q.dtype).view(bg, ctx, hkv, d)
    if step.vside is None:  # LATENT: V is the leading Dv channels of the key cache
        values = keys[..., :dv]
    else:
        values = _read(step.vside, safe, stale, q.dtype).view(bg, ctx, hkv, dv)

    tok = (meta[:, 4:5] + torch.arange(rows)).to(dev)  # [Bg, r] token indices
    qpos = step.positions[tok]  # [Bg, r]
    allowed = key_ok[:, None, :].expand(bg, rows, ctx)  # [Bg, r, C]
    if int(a["is_causal"]):
        allowed = allowed & (kpos[:, None, :] <= qpos[:, :, None])
    window = int(a["local_window_size"])
    if window > 0:
        allowed = allowed & (kpos[:, None, :] >= qpos[:, :, None] - window + 1)

    # GQA by reshape: rows (j, g) of KV head kvh are query head kvh * G + g at row j
    qh = q[tok].view(bg, rows, hkv, group, d).transpose(1, 2).reshape(bg, hkv, rows * group, d)
    kh, vh = keys.transpose(1, 2), values.transpose(1, 2)  # [Bg, Hkv, C, D], [Bg, Hkv, C, Dv]
    mask = allowed[:, None, :, None, :].expand(bg, 1, rows, group, ctx).reshape(bg, 1, rows * group, ctx)
    scale = default_scale(float(a["scale"]), d)
    explicit = qk is not None or "head_sink" in step.x or "attention_bias" in step.x or float(a["softcap"]) > 0
    if explicit:
        o, s, p = _explicit(step, seqs, j0, j1, ranges, qh, kh, vh, mask, scale)
    else:
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
        o = torch.where(mask.any(-1, keepdim=True), o, torch.zeros((), dtype=o.dtype, device=dev))
    out[tok] = o.view(bg, hkv, rows, group, dv).transpose(1, 2).reshape(bg, rows, step.num_heads, dv)
    if qk is not None:
        val = (s if int(a["qk_output"]) == 1 else p).view(bg, hkv, rows, group, ctx).transpose(1, 2)
        val = val.reshape(bg, rows, step.num_heads, ctx)
        for i, (f, _) in enumerate(ranges):
            c0 = f * bs
            width = min(ctx, step.capacity - c0)
            qk[:, tok[i], c0:c0 + width] = val[i, :, :, :width].transpose(0, 1)


def _read(side: PagedCacheSide, blocks: torch.Tensor, stale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gather + dequantize blocks [M] (valid block ids) -> [M * BS, Hkv, D] in dtype, with the flat
    positions `stale` zeroed so stale cache bytes (NaN included) never reach the math.
    PagedCacheSide.read with index_select (several times faster than advanced indexing on CPU)."""
    stored = side.cache.index_select(0, blocks).flatten(0, 1)  # [M * BS, Hkv, Dc]
    if side.fmt is None:
        vals = stored.to(dtype)
    else:
        if side.quant_type == "PER_TOKEN":
            scale = side.scale_cache.index_select(0, blocks).flatten(0, 1).to(dtype)[..., None]  # [M * BS, Hkv, 1]
        else:
            scale = side.scale.to(dtype)
        vals = quant.dequantize(stored, scale, side.fmt, side.head_size, dtype)
    return vals.index_fill_(0, stale, 0)


def _explicit(step: Step, seqs, j0, j1, ranges, qh, kh, vh, mask, scale):
    """Scores [Bg, Hkv, r*G, C] = q k^T * scale (+ bias) -> softcap; softmax with the sink as one extra
    denominator term. Returns (out, scores with 0 where masked, probs)."""
    a, bg, rows = step.attrs, len(seqs), j1 - j0
    hkv, group, ctx = step.kv_heads, step.num_heads // step.kv_heads, kh.shape[2]
    s = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if "attention_bias" in step.x:
        bias = torch.stack([_bias_window(step, b, j0, j1, f * step.block_size, ctx)
                            for b, (f, _) in zip(seqs, ranges)])  # [Bg, H or 1, r, C]
        bias = bias.expand(bg, step.num_heads, rows, ctx).reshape(bg, hkv, group, rows, ctx)
        s = s + bias.transpose(2, 3).reshape(bg, hkv, rows * group, ctx)
    softcap = float(a["softcap"])
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    masked = s.masked_fill(~mask, float("-inf"))
    top = masked.amax(-1, keepdim=True)  # [Bg, Hkv, r*G, 1]
    sink = None
    if "head_sink" in step.x:
        sink = step.x["head_sink"].to(s.dtype).view(1, hkv, 1, group, 1).expand(1, hkv, rows, group, 1)
        sink = sink.reshape(1, hkv, rows * group, 1)
        top = torch.maximum(top, sink)
    top = torch.where(torch.isfinite(top), top, torch.zeros((), dtype=s.dtype, device=s.device))
    e = torch.exp(masked - top)  # 0 where masked
    denom = e.sum(-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink - top)
    p = e / denom.clamp_min(torch.finfo(s.dtype).tiny)  # a row with no key and no sink: 0
    return torch.matmul(p, vh), s.masked_fill(~mask, 0), p


def _bias_window(step: Step, b: int, j0: int, j1: int, c0: int, ctx: int) -> torch.Tensor:
    """Bias of sequence b's rows [j0, j1) over key positions [c0, c0 + ctx): [H or 1, r, ctx]."""
    rows = step.bias_rows(b)[:, j0:j1]  # [H or 1, r, capacity]
    rows = F.pad(rows, (0, max(0, c0 + ctx - rows.shape[-1])))
    return rows[..., c0:c0 + ctx]
