"""The shared attention math of the reference kernels (PagedAttention and GQA use the same functions).

Small and loop-based on purpose: this is the oracle. Every function computes in the dtype of its
inputs; callers pass float32 (or float64 on request).
"""

from __future__ import annotations

import math

import torch


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head RMSNorm over channels. x [N, H, D], weight [D] -> [N, H, D]."""
    inv = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return x * inv * weight.to(x.dtype)


def apply_rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    interleaved: bool,
    offset: int = 0,
) -> torch.Tensor:
    """Rotary embedding on channels [offset, offset + rotary_dim) of every head.

    x [N, H, D]; positions [N] (long); cos_cache / sin_cache [P, rotary_dim / 2].
    Half layout (GPT-NeoX): pairs (c, c + rotary_dim/2). Interleaved (GPT-J): pairs (2c, 2c + 1).
    Channels outside the rotary range are copied through.
    """
    half = cos_cache.shape[1]
    rot = 2 * half
    out = x.clone()
    cos = cos_cache[positions].to(x.dtype)[:, None, :]  # [N, 1, half]
    sin = sin_cache[positions].to(x.dtype)[:, None, :]
    seg = x[..., offset : offset + rot]
    if interleaved:
        a, b = seg[..., 0::2], seg[..., 1::2]
        ra, rb = a * cos - b * sin, b * cos + a * sin
        rotated = torch.stack((ra, rb), dim=-1).flatten(-2)
    else:
        a, b = seg[..., :half], seg[..., half:]
        rotated = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
    out[..., offset : offset + rot] = rotated
    return out


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
    softcap: float = 0.0,
    bias: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
    smooth: bool = False,
    bias_after_softcap: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of one sequence, one query row and one head at a time.

    q [Sq, H, D]; k [Sk, Hkv, D]; v [Sk, Hkv, Dv]; allowed [Sq, Sk] bool (True = key admitted);
    bias [H or 1, Sq, Sk] or None (added after scale, before softcap); sink [H] or None (one extra
    logit in the softmax denominator only); smooth: a zero-valued sink (GQA smooth_softmax);
    bias_after_softcap: add bias after softcap instead (onnxruntime's GQA does, CPU and CUDA).
    Returns out [Sq, H, Dv], scores [H, Sq, Sk] (scaled, biased, soft-capped; 0 where masked) and
    probs [H, Sq, Sk] (0 where masked). A row with no admitted key gets output 0.
    """
    sq, h, _ = q.shape
    sk, hkv, dv = v.shape
    group = h // hkv
    out = torch.zeros(sq, h, dv, dtype=q.dtype, device=q.device)
    scores = torch.zeros(h, sq, sk, dtype=q.dtype, device=q.device)
    probs = torch.zeros(h, sq, sk, dtype=q.dtype, device=q.device)
    for head in range(h):
        kvh = head // group
        for i in range(sq):
            keys = allowed[i].nonzero().flatten()
            s = (k[keys, kvh, :] @ q[i, head, :]) * scale  # [n]
            b = None if bias is None else bias[head if bias.shape[0] > 1 else 0, i, keys]
            if b is not None and not bias_after_softcap:
                s = s + b
            if softcap > 0:
                s = softcap * torch.tanh(s / softcap)
            if b is not None and bias_after_softcap:
                s = s + b
            scores[head, i, keys] = s
            if keys.numel() == 0:
                continue
            extra = None
            if sink is not None:
                extra = sink[head].to(q.dtype)
            elif smooth:
                extra = torch.zeros((), dtype=q.dtype, device=q.device)
            m = s.max() if extra is None else torch.maximum(s.max(), extra)
            e = torch.exp(s - m)
            denom = e.sum() + (0.0 if extra is None else torch.exp(extra - m))
            p = e / denom
            probs[head, i, keys] = p
            out[i, head, :] = p @ v[keys, kvh, :]
    return out, scores, probs


def default_scale(scale: float, head_size: int) -> float:
    """The operators' scale attribute: 0 selects 1/sqrt(head_size)."""
    return float(scale) if scale else 1.0 / math.sqrt(head_size)
