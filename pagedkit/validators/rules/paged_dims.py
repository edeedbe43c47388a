"""PagedAttention problem dims, derived once from whatever a NodeView knows (static or runtime).

Every rule module reads these instead of re-deriving: a dim is an int when known, None when it is
unknown, symbolic, or cannot be derived because an attribute / shape is itself invalid (that issue
is reported by its own rule, so dependent rules stay quiet instead of cascading).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..contract import cache_width
from ..nodeview import NodeView
from .common import dim, dtype_of, first_known, heads, int_attr, int_values, memo_dims, str_attr, valid_attr

SEPARATE, LATENT = "SEPARATE", "LATENT"
UNPACKED, PACKED, LATENT_MODE = "unpacked", "packed", "latent"


def cache_head_size(head_size: int | None, int4: bool) -> int | None:
    """Last cache dim: (head_size + 1) // 2 for packed int4, else head_size (contract.cache_width)."""
    if head_size is None:
        return None
    return cache_width("int4", head_size) if int4 else head_size


@dataclass
class PagedDims:
    nh: int | None  # num_heads (valid: > 0 and divisible by kv_num_heads)
    kv: int | None  # kv_num_heads
    layout: str | None  # "SEPARATE" / "LATENT", None when the attribute is invalid
    mode: str | None  # "unpacked" / "packed" / "latent"; None for an invalid §4.6 presence pattern
    token_count: int | None  # query.shape[0]
    hidden: int | None  # query.shape[1]
    head_size: int | None
    batch_size: int | None  # cumulative_sequence_length.shape[0] - 1
    num_blocks: int | None  # key_cache.shape[0]
    block_size: int | None  # key_cache.shape[1]
    max_blocks: int | None  # block_table.shape[1]
    k_int4: bool
    v_int4: bool
    k_qt: str | None  # valid k_quant_type
    v_qt: str | None
    eff_v: int | None  # effective_v_head_size
    rotary_dim: int | None  # 2 * cos_cache.shape[1]
    t_dtype: str | None  # element type bound to T (query's)
    csl: np.ndarray | None  # [batch_size + 1] values, when known
    past: np.ndarray | None  # [batch_size] values, when known
    q_lens: np.ndarray | None  # [batch_size] csl[b+1] - csl[b], only when csl is well formed

    @property
    def k_cache_head_size(self) -> int | None:
        return cache_head_size(self.head_size, self.k_int4)

    @property
    def v_cache_head_size(self) -> int | None:
        return cache_head_size(self.head_size, self.v_int4)

    @property
    def context_capacity(self) -> int | None:
        """block_table.shape[1] * block_size: the most KV positions a sequence can address."""
        if self.max_blocks is None or self.block_size is None:
            return None
        return self.max_blocks * self.block_size

    @property
    def extents(self) -> np.ndarray | None:
        """past_seqlens[b] + q_len_b, when both are known and sized batch_size."""
        if self.past is None or self.q_lens is None or len(self.past) != len(self.q_lens):
            return None
        return self.past + self.q_lens


def input_mode(view: NodeView, layout: str | None) -> str | None:
    key, value, vcache = view.has("key"), view.has("value"), view.has("value_cache")
    if layout == SEPARATE:
        if key and value and vcache:
            return UNPACKED
        if not key and not value and vcache:
            return PACKED
    elif layout == LATENT and key and not value and not vcache:
        return LATENT_MODE
    return None


def _head_size(view: NodeView, mode, hidden, nh, kv, k_int4, v_int4) -> int | None:
    if hidden is not None and nh is not None and mode is not None:
        div = nh + 2 * kv if mode == PACKED and kv is not None else (nh if mode != PACKED else None)
        if div is None:
            return None
        return hidden // div if hidden % div == 0 else None
    # query width unknown (symbolic) or presence pattern invalid: fall back to other tensors
    key_cache, value_cache, key = view.t("key_cache"), view.t("value_cache"), view.t("key")
    cands = [None if k_int4 else dim(key_cache, 3), None if v_int4 else dim(value_cache, 3)]
    kd = dim(key, 1)
    if mode in (UNPACKED, LATENT_MODE) and kd is not None and kv and kd % kv == 0:
        cands.append(kd // kv)
    return first_known(*cands)


def _csl_q_lens(csl: np.ndarray | None, token_count: int | None) -> np.ndarray | None:
    if csl is None or len(csl) < 2 or csl[0] != 0 or np.any(np.diff(csl) < 0):
        return None
    if token_count is not None and csl[-1] != token_count:
        return None
    return np.diff(csl)


def paged_dims(view: NodeView) -> PagedDims:
    """The derived dims of this view (computed once per view state)."""
    return memo_dims(view, "_paged_dims", _derive)


def _derive(view: NodeView) -> PagedDims:
    nh, kv = heads(view)
    layout = str_attr(view, "kv_cache_layout") if valid_attr(view, "kv_cache_layout") else None
    mode = input_mode(view, layout)
    q = view.t("query")
    hidden = dim(q, 1) if q is not None and q.rank in (None, 2) else None
    k_int4 = str_attr(view, "k_cache_dtype") == "int4"
    v_int4 = str_attr(view, "v_cache_dtype") == "int4"
    head_size = _head_size(view, mode, hidden, nh, kv, k_int4, v_int4)
    if head_size is not None and head_size <= 0:
        head_size = None
    token_count = first_known(dim(q, 0), dim(view.t("key"), 0), dim(view.t("value"), 0))
    csl_t = view.t("cumulative_sequence_length")
    csl_len = dim(csl_t, 0)
    batch_size = first_known(csl_len - 1 if csl_len is not None and csl_len >= 2 else None,
                             dim(view.t("past_seqlens"), 0), dim(view.t("block_table"), 0))
    kc, vc = view.t("key_cache"), view.t("value_cache")
    num_blocks = first_known(dim(kc, 0), dim(vc, 0), dim(view.t("k_scale_cache"), 0))
    block_size = first_known(dim(kc, 1), dim(vc, 1), dim(view.t("k_scale_cache"), 1))
    bt = view.t("block_table")
    max_blocks = dim(bt, 1) if bt is not None and bt.rank in (None, 2) else None
    k_qt = str_attr(view, "k_quant_type") if valid_attr(view, "k_quant_type") else None
    v_qt = str_attr(view, "v_quant_type") if valid_attr(view, "v_quant_type") else None
    vhs = int_attr(view, "v_head_size")
    eff_v = head_size
    if layout == LATENT and vhs is not None and vhs > 0:
        eff_v = vhs
    cos = view.t("cos_cache")
    cos_w = dim(cos, 1) if cos is not None and cos.rank in (None, 2) else None
    rotary_dim = 2 * cos_w if cos_w is not None else None
    t_dtype = dtype_of(q)
    if t_dtype is not None and f"tensor({t_dtype})" not in view.contract.type_constraints["T"]:
        t_dtype = None
    csl = int_values(csl_t)
    past = int_values(view.t("past_seqlens"))
    return PagedDims(nh, kv, layout, mode, token_count, hidden, head_size, batch_size, num_blocks, block_size,
                     max_blocks, k_int4, v_int4, k_qt, v_qt, eff_v, rotary_dim, t_dtype, csl, past,
                     _csl_q_lens(csl, token_count))
