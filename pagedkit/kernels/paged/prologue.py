"""The PagedAttention step before attention and after it, shared by the loop-based reference and the
vectorized torch variant (torch_sdpa) so both see the same Q, the same slots and the same caches.

`prepare(...)` validates the call and does, for every token of the step (contract-decisions §2, §3, §7):
1. [packed QKV split] -> QK-norm -> RoPE -> Hadamard rotation (Q/K with qk_rotation, V with v_rotation);
   Q is then rounded to T, like ORT's prologue workspace;
2. sequence bookkeeping: sequence b owns tokens [csl[b], csl[b+1]); token j of it sits at position
   past[b] + j (query_positions, when given, replace these positions for RoPE and the masks only);
3. the write slot of every token: slot_mapping, or block_table[b][p // BS] * BS + p % BS (-1 or an
   unmapped block: no write);
4. the cache writes (all tokens of the step before any attention): the reference's loop
   (PagedCacheSide.write, the oracle) or a vectorized index_put over the slots (same bytes).
`Step.finish(out, qk)` undoes the V rotation and assembles the outputs.

Host reads (the rest is device-agnostic torch): cumulative_sequence_length and past_seqlens (.tolist(),
to slice per sequence), the min / max of query_positions when given with do_rotary (cos_cache bounds), and
with slot_mapping its range check plus the slot deduplication of the vectorized write.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from pagedkit.interface import dtypes
from pagedkit.validators.checks import require_valid_inputs
from pagedkit.validators.contract import PAGED_ATTENTION

from ..attention_math import apply_rope, rms_norm_heads
from ..quant import hadamard_matrix
from .cache import PagedCacheSide, make_side

_RAW_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # bit views by element size


def as_torch(x: Any) -> torch.Tensor:
    """A torch tensor as is; a numpy array (incl. ml_dtypes bfloat16 / float8_e4m3fn) as a new tensor."""
    if isinstance(x, torch.Tensor):
        return x
    return dtypes.torch_from_numpy(x)  # a copy; ml_dtypes arrays through their raw integer view


def need(cond: bool, where: str, msg: str) -> None:
    """Last-line guard for run-time values that would otherwise index out of range."""
    if not cond:
        raise ValueError(f"PagedAttention: {where}: {msg}")


def rotate(x: torch.Tensor) -> torch.Tensor:
    """Walsh-Hadamard rotation of x [..., D] over heads' channels (its own inverse), on x's device."""
    return x @ hadamard_matrix(x.shape[-1], x.dtype, "head_size").to(x.device)


@dataclass
class Step:
    """One PagedAttention call after the prologue and the cache writes."""

    attrs: dict  # the node's attributes, contract defaults filled in
    x: dict  # present inputs as torch tensors, by ONNX name
    t_dtype: torch.dtype  # T (query's element type)
    num_heads: int
    kv_heads: int
    head_size: int  # D of Q/K
    v_head: int  # effective_v_head_size Dv (LATENT: v_head_size or D)
    latent: bool
    q: torch.Tensor  # [N, H, D] compute dtype, rounded to T
    csl: list  # [B + 1] host ints
    past: list  # [B] host ints
    block_table: torch.Tensor  # [B, MB] long
    positions: torch.Tensor  # [N] long: RoPE / mask position of each token
    kside: PagedCacheSide
    vside: PagedCacheSide | None  # None with LATENT (V = leading Dv channels of the key cache)
    slots: torch.Tensor  # [N] long flat write slot of each token (-1: not written)

    @property
    def block_size(self) -> int:
        return self.kside.block_size

    @property
    def capacity(self) -> int:
        """Context capacity of a sequence: block_table.shape[1] * block_size."""
        return self.block_table.shape[1] * self.block_size

    def extent(self, b: int) -> int:
        """KV extent of sequence b (past + new tokens), checked against the block table's capacity."""
        extent = self.past[b] + self.csl[b + 1] - self.csl[b]
        mb, bs = self.block_table.shape[1], self.block_size
        need(extent <= self.capacity, "input 'block_table'",
             f"sequence {b} holds {extent} tokens but block_table covers {self.capacity} ({mb} blocks of {bs})")
        return extent

    def bias_rows(self, b: int) -> torch.Tensor | None:
        """attention_bias [B or 1, H or 1, Qc, Kc] -> [H or 1, n, capacity] for sequence b (j < n, k < C)."""
        bias = self.x.get("attention_bias")
        if bias is None:
            return None
        n, extent, capacity = self.csl[b + 1] - self.csl[b], self.extent(b), self.capacity
        qc, kc = bias.shape[2], bias.shape[3]
        need(qc >= n and kc >= extent, "input 'attention_bias'",
             f"capacities (query {qc}, context {kc}) should cover sequence {b}'s {n} queries and {extent} keys")
        rows = bias[b if bias.shape[0] > 1 else 0, :, :n, :capacity].to(self.q.dtype)
        if rows.shape[-1] < capacity:  # positions beyond the bias capacity are beyond the extent: masked
            rows = torch.nn.functional.pad(rows, (0, capacity - rows.shape[-1]))
        return rows

    def finish(self, out: torch.Tensor, qk: torch.Tensor | None, outputs: Sequence[str] | None,
               output_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """out [N, H, Dv] (compute dtype, still V-rotated), qk [H, N, C] or None -> the outputs by name."""
        if self.vside is not None and int(self.attrs["v_rotation"]):
            out = rotate(out)  # H^T == H
        n_tok = self.q.shape[0]
        result = {"output": out.reshape(n_tok, self.num_heads * self.v_head).to(output_dtype or self.t_dtype),
                  "key_cache_out": self.kside.cache}
        if self.vside is not None:
            result["value_cache_out"] = self.vside.cache
        for prefix in ("k", "v"):
            if f"{prefix}_scale_cache" in self.x:
                result[f"{prefix}_scale_cache_out"] = self.x[f"{prefix}_scale_cache"]
        if qk is not None:
            result["output_qk"] = qk.to(torch.float32)
        if outputs is not None:
            result = {name: t for name, t in result.items() if name in set(outputs)}
        return result


def prepare(
    inputs: Mapping[str, Any],
    attributes: Mapping[str, Any],
    outputs: Sequence[str] | None,
    compute_dtype: torch.dtype = torch.float32,
    vectorized_write: bool = False,
    validate: bool = True,
) -> Step:
    """Validate the call, run the prologue and write the step's K/V (and PER_TOKEN scales) into the caches.
    Raises pagedkit.validators.ValidationError listing every contract violation. validate=False skips the
    contract validator (~1 ms a call on CPU) for callers that validated the node already (a session at
    creation); the index guards that keep every read and write inside its tensor stay on."""
    if validate:
        require_valid_inputs(inputs, attributes, op_type="PagedAttention", outputs=outputs)
    a = PAGED_ATTENTION.defaults() | dict(attributes)
    x = {k: as_torch(v) for k, v in inputs.items() if v is not None}
    cdt = compute_dtype

    num_heads, kv_heads = int(a["num_heads"]), int(a["kv_num_heads"])
    latent = a["kv_cache_layout"] == "LATENT"
    query = x["query"]  # [N, H*D] or packed [N, (H + 2*Hkv)*D]
    t_dtype, n_tok, dev = query.dtype, query.shape[0], query.device
    packed = not latent and "key" not in x and "value" not in x
    head_size = query.shape[1] // (num_heads + 2 * kv_heads if packed else num_heads)
    v_head = (int(a["v_head_size"]) or head_size) if latent else head_size  # effective_v_head_size

    q_all = query.to(cdt)
    if packed:
        q, k, v = q_all.split([num_heads * head_size, kv_heads * head_size, kv_heads * head_size], dim=1)
    else:
        q, k = q_all, x["key"].to(cdt)
        v = None if latent else x["value"].to(cdt)
    q = q.reshape(n_tok, num_heads, head_size)  # [N, H, D]
    k = k.reshape(n_tok, kv_heads, head_size)  # [N, Hkv, D]
    v = None if v is None else v.reshape(n_tok, kv_heads, head_size)

    # sequences (host): sequence b owns tokens [csl[b], csl[b+1]); token j of it sits at position past[b] + j
    csl = x["cumulative_sequence_length"].long().tolist()
    past = x["past_seqlens"].long().tolist()
    block_table = x["block_table"].long()  # [B, MB]
    need(len(csl) == len(past) + 1 and csl[-1] == n_tok, "input 'cumulative_sequence_length'",
         f"expected batch_size + 1 = {len(past) + 1} entries ending at token_count {n_tok}, got {csl}")
    q_lens = [csl[b + 1] - csl[b] for b in range(len(past))]
    need(min(q_lens, default=0) >= 0, "input 'cumulative_sequence_length'", f"should be non-decreasing, got {csl}")
    need(min(past, default=0) >= 0, "input 'past_seqlens'", f"entries should be >= 0, got {past}")
    tok_seq = torch.tensor([b for b, n in enumerate(q_lens) for _ in range(n)], dtype=torch.long, device=dev)  # [N]
    pos_list = [p + j for p, n in zip(past, q_lens) for j in range(n)]
    seq_pos = torch.tensor(pos_list, dtype=torch.long, device=dev)  # [N] derived positions
    positions = x["query_positions"].long() if "query_positions" in x else seq_pos  # RoPE + masks

    # 1. prologue: QK-norm -> RoPE -> rotation
    if "q_norm_weight" in x:
        eps = float(a["qk_norm_epsilon"])
        q = rms_norm_heads(q, x["q_norm_weight"].to(cdt), eps)
        k = rms_norm_heads(k, x["k_norm_weight"].to(cdt), eps)
    if int(a["do_rotary"]):
        cos, sin = x["cos_cache"], x["sin_cache"]  # [P, rotary_dim / 2] in T; apply_rope converts the rows it uses
        if "query_positions" in x and n_tok:
            low, top = (int(v) for v in positions.aminmax())
            need(low >= 0, "input 'query_positions'", f"entries should be >= 0, got {low}")
        else:
            top = max((p + n - 1 for p, n in zip(past, q_lens) if n), default=0)
        need(n_tok == 0 or top < cos.shape[0], "input 'cos_cache'",
             f"has {cos.shape[0]} positions, a token needs position {top}")
        inter, offset = bool(int(a["rotary_interleaved"])), int(a["rotary_offset"])
        qk = apply_rope(torch.cat((q, k), dim=1), positions, cos, sin, inter, offset)  # per head: one call
        q, k = qk.split([num_heads, kv_heads], dim=1)
    if int(a["qk_rotation"]):
        q, k = rotate(q), rotate(k)
    if v is not None and int(a["v_rotation"]):
        v = rotate(v)
    q = q.to(t_dtype).to(cdt)  # the prologue's Q is a T tensor

    # 2. cache writes (all tokens of the step before any attention)
    kside = make_side(x, a, "k", kv_heads, head_size, cdt)
    vside = None if latent else make_side(x, a, "v", kv_heads, head_size, cdt)
    slots = _slots(x, block_table, past, q_lens, tok_seq, pos_list, kside.num_blocks, kside.block_size)
    for side, val in ((kside, k), (vside, v)):
        if side is not None:
            write_vectorized(side, slots, val) if vectorized_write else side.write(slots.tolist(), val)
    return Step(a, x, t_dtype, num_heads, kv_heads, head_size, v_head, latent, q, csl, past, block_table,
                positions, kside, vside, slots)


def _slots(x, block_table, past, q_lens, tok_seq, pos_list, num_blocks: int, block_size: int) -> torch.Tensor:
    """Write slot of each token [N] long: slot_mapping, or block_table[b][p // BS] * BS + p % BS (-1: no write)."""
    total = num_blocks * block_size
    if "slot_mapping" in x:
        slots = x["slot_mapping"].long()
        bad = (slots < -1) | (slots >= total)
        if bool(bad.any()):
            need(False, "input 'slot_mapping'",
                 f"entries should be -1 or in [0, {total}), got {slots[bad][:4].tolist()}")
        return slots
    mb = block_table.shape[1]
    for b, (p, n) in enumerate(zip(past, q_lens)):
        need(n == 0 or (p + n - 1) // block_size < mb, "input 'block_table'",
             f"sequence {b} writes position {max(p, mb * block_size)} but has {mb} blocks of {block_size}")
    dev = block_table.device
    cols = torch.tensor([p // block_size for p in pos_list], dtype=torch.long, device=dev)
    offs = torch.tensor([p % block_size for p in pos_list], dtype=torch.long, device=dev)
    blk = block_table[tok_seq, cols]  # [N]
    return torch.where((blk >= 0) & (blk < num_blocks), blk * block_size + offs, torch.full_like(blk, -1))


def write_vectorized(side: PagedCacheSide, slots: torch.Tensor, x: torch.Tensor) -> None:
    """PagedCacheSide.write as one index_copy_: token t of x [N, Hkv, D] goes to flat slot slots[t]; -1 writes
    nothing (nor its scale); of several tokens sharing a slot the last one wins (as the loop)."""
    stored, tok_scale = side.encode(x)  # [N, Hkv, Dc], [N, Hkv] or None
    s, order = torch.sort(slots, stable=True)  # runs of equal slots, tokens in order within a run
    last = torch.ones_like(s, dtype=torch.bool)
    last[:-1] = s[1:] != s[:-1]
    keep = order.masked_select(last & (s >= 0))  # one token per written slot: the latest
    dst = slots.index_select(0, keep)  # distinct flat slots
    raw = _RAW_INT[side.cache.element_size()]  # bit copies (float8 / bfloat16 included)
    targets = [(side.cache.view(raw), stored.view(raw))]
    if tok_scale is not None:
        targets.append((side.scale_cache, tok_scale))
    for cache, rows in targets:  # [NB, BS, ...] <- rows [N, ...]
        if cache.is_contiguous():
            cache.view(-1, *cache.shape[2:]).index_copy_(0, dst, rows.index_select(0, keep))
        else:
            cache.index_put_((dst // side.block_size, dst % side.block_size), rows.index_select(0, keep))
