"""First-prompt prefill through torch's fused attention (variant "sdpa_prefill"): triton_paged's cache-write
prologue, then the attention on cuDNN's (else FlashAttention-2's) fused kernel when the host-side bounds prove
the step is a batch of equal-length first prompts; otherwise triton_paged's split-KV attention.

Chosen by dispatch for the plan hint "prefill" only (no sequence has a cached prefix: the engine's plan knows
it). Per call, from host facts only: with N query tokens, B sequences and attention_metadata's bounds
(max_query_len M, max_kv_len K, both upper bounds), N == B * M and 0 < K <= M prove that every sequence
has exactly M new tokens and no cached prefix (sum of B lengths <= M is N = B * M only if each is M; a
context of M new tokens fits K <= M only with no past). Then the keys a query sees are exactly the step's
own, written by the prologue: K / V are gathered back from the cache through the block table
([B, ceil(M / BS)] blocks of [BS, Hkv, D] -> [B, Hkv, M, D] views) and Q [N, H, D] -> [B, H, M, D], and
one `scaled_dot_product_attention` call (GQA through enable_gqa, causal or bidirectional, the node's scale)
computes [B, H, M, D] -> output [N, H*D]. Whatever the bounds do not prove runs on triton_paged.

The proof rests on the bounds being bounds. The call also checks on the device (no host read) that
cumulative_sequence_length is 0, M, 2M, ..., past_seqlens all 0 and every block the prompts cover is mapped;
a call breaking any of it returns NaN rows for the whole step instead of a silently different result
(triton_paged, the default for a mixed step, serves such inputs). Those step facts (the gather indices and the
check) depend only on the step's block_table / cumulative_sequence_length / past_seqlens, which every layer of
a run shares: they are computed once per run scope (kernels/scope.py `memo`), not per layer.

`LAST_ROUTE` names what the last call ran: "cudnn", "flash", "math" (a CPU tensor: tests through Triton's
interpreter) or "triton_paged" (the bounds did not prove the shape); PAGEDKIT_KERNEL_DEBUG=1 prints the route
the first time each one runs. Serves float16 / bfloat16 caches in T, SEPARATE layout, RoPE / QK-norm / packed
QKV / slot_mapping (the prologue's), causal or not. Refuses what the fused kernels lack: softcap, windows,
sinks, bias, output_qk, query_positions, quantized caches, Hadamard rotation, LATENT.
"""

from __future__ import annotations

import sys
from typing import Any, Mapping, Sequence

import torch

from ... import settings
from ..attention_math import default_scale
from ..scope import memo
from ..variant import KernelVariant
from . import common, paged

NAME = "sdpa_prefill"
MAX_HEAD_SIZE = 256  # FlashAttention-2's and cuDNN's forward limit
# fused backends in order of preference (torch.nn.attention.SDPBackend names): on a causal 4 x 4096 (32 / 8 heads,
# head 128) on the H200 cuDNN reached 511-532 TFLOP/s, FlashAttention-2 314-322 (attention_prefill.json)
BACKENDS = ("CUDNN_ATTENTION", "FLASH_ATTENTION")
LAST_ROUTE: str | None = None
_backend_for: dict[tuple, str] = {}  # (dtype, head size, causal, gqa) -> the first backend that accepted it
_reported: set[str] = set()


def _supports(info: Any) -> str | None:
    if not common.HAVE_TRITON:
        return "triton is not installed (pip install 'pagedkit[gpu]')"
    if info.layout == "LATENT":
        return "kv_cache_layout LATENT (serves SEPARATE)"
    if info.head_size is not None and info.head_size > MAX_HEAD_SIZE:
        return f"head_size {info.head_size} > {MAX_HEAD_SIZE}"
    for side, fmt in (("key_cache", info.k_cache_format), ("value_cache", info.v_cache_format)):
        if fmt is not None and info.t_dtype is not None and fmt != info.t_dtype:
            return f"{side} {fmt} with T {info.t_dtype} (serves float caches in T)"
    return None


VARIANT = KernelVariant(
    name=NAME,
    op="PagedAttention",
    entry=f"{__name__}:paged_attention",
    devices=("cuda",),
    dtypes=("float16", "bfloat16"),
    capturable=True,
    features=("packed_qkv", "rotary", "qk_norm", "non_causal", "slot_mapping", "attention_metadata"),
    supports=_supports,
    plans=("prefill",),
    description="First prompts (plan prefill): triton_paged's cache-write prologue, then torch's fused attention "
                "(cuDNN, else FlashAttention-2) on the prompts gathered from the cache, when attention_metadata "
                "proves equal lengths and no cached prefix; otherwise triton_paged's attention. Reports the route "
                "(sdpa_prefill.LAST_ROUTE).",
    limits=f"float caches in T, SEPARATE layout, head_size <= {MAX_HEAD_SIZE}; needs triton",
)


def uniform_prompt_len(num_tokens: int, batch: int, max_q: int, max_kv: int) -> int | None:
    """M when the bounds prove `batch` first prompts of exactly M tokens each (see the module doc), else None."""
    if batch <= 0 or max_q <= 0 or num_tokens != batch * max_q or not 0 < max_kv <= max_q:
        return None
    return max_q


def _route(note: str) -> None:
    global LAST_ROUTE
    LAST_ROUTE = note
    if note not in _reported and settings.read("PAGEDKIT_KERNEL_DEBUG"):
        _reported.add(note)
        print(f"pagedkit: sdpa_prefill route={note}", file=sys.stderr)


def fused_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
               causal: bool) -> tuple[torch.Tensor | None, str]:
    """[B, H, M, D] x [B, Hkv, M, D] -> ([B, H, M, D], route) on the first fused backend that takes the call
    ("cudnn", "flash"; "math" for CPU tensors), or (None, why) when none does (the caller then runs the Triton
    attention; the refusal is remembered per dtype / head size / causal / GQA, so it is probed once). Also
    triton_gqa's first-prompt route (gqa.py)."""
    import torch.nn.functional as F

    gqa = q.shape[1] != k.shape[1]
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa), "math"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    key = (q.dtype, q.shape[-1], causal, gqa)
    if key in _backend_for and _backend_for[key] is None:
        return None, "no fused SDPA backend takes the call"
    tried = [_backend_for[key]] if key in _backend_for else list(BACKENDS)
    errors = []
    for name in tried:
        try:
            with sdpa_kernel([getattr(SDPBackend, name)]):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
        except RuntimeError as exc:  # the backend refuses the shape / device / build
            errors.append(f"{name}: {' '.join(str(exc).split())[:200]}")
            continue
        _backend_for[key] = name
        return out, "cudnn" if name == "CUDNN_ATTENTION" else "flash"
    _backend_for[key] = None
    return None, "no fused SDPA backend takes the call (" + "; ".join(errors) + ")"


def paged_attention(inputs: Mapping[str, Any], *, outputs: Sequence[str] | None = None, validate: bool = True,
                    **attributes: Any) -> dict[str, torch.Tensor]:
    """com.microsoft::PagedAttention for first prompts; same results as the reference (see the module doc)."""
    p = paged.prepare(inputs, attributes, outputs=outputs, validate=validate)
    refusal = _refuse_call(p)
    if refusal:
        raise NotImplementedError(f"sdpa_prefill: {refusal}")
    x = p.x
    cu, table, kc, vc = x["cumulative_sequence_length"], x["block_table"], x["key_cache"], x["value_cache"]
    n, batch = x["query"].shape[0], cu.shape[0] - 1
    m = uniform_prompt_len(n, batch, p.max_q, p.max_kv)
    bs = kc.shape[1]
    nblk = -(-m // bs) if m else 0
    q = paged.write(p)  # [N, H, D]
    if m is None or nblk > table.shape[1]:
        _route("triton_paged")
        return paged.results(p, *paged.attend(p, q), outputs)
    past = x["past_seqlens"]
    key = (NAME, id(table), id(cu), id(past), kc.shape[0], nblk, m)
    ids, bad = memo(key, lambda: _step_facts(table, cu, past, kc.shape[0], nblk, m))
    # the prompts' blocks [B * nblk, BS, Hkv, D] (one gather a cache), their first M positions as [B, Hkv, M, D]
    # views; q [N, H, D] as [B, H, M, D]: one as_strided each (the view reshape / slice / transpose make)
    hkv, d = p.hkv, p.d
    kv_shape, kv_strides = (batch, hkv, m, d), (nblk * bs * hkv * d, d, hkv * d, 1)
    k = torch.index_select(kc, 0, ids).as_strided(kv_shape, kv_strides)
    v = torch.index_select(vc, 0, ids).as_strided(kv_shape, kv_strides)
    qd = q.as_strided((batch, p.nh, m, d), (m * p.nh * d, d, p.nh * d, 1))
    o, route = fused_sdpa(qd, k, v, scale=default_scale(float(p.a["scale"]), p.d),
                          causal=bool(int(p.a["is_causal"])))
    if o is None:  # no fused backend on this GPU / build: the Triton attention
        _route("triton_paged")
        return paged.results(p, *paged.attend(p, q), outputs)
    _route(route)
    out = o.transpose(1, 2).reshape(n, p.nh * p.d)  # a new tensor (or o itself: nobody else holds it)
    out.masked_fill_(bad, float("nan"))  # a step the bounds misdescribe: NaN rows (module docstring)
    return paged.results(p, out, None, outputs)


def _step_facts(table: torch.Tensor, cu: torch.Tensor, past: torch.Tensor, nb_phys: int, nblk: int,
                m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gather indices [B * nblk] int64 clamped into the pool, sequence-major, and `bad` bool []) of a step of B
    first prompts of m tokens: bad is a device bool (no host read), true unless cumulative_sequence_length is 0,
    m, 2m, ..., past_seqlens all 0 and every block the prompts cover is mapped."""
    ids = table[:, :nblk]  # [B, nblk]
    mapped = ((ids >= 0) & (ids < nb_phys)).all()
    steps = torch.arange(cu.shape[0], device=cu.device, dtype=cu.dtype) * m
    bad = ~(mapped & (cu == steps).all() & (past == 0).all())
    return ids.clamp(0, nb_phys - 1).long().reshape(-1), bad


def _refuse_call(p: paged.Prepared) -> str | None:
    """What the static refusal (features, supports) already excludes, checked again for direct calls."""
    a, x = p.a, p.x
    checks = (
        (p.latent, "kv_cache_layout LATENT"),
        (p.kf.fmt != common.FMT_FLOAT or (p.vf is not None and p.vf.fmt != common.FMT_FLOAT), "a quantized cache"),
        (x["key_cache"].dtype != x["query"].dtype, "a cache not in T"),
        (float(a["softcap"]) > 0, "softcap"),
        (int(a["local_window_size"]) > 0, "local_window_size"),
        (bool(int(a["qk_rotation"])) or bool(int(a["v_rotation"])), "Hadamard rotation"),
        (p.qk_output != 0, "output_qk"),
        ("head_sink" in x, "head_sink"),
        ("attention_bias" in x, "attention_bias"),
        ("query_positions" in x, "query_positions"),
        (p.d > MAX_HEAD_SIZE, f"head_size {p.d} > {MAX_HEAD_SIZE}"),
    )
    return next((why for bad, why in checks if bad), None)
