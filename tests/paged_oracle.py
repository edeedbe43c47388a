"""Test-side PagedAttention cases and independent float64 oracles (no pagedkit import): PagedAttention
(`oracle`, shared by the reference tests) and GroupQueryAttention (`gqa_oracle`, a per-query-row loop, used
by tests/test_gqa_oracle.py).

The PagedAttention oracle never pages and never loops per query row: it keeps each sequence's context as one contiguous
float64 tensor [L, Hkv, D] (the cached past, dequantized, followed by the step's new tokens fake-quantized
with its own numpy quantizer) and evaluates dense masked attention, cross-checked against torch SDPA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
import torch
import torch.nn.functional as F

QMAX = {"int8": 127.0, "float8e4m3fn": 448.0, "int4": 7.0}
STORE = {"int8": torch.int8, "float8e4m3fn": torch.float8_e4m3fn, "int4": torch.uint8}


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max|got - ref| / max|ref| (norm-relative), both taken in float64."""
    got, ref = got.double(), ref.double()
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------------
# the test's own quantizer (numpy float64) and math
# ---------------------------------------------------------------------------------------------


def np_encode(x: np.ndarray, fmt: str | None, scale: np.ndarray | float, cache_dtype=torch.float16):
    """x [..., D] float64 -> (stored torch tensor in cache form, dequantized float64 numpy)."""
    if fmt is None:
        stored = torch.from_numpy(x).to(cache_dtype)
        return stored, stored.double().numpy()
    r = np.divide(x, scale)
    if fmt == "float8e4m3fn":
        c = np.clip(r, -448, 448).astype(ml_dtypes.float8_e4m3fn)
        stored = torch.from_numpy(c.view(np.uint8).copy()).view(torch.float8_e4m3fn)
        return stored, c.astype(np.float64) * scale
    lo, hi = (-128, 127) if fmt == "int8" else (-8, 7)
    c = np.clip(np.rint(r), lo, hi)
    deq = c * scale
    if fmt == "int8":
        return torch.from_numpy(c.astype(np.int8)), deq
    nib = (c + 8).astype(np.uint8)
    return torch.from_numpy((nib[..., 0::2] | (nib[..., 1::2] << 4)).astype(np.uint8)), deq


def np_token_scale(x: np.ndarray, fmt: str, scale_dtype) -> np.ndarray:
    """PER_TOKEN scale [..., 1]: amax / qmax rounded to the scale-cache dtype; amax 0 -> 1."""
    amax = np.abs(x).max(axis=-1, keepdims=True)
    s = np.where(amax > 0, amax / QMAX[fmt], 1.0)
    return torch.from_numpy(s).to(scale_dtype).double().numpy()


def walsh_hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64), h)
    return h / math.sqrt(n)


def rope64(x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
           offset: int) -> torch.Tensor:
    """x [N, H, D] float64; rotate channels [offset, offset + 2 * cos.shape[1])."""
    half = cos.shape[1]
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]
    seg = x[..., offset:offset + 2 * half]
    if interleaved:
        z = torch.view_as_complex(seg.reshape(*seg.shape[:-1], half, 2).contiguous())
        rot = torch.view_as_real(z * torch.complex(c, s)).flatten(-2)
    else:
        x1, x2 = seg[..., :half], seg[..., half:]
        rot = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    out = x.clone()
    out[..., offset:offset + 2 * half] = rot
    return out


# ---------------------------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------------------------


@dataclass
class Spec:
    q_lens: list[int]
    past: list[int]
    num_heads: int = 4
    kv_num_heads: int = 2
    head_size: int = 16
    block_size: int = 16
    dtype: torch.dtype = torch.float16
    cache: str = "same"  # "same" (cache dtype T), "int8", "float8e4m3fn", "int4"
    k_quant: str = "NONE"
    v_quant: str = "NONE"
    scale_cache_dtype: torch.dtype = torch.float16
    packed: bool = False
    latent: bool = False
    v_head_size: int = 0
    rotary: str | None = None  # None, "half", "interleaved"
    rotary_dim: int | None = None
    rotary_offset: int = 0
    qk_norm: bool = False
    sink: bool = False
    bias: tuple[bool, bool] | None = None  # (per batch, per head)
    query_positions: list[int] | None = None
    extra_cols: int = 1
    unmapped: tuple = ()  # (b, logical block) entries of block_table set to -1 (past-only blocks)
    attrs: dict = field(default_factory=dict)
    seed: int = 0


@dataclass
class Case:
    spec: Spec
    inputs: dict
    attrs: dict
    ctx_k: list  # per sequence: float64 [past_b, Hkv, D] as the cache holds it (dequantized)
    ctx_v: list


def _fmt(spec: Spec) -> str | None:
    return None if spec.cache == "same" else spec.cache


def _static_scale(g: torch.Generator, quant: str, hkv: int, d: int):
    if quant == "PER_TENSOR":
        return torch.tensor([0.02 + 0.01 * float(torch.rand(1, generator=g))], dtype=torch.float32)
    if quant == "PER_CHANNEL":
        return (0.01 + 0.03 * torch.rand(hkv, 1, d, generator=g)).float()
    return None


def build(spec: Spec) -> Case:
    g = torch.Generator().manual_seed(spec.seed)
    h, hkv, d, bs = spec.num_heads, spec.kv_num_heads, spec.head_size, spec.block_size
    b_count, n_tok = len(spec.q_lens), sum(spec.q_lens)
    lens = [p + q for p, q in zip(spec.past, spec.q_lens)]
    need = [max(1, -(-L // bs)) for L in lens]
    mb = max(need) + spec.extra_cols
    nb = sum(need) + 3
    perm = torch.randperm(nb, generator=g).tolist()  # shuffled physical blocks
    table = torch.full((b_count, mb), -1, dtype=torch.int32)
    for b in range(b_count):
        for i in range(need[b]):
            table[b, i] = perm.pop()
    fmt = _fmt(spec)
    cache_dt = spec.dtype if fmt is None else STORE[fmt]
    dc = d // 2 if fmt == "int4" else d
    rand = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    x = {}
    q_width = h * d
    if spec.packed:
        x["query"] = rand(n_tok, (h + 2 * hkv) * d).to(spec.dtype)
    else:
        x["query"] = rand(n_tok, q_width).to(spec.dtype)
        x["key"] = rand(n_tok, hkv * d).to(spec.dtype)
        if not spec.latent:
            x["value"] = rand(n_tok, hkv * d).to(spec.dtype)

    def garbage():
        if fmt is None:
            return rand(nb, bs, hkv, d).to(cache_dt)
        if fmt == "float8e4m3fn":
            return (rand(nb, bs, hkv, d) * 3).to(cache_dt)
        lo, hi = (-128, 128) if fmt == "int8" else (0, 256)
        return torch.randint(lo, hi, (nb, bs, hkv, dc), generator=g).to(cache_dt)

    sides = ["k"] if spec.latent else ["k", "v"]
    ctx = {"k": [], "v": []}
    for side in sides:
        quant = spec.k_quant if side == "k" else spec.v_quant
        cache = garbage()
        scale = _static_scale(g, quant, hkv, d)
        if scale is not None:
            x[f"{side}_scale"] = scale
        scache = None
        if quant == "PER_TOKEN":
            scache = (0.05 + torch.rand(nb, bs, hkv, generator=g)).to(spec.scale_cache_dtype)
            x[f"{side}_scale_cache"] = scache
        for b in range(b_count):
            vals = rand(spec.past[b], hkv, d).numpy() * 1.5
            if quant == "PER_TOKEN":
                s = np_token_scale(vals, fmt, spec.scale_cache_dtype)
            elif scale is not None:
                s = scale.double().reshape(-1, d).numpy() if quant == "PER_CHANNEL" else float(scale)
            else:
                s = 1.0
            stored, deq = np_encode(vals, fmt, s, cache_dt)
            for p in range(spec.past[b]):
                blk = int(table[b, p // bs])
                cache[blk, p % bs] = stored[p]
                if scache is not None:
                    scache[blk, p % bs] = torch.from_numpy(s[p, :, 0]).to(scache.dtype)
            ctx[side].append(torch.from_numpy(deq))
        x["key_cache" if side == "k" else "value_cache"] = cache
    for b, i in spec.unmapped:
        table[b, i] = -1
    x["cumulative_sequence_length"] = torch.tensor([0] + list(np.cumsum(spec.q_lens)), dtype=torch.int32)
    x["past_seqlens"] = torch.tensor(spec.past, dtype=torch.int32)
    x["block_table"] = table
    attrs = {"num_heads": h, "kv_num_heads": hkv}
    if fmt is not None:
        attrs["k_quant_type"] = spec.k_quant
        if not spec.latent:
            attrs["v_quant_type"] = spec.v_quant
        if fmt == "int4":
            attrs["k_cache_dtype"] = "int4"
            if not spec.latent:
                attrs["v_cache_dtype"] = "int4"
    if spec.latent:
        attrs.update(kv_cache_layout="LATENT", v_head_size=spec.v_head_size or d)
    if spec.rotary:
        rdim = spec.rotary_dim or (d - spec.rotary_offset)
        max_pos = max(lens + [p + 1 for p in (spec.query_positions or [])]) + 4
        theta = torch.arange(max_pos, dtype=torch.float64)[:, None] / (
            10000 ** (torch.arange(rdim // 2, dtype=torch.float64) / (rdim // 2)))
        x["cos_cache"], x["sin_cache"] = theta.cos().to(spec.dtype), theta.sin().to(spec.dtype)
        attrs.update(do_rotary=1, rotary_interleaved=int(spec.rotary == "interleaved"))
        if spec.rotary_offset:
            attrs["rotary_offset"] = spec.rotary_offset
    if spec.qk_norm:
        x["q_norm_weight"] = (1 + 0.3 * rand(d)).to(spec.dtype)
        x["k_norm_weight"] = (1 + 0.3 * rand(d)).to(spec.dtype)
    if spec.sink:
        x["head_sink"] = (rand(h) * 2).to(spec.dtype)
    if spec.bias is not None:
        per_b, per_h = spec.bias
        x["attention_bias"] = rand(b_count if per_b else 1, h if per_h else 1,
                                   max(spec.q_lens) + 1, max(lens) + 3).to(spec.dtype)
    if spec.query_positions is not None:
        x["query_positions"] = torch.tensor(spec.query_positions, dtype=torch.int32)
    attrs.update(spec.attrs)
    return Case(spec, x, attrs, ctx["k"], ctx["v"])


def clone_inputs(inputs: dict) -> dict:
    return {k: v.clone() for k, v in inputs.items()}


# ---------------------------------------------------------------------------------------------
# the oracle
# ---------------------------------------------------------------------------------------------


def oracle(case: Case) -> dict:
    """float64 expected outputs: output [N, H * Dv], output_qk [H, N, C] (scores or probs per
    attrs["qk_output"]), and k_new / v_new [N, Hkv, D]: the step's new K/V as the cache should hold them
    (dequantized), plus k_scale_new / v_scale_new [N, Hkv] for PER_TOKEN."""
    sp, x, a = case.spec, case.inputs, case.attrs
    h, hkv, d, bs = sp.num_heads, sp.kv_num_heads, sp.head_size, sp.block_size
    n_tok = x["query"].shape[0]
    q_all = x["query"].double()
    if sp.packed:
        q, k, v = q_all[:, :h * d], q_all[:, h * d:(h + hkv) * d], q_all[:, (h + hkv) * d:]
    else:
        q, k, v = q_all, x["key"].double(), x["value"].double() if "value" in x else None
    q, k = q.reshape(n_tok, h, d), k.reshape(n_tok, hkv, d)
    v = None if v is None else v.reshape(n_tok, hkv, d)
    csl = x["cumulative_sequence_length"].tolist()
    derived = torch.cat([torch.arange(p, p + n) for p, n in zip(sp.past, sp.q_lens)]).long()
    pos = x["query_positions"].long() if "query_positions" in x else derived
    if "q_norm_weight" in x:
        eps = a.get("qk_norm_epsilon", 1e-6)
        q = q / torch.sqrt((q * q).mean(-1, keepdim=True) + eps) * x["q_norm_weight"].double()
        k = k / torch.sqrt((k * k).mean(-1, keepdim=True) + eps) * x["k_norm_weight"].double()
    if a.get("do_rotary"):
        cos, sin = x["cos_cache"].double(), x["sin_cache"].double()
        inter, off = bool(a.get("rotary_interleaved")), a.get("rotary_offset", 0)
        q, k = rope64(q, pos, cos, sin, inter, off), rope64(k, pos, cos, sin, inter, off)
    if a.get("qk_rotation"):
        hm = walsh_hadamard(d)
        q, k = q @ hm, k @ hm
    if v is not None and a.get("v_rotation"):
        v = v @ walsh_hadamard(d)
    q = q.to(sp.dtype).double()  # the op holds the prologue's Q as T
    fmt = _fmt(sp)
    cache_dt = sp.dtype if fmt is None else STORE[fmt]
    res = {}

    def as_cached(t, side):
        quant = sp.k_quant if side == "k" else sp.v_quant
        arr = t.numpy()
        if quant == "PER_TOKEN":
            s = np_token_scale(arr, fmt, sp.scale_cache_dtype)
            res[f"{side}_scale_new"] = torch.from_numpy(s[..., 0])
        elif quant == "PER_CHANNEL":
            s = x[f"{side}_scale"].double().reshape(hkv, d).numpy()
        elif quant == "PER_TENSOR":
            s = float(x[f"{side}_scale"])
        else:
            s = 1.0
        return torch.from_numpy(np_encode(arr, fmt, s, cache_dt)[1])

    k_new = as_cached(k, "k")
    v_new = None if v is None else as_cached(v, "v")
    res["k_new"], res["v_new"] = k_new, v_new
    dv = (a.get("v_head_size") or d) if sp.latent else d
    scale = a.get("scale") or 1 / math.sqrt(d)
    softcap, window = a.get("softcap", 0.0), a.get("local_window_size", -1)
    causal, qk_mode = a.get("is_causal", 1), a.get("qk_output", 0)
    table = x["block_table"]
    capacity = table.shape[1] * bs
    out = torch.zeros(n_tok, h, dv, dtype=torch.float64)
    qk = torch.zeros(h, n_tok, capacity, dtype=torch.float64)
    group = h // hkv
    for b, (t0, t1) in enumerate(zip(csl[:-1], csl[1:])):
        n, length = t1 - t0, sp.past[b] + t1 - t0
        if n == 0:
            continue
        kk = torch.cat((case.ctx_k[b], k_new[t0:t1]))  # [L, Hkv, D]
        vv = kk[..., :dv] if sp.latent else torch.cat((case.ctx_v[b], v_new[t0:t1]))
        kk, vv = kk.repeat_interleave(group, dim=1), vv.repeat_interleave(group, dim=1)  # [L, H, *]
        kp = torch.arange(length)[None, :]
        qp = pos[t0:t1, None]
        ok = (table[b].long()[kp // bs] >= 0).expand(n, length).clone()
        if causal:
            ok &= kp <= qp
        if window > 0:
            ok &= kp >= qp - window + 1
        logits = torch.einsum("nhd,lhd->hnl", q[t0:t1], kk) * scale
        bias_rows = None
        if "attention_bias" in x:
            bias = x["attention_bias"].double()
            bias_rows = bias[b if bias.shape[0] > 1 else 0, :, :n, :length].expand(h, n, length)
            logits = logits + bias_rows
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        masked = logits.masked_fill(~ok, -math.inf)
        if "head_sink" in x:
            sink = x["head_sink"].double()[:, None, None].expand(h, n, 1)
            probs = torch.softmax(torch.cat((masked, sink), dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(masked, dim=-1)
        probs = torch.nan_to_num(probs, nan=0.0)  # a row with no admitted key attends to nothing
        o = torch.einsum("hnl,lhd->nhd", probs, vv)
        if not softcap and bool(ok.any(-1).all()):
            o_sdpa = _sdpa(q[t0:t1], kk, vv, ok, bias_rows, x.get("head_sink"), scale)
            assert float((o_sdpa - o).abs().max()) <= 1e-9 * float(o.abs().max()) + 1e-12, "oracle self-check"
        out[t0:t1] = o
        qk[:, t0:t1, :length] = torch.where(ok, logits, 0.0) if qk_mode == 1 else probs
    if v is not None and a.get("v_rotation"):
        out = out @ walsh_hadamard(d).T
    res["output"] = out.reshape(n_tok, h * dv)
    res["output_qk"] = qk
    return res


def _sdpa(q, kk, vv, ok, bias_rows, sink, scale):
    """Same attention through torch SDPA: mask/bias as a float attn_mask; a sink is one extra key of zeros
    (score 0) whose mask entry is the sink logit, with a zero value row."""
    n, h, _ = q.shape
    qh, kh, vh = q.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1)  # [H, n, D], [H, L, D]
    mask = torch.zeros(h, n, kh.shape[1], dtype=torch.float64) if bias_rows is None else bias_rows.clone()
    mask = mask.masked_fill(~ok, -math.inf)
    if sink is not None:
        kh = torch.cat((kh, torch.zeros(h, 1, kh.shape[-1], dtype=torch.float64)), dim=1)
        vh = torch.cat((vh, torch.zeros(h, 1, vh.shape[-1], dtype=torch.float64)), dim=1)
        mask = torch.cat((mask, sink.double()[:, None, None].expand(h, n, 1)), dim=-1)
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return o.transpose(0, 1)


# ---------------------------------------------------------------------------------------------
# GroupQueryAttention oracle (float64, loops; shares no code with pagedkit)
# ---------------------------------------------------------------------------------------------


def gqa_resident(t: int, capacity: int, window: int) -> int:
    """Positions a sliding-window cache of `capacity` rows holds after t tokens, by simulating it token by
    token: appending to a full buffer first drops all but the newest window - 1 positions (ORT 1.32.0)."""
    held = 0
    for _ in range(t):
        if held == capacity:
            held = window - 1
        held += 1
    return held


def _f64(t) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        return t.detach().cpu().to(torch.float64).numpy()
    return np.asarray(t, np.float64)


def _gqa_decode(stored: torch.Tensor, fmt: str | None, scale) -> np.ndarray:
    """Cache rows [..., Dc] -> float64 values [..., D]: codes (int4: low nibble first, minus 8) x scale."""
    if fmt == "int4":
        raw = stored.numpy().astype(np.int64)
        codes = np.stack((raw & 15, raw >> 4), axis=-1).reshape(*raw.shape[:-1], 2 * raw.shape[-1]) - 8
        return codes.astype(np.float64) * scale
    return _f64(stored) * scale


def _gqa_encode(x: np.ndarray, fmt: str | None, scale, cache_dtype) -> np.ndarray:
    """float64 values -> float64 values as the cache holds them (rounded to the cache dtype, or quantized:
    int clamp(rint(x / scale)), fp8 E4M3 clamp +-448, then times the scale)."""
    if fmt is None:
        return torch.from_numpy(x).to(cache_dtype).double().numpy()
    r = x / scale
    if fmt == "float8e4m3fn":
        return np.clip(r, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * scale
    lo, hi = (-128, 127) if fmt == "int8" else (-8, 7)
    return np.clip(np.rint(r), lo, hi) * scale


def _rope_np(x: np.ndarray, pos: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> np.ndarray:
    """x [N, H, D]; rotate channels [0, 2 * cos.shape[1]), pair by pair, one channel pair at a time."""
    out = x.copy()
    half = cos.shape[1]
    for i in range(half):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
        c, s = cos[pos, i][:, None], sin[pos, i][:, None]
        out[:, :, a] = x[:, :, a] * c - x[:, :, b] * s
        out[:, :, b] = x[:, :, b] * c + x[:, :, a] * s
    return out


def gqa_oracle(inputs: dict, attrs: dict) -> dict:
    """Expected GroupQueryAttention results (onnxruntime 1.32.0 semantics, contract-decisions §4 / §6),
    float64: "output" [B, S, H*D], "output_qk" [B, H, S, total] (qk_output != 0) and "present_key" /
    "present_value" [B, Hkv, C, D] as values (quantized caches: dequantized), NaN wherever the operator
    leaves a value unspecified (padded query rows, cache rows beyond the resident ones).

    Per batch entry b: T = seqlens_k[b] + 1 tokens after the step, Q = query_seqlens[b] (default
    min(S, T)) valid query rows, P = T - Q; query row s sits at position P + s (masks); RoPE at
    position_ids[b, s] when given (a first prompt, S == total without query_seqlens: position_ids[0, 0] + s).
    QK-norm (q_norm_epsilon / k_norm_epsilon, else qk_norm_epsilon) before RoPE; the new K/V go through the
    cache (rounded to its dtype or quantized) before they are attended to; softcap, then attention_bias;
    head_sink (or, without it, smooth_softmax's zero logit) joins the softmax denominator only."""
    a = {"scale": 0.0, "softcap": 0.0, "local_window_size": -1, "do_rotary": 0, "rotary_interleaved": 0,
         "causal": 1, "sliding_window_cache": 0, "smooth_softmax": -1, "qk_output": 0, "qk_norm_epsilon": 1e-6,
         "q_norm_epsilon": None, "k_norm_epsilon": None, "k_quant_type": "NONE", "v_quant_type": "NONE", **attrs}
    x = {k: v for k, v in inputs.items() if v is not None}
    h, hkv = int(a["num_heads"]), int(a["kv_num_heads"])
    query = _f64(x["query"])
    t_dtype = x["query"].dtype
    bsz, s_len, width = query.shape
    packed = "key" not in x
    d = width // (h + 2 * hkv) if packed else width // h
    if packed:
        q, k, v = query[..., :h * d], query[..., h * d:(h + hkv) * d], query[..., (h + hkv) * d:]
    else:
        q, k, v = query, _f64(x["key"]), _f64(x["value"])
    q = q.reshape(bsz, s_len, h, d)
    kv_rows = k.shape[1]  # 0: shared KV (nothing appended)
    k, v = k.reshape(bsz, kv_rows, hkv, d), v.reshape(bsz, kv_rows, hkv, d)
    total = int(np.asarray(x["total_sequence_length"]).reshape(-1)[0])
    t_all = np.asarray(x["seqlens_k"]).astype(np.int64) + 1
    q_all = (np.asarray(x["query_seqlens"]).astype(np.int64) if "query_seqlens" in x
             else np.minimum(t_all, s_len))

    if "q_norm_weight" in x:
        eq = a["q_norm_epsilon"] if a["q_norm_epsilon"] is not None else a["qk_norm_epsilon"]
        ek = a["k_norm_epsilon"] if a["k_norm_epsilon"] is not None else a["qk_norm_epsilon"]
        q = q / np.sqrt((q ** 2).mean(-1, keepdims=True) + eq) * _f64(x["q_norm_weight"])
        if kv_rows:
            k = k / np.sqrt((k ** 2).mean(-1, keepdims=True) + ek) * _f64(x["k_norm_weight"])

    windowed = bool(a["sliding_window_cache"])
    window = int(a["local_window_size"])
    past_cap = x["past_key"].shape[2] if "past_key" in x else 0
    cap = (past_cap if "past_key" in x else max(window, total)) if windowed else max(past_cap, total)
    sides = {}
    for side, past_name, scale_name, qt in (("k", "past_key", "k_scale", a["k_quant_type"]),
                                            ("v", "past_value", "v_scale", a["v_quant_type"])):
        past = x.get(past_name)
        if qt == "NONE":
            fmt, scale = None, 1.0
            cache_dtype = past.dtype if past is not None else t_dtype
        else:
            cache_dtype = past.dtype if past is not None else (torch.uint8 if a["kv_cache_bit_width"] == 4 else torch.int8)
            fmt = {torch.int8: "int8", torch.uint8: "int4", torch.float8_e4m3fn: "float8e4m3fn"}[cache_dtype]
            sc = _f64(x[scale_name])
            scale = float(sc.reshape(-1)[0]) if qt == "PER_TENSOR" else sc.reshape(hkv, d)  # per channel: [Hkv, D]
        sides[side] = (past, fmt, scale, cache_dtype)

    out = np.full((bsz, s_len, h, d), np.nan)
    qk = np.full((bsz, h, s_len, total), np.nan) if a["qk_output"] else None
    present = {side: np.full((bsz, hkv, cap, d), np.nan) for side in sides}
    cos = _f64(x["cos_cache"]) if a["do_rotary"] else None
    sin = _f64(x["sin_cache"]) if a["do_rotary"] else None
    first_prompt = "query_seqlens" not in x and s_len == total
    scale_qk = a["scale"] or 1.0 / math.sqrt(d)
    for b in range(bsz):
        t, n = int(t_all[b]), int(q_all[b])
        p = t - n  # position of query row 0
        cached = t - n if kv_rows else t  # positions the past holds (shared KV: all T)
        qb = q[b, :n].copy()
        kb, vb = k[b, :n].copy(), v[b, :n].copy()
        if a["do_rotary"]:
            if "position_ids" in x:
                pid = np.asarray(x["position_ids"]).astype(np.int64)
                pos = pid[0, 0] + np.arange(n) if first_prompt else pid[b, :n]
            else:
                pos = p + np.arange(n)
            rot = 2 * cos.shape[1]
            qb[..., :rot] = _rope_np(qb[..., :rot], pos, cos, sin, bool(a["rotary_interleaved"]))
            if kv_rows:
                kb[..., :rot] = _rope_np(kb[..., :rot], pos, cos, sin, bool(a["rotary_interleaved"]))
        # every position the step can read, as the cache holds it: {position: [Hkv, D]} per side
        held = {}
        for side, new in (("k", kb), ("v", vb)):
            past, fmt, scale, cache_dtype = sides[side]
            rows = {}
            if past is not None:
                resident = gqa_resident(cached, past_cap, window) if windowed else cached
                stored = _gqa_decode(past[b].transpose(0, 1), fmt, scale)  # [C, Hkv, D]
                for i in range(resident):
                    rows[cached - resident + i] = stored[i]  # row i holds position P - L(P) + i
            if kv_rows:
                enc = _gqa_encode(new, fmt, scale, cache_dtype)
                for i in range(n):
                    rows[p + i] = enc[i]
            held[side] = rows
            after = gqa_resident(t, cap, window) if windowed else t
            for i in range(after):
                present[side][b, :, i] = rows[t - after + i]
        for s in range(n):
            qpos = p + s
            keys = [kp for kp in sorted(held["k"]) if kp < t and (not a["causal"] or kp <= qpos)
                    and (window <= 0 or kp >= qpos - window + 1)]
            if qk is not None:
                qk[b, :, s, :] = 0.0
            for hh in range(h):
                g = hh // (h // hkv)
                logits = np.array([scale_qk * float(np.dot(qb[s, hh], held["k"][kp][g])) for kp in keys])
                if a["softcap"] > 0:
                    logits = a["softcap"] * np.tanh(logits / a["softcap"])
                if "attention_bias" in x:
                    bias = _f64(x["attention_bias"])
                    logits = logits + np.array([bias[b if bias.shape[0] > 1 else 0, hh if bias.shape[1] > 1 else 0,
                                                     s, kp] for kp in keys])
                extra = []
                if "head_sink" in x:
                    extra = [float(_f64(x["head_sink"])[hh])]
                elif int(a["smooth_softmax"]) == 1:
                    extra = [0.0]
                if not keys:
                    out[b, s, hh] = 0.0
                    continue
                m = max(list(logits) + extra)
                e = np.exp(logits - m)
                probs = e / (e.sum() + sum(math.exp(z - m) for z in extra))
                out[b, s, hh] = sum(pr * held["v"][kp][g] for pr, kp in zip(probs, keys))
                if qk is not None:
                    qk[b, hh, s, keys] = logits if int(a["qk_output"]) == 1 else probs
    res = {"output": out.reshape(bsz, s_len, h * d), "present_key": present["k"], "present_value": present["v"]}
    if qk is not None:
        res["output_qk"] = qk
    return res
