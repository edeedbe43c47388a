"""The Triton PagedAttention kernels as `torch.library` custom ops, with fake (meta) implementations, so
torch.compile / export see them as opaque ops with known output shapes and the cache mutation declared:

- `pagedkit::write_kv`     -> q [N, H, D] (T); mutates key_cache, value_cache, k/v_scale_cache in place;
- `pagedkit::paged_decode` -> (output [N, H*Dv] (T), output_qk [H, N, C] float32, or [0] when qk_output 0).

Cache side formats travel as ints (common.FMT_* / SCALE_*; -1 = no V side, LATENT).
`torch.library.opcheck` runs over both (tests/test_triton_paged.py).

`write_kv` / `paged_decode` (the callers' entry points) run the op's implementation directly on a plain eager
call (`eager_call`: no tracing, no Python dispatch mode, plain tensors without autograd): the dispatcher's
custom-op path adds nothing there but host time (on the H200 a prefill's `pagedkit::write_kv` took 266 us of
host time a call, most of it the dispatch, for a ~14 us launch). Anything else goes through the op.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import common


def eager_call(tensors) -> bool:
    """Whether a call may run an op's implementation without the dispatcher: not inside torch.compile's tracing,
    no Python dispatch mode active (FakeTensorMode, make_fx's proxy mode, a TorchDispatchMode), and every tensor
    a plain torch.Tensor (no FakeTensor / FunctionalTensor / other subclass) that does not require grad."""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    return all(t is None or (type(t) is Tensor and not t.requires_grad) for t in tensors)


def _side(fmt: int, scale: int) -> common.SideFormat | None:
    return None if fmt < 0 else common.SideFormat(fmt, scale)


def _write_kv_impl(query: Tensor, key: Optional[Tensor], value: Optional[Tensor], cumulative_sequence_length: Tensor,
                   past_seqlens: Tensor, block_table: Tensor, key_cache: Tensor, value_cache: Optional[Tensor],
                   slot_mapping: Optional[Tensor], query_positions: Optional[Tensor], cos_cache: Optional[Tensor],
                   sin_cache: Optional[Tensor], q_norm_weight: Optional[Tensor], k_norm_weight: Optional[Tensor],
                   k_scale: Optional[Tensor], v_scale: Optional[Tensor], k_scale_cache: Optional[Tensor],
                   v_scale_cache: Optional[Tensor], num_heads: int, kv_num_heads: int, head_size: int, k_fmt: int,
                   k_scale_mode: int, v_fmt: int, v_scale_mode: int, rotary: bool, rotary_interleaved: bool,
                   rotary_offset: int, qk_norm_epsilon: float, qk_rotation: bool, v_rotation: bool,
                   latent: bool, unique_slots: bool = False, k_norm_epsilon: float = -1.0) -> Tensor:
    from .cache_write import write_kv

    return write_kv(
        query, key, value, num_heads=num_heads, kv_num_heads=kv_num_heads, head_size=head_size,
        cumulative_sequence_length=cumulative_sequence_length, past_seqlens=past_seqlens, block_table=block_table,
        key_cache=key_cache, value_cache=value_cache, k_format=_side(k_fmt, k_scale_mode),
        v_format=_side(v_fmt, v_scale_mode), slot_mapping=slot_mapping, query_positions=query_positions,
        cos_cache=cos_cache if rotary else None, sin_cache=sin_cache if rotary else None,
        rotary_interleaved=rotary_interleaved, rotary_offset=rotary_offset, q_norm_weight=q_norm_weight,
        k_norm_weight=k_norm_weight, qk_norm_epsilon=qk_norm_epsilon, qk_rotation=qk_rotation,
        v_rotation=v_rotation, k_scale=k_scale, v_scale=v_scale, k_scale_cache=k_scale_cache,
        v_scale_cache=v_scale_cache, latent=latent, unique_slots=unique_slots,
        k_norm_epsilon=None if k_norm_epsilon < 0 else k_norm_epsilon)


_write_kv = torch.library.custom_op("pagedkit::write_kv", mutates_args=(
    "key_cache", "value_cache", "k_scale_cache", "v_scale_cache"))(_write_kv_impl)


@_write_kv.register_fake
def _write_kv_fake(query, key, value, cumulative_sequence_length, past_seqlens, block_table, key_cache, value_cache,
                   slot_mapping, query_positions, cos_cache, sin_cache, q_norm_weight, k_norm_weight, k_scale,
                   v_scale, k_scale_cache, v_scale_cache, num_heads, kv_num_heads, head_size, k_fmt, k_scale_mode,
                   v_fmt, v_scale_mode, rotary, rotary_interleaved, rotary_offset, qk_norm_epsilon, qk_rotation,
                   v_rotation, latent, unique_slots=False, k_norm_epsilon=-1.0):
    return query.new_empty((query.shape[0], num_heads, head_size))


def _paged_decode_impl(q: Tensor, key_cache: Tensor, value_cache: Optional[Tensor], cumulative_sequence_length: Tensor,
                       past_seqlens: Tensor, block_table: Tensor, k_scale: Optional[Tensor], v_scale: Optional[Tensor],
                       k_scale_cache: Optional[Tensor], v_scale_cache: Optional[Tensor],
                       query_positions: Optional[Tensor], head_sink: Optional[Tensor],
                       attention_bias: Optional[Tensor], k_fmt: int, k_scale_mode: int, v_fmt: int, v_scale_mode: int,
                       num_heads: int, kv_num_heads: int, head_size: int, v_head_size: int, scale: float,
                       softcap: float, local_window_size: int, is_causal: bool, qk_output: int, v_rotation: bool,
                       max_query_len: int, max_kv_len: int, fused_mla: bool = False, bnsh: bool = False,
                       row_pad: int = 0, bias_after_softcap: bool = False) -> tuple[Tensor, Tensor]:
    if fused_mla:  # variant triton_mla (LATENT): the fused kernel (mla_decode.py), no output_qk
        from .mla_decode import mla_decode

        if (value_cache is not None or softcap > 0 or attention_bias is not None or qk_output
                or head_sink is not None):
            raise NotImplementedError("triton_mla: LATENT without softcap, attention_bias, output_qk or head_sink")
        out = mla_decode(
            q, key_cache=key_cache, k_format=_side(k_fmt, k_scale_mode),
            cumulative_sequence_length=cumulative_sequence_length, past_seqlens=past_seqlens,
            block_table=block_table, num_heads=num_heads, head_size=head_size,
            v_head_size=v_head_size, scale=scale, k_scale=k_scale, k_scale_cache=k_scale_cache,
            query_positions=query_positions, local_window_size=local_window_size, is_causal=is_causal,
            max_query_len=max_query_len, max_kv_len=max_kv_len)
        return out, torch.empty(0, dtype=torch.float32, device=q.device)
    from .decode import paged_decode

    out, qk = paged_decode(
        q, key_cache=key_cache, value_cache=value_cache, k_format=_side(k_fmt, k_scale_mode),
        v_format=_side(v_fmt, v_scale_mode), cumulative_sequence_length=cumulative_sequence_length,
        past_seqlens=past_seqlens, block_table=block_table, num_heads=num_heads, kv_num_heads=kv_num_heads,
        head_size=head_size, v_head_size=v_head_size, scale=scale, k_scale=k_scale, v_scale=v_scale,
        k_scale_cache=k_scale_cache, v_scale_cache=v_scale_cache, query_positions=query_positions,
        softcap=softcap, local_window_size=local_window_size, is_causal=is_causal, head_sink=head_sink,
        attention_bias=attention_bias, qk_output=qk_output, v_rotation=v_rotation, max_query_len=max_query_len,
        max_kv_len=max_kv_len, bnsh=bnsh, row_pad=row_pad, bias_after_softcap=bias_after_softcap)
    if qk is None:
        qk = torch.empty(0, dtype=torch.float32, device=q.device)
    return out, qk


_paged_decode = torch.library.custom_op("pagedkit::paged_decode", mutates_args=())(_paged_decode_impl)


@_paged_decode.register_fake
def _paged_decode_fake(q, key_cache, value_cache, cumulative_sequence_length, past_seqlens, block_table, k_scale,
                       v_scale, k_scale_cache, v_scale_cache, query_positions, head_sink, attention_bias, k_fmt,
                       k_scale_mode, v_fmt, v_scale_mode, num_heads, kv_num_heads, head_size, v_head_size, scale,
                       softcap, local_window_size, is_causal, qk_output, v_rotation, max_query_len, max_kv_len,
                       fused_mla=False, bnsh=False, row_pad=0, bias_after_softcap=False):
    n = q.shape[0]
    out = q.new_empty((n, num_heads * v_head_size))
    if qk_output:
        if bnsh:
            from .decode import bnsh_capacity

            width = bnsh_capacity(key_cache.shape[2])
        else:
            width = block_table.shape[1] * key_cache.shape[1]
        qk = q.new_empty((num_heads, n, width), dtype=torch.float32)
    else:
        qk = q.new_empty((0,), dtype=torch.float32)
    return out, qk


def write_kv(query, key, value, csl, past, block_table, key_cache, value_cache, slot_mapping, query_positions,
             cos_cache, sin_cache, q_norm_weight, k_norm_weight, k_scale, v_scale, k_scale_cache, v_scale_cache,
             **kw) -> Tensor:
    """pagedkit::write_kv (positional tensors in the op's order, attributes by keyword); a plain eager call runs
    its implementation directly (module docstring)."""
    args = (query, key, value, csl, past, block_table, key_cache, value_cache, slot_mapping, query_positions,
            cos_cache, sin_cache, q_norm_weight, k_norm_weight, k_scale, v_scale, k_scale_cache, v_scale_cache)
    if eager_call(args):
        return _write_kv_impl(*args, **kw)
    return torch.ops.pagedkit.write_kv(*args, **kw)


def paged_decode(q, key_cache, value_cache, csl, past, block_table, k_scale, v_scale, k_scale_cache,
                 v_scale_cache, query_positions, head_sink, attention_bias, **kw) -> tuple[Tensor, Tensor | None]:
    """pagedkit::paged_decode; output_qk None when qk_output is 0. A plain eager call runs its implementation
    directly (module docstring)."""
    args = (q, key_cache, value_cache, csl, past, block_table, k_scale, v_scale, k_scale_cache, v_scale_cache,
            query_positions, head_sink, attention_bias)
    if eager_call(args):
        out, qk = _paged_decode_impl(*args, **kw)
    else:
        out, qk = torch.ops.pagedkit.paged_decode(*args, **kw)
    return out, (qk if kw.get("qk_output") else None)
