"""Rotary embeddings: ai.onnx RotaryEmbedding (opset 23) and com.microsoft RotaryEmbedding.

Both rotate the first `rotary_embedding_dim` channels of each head (all by default), either as
halves (x1 = x[:R/2], x2 = x[R/2:R]) or interleaved pairs (x1 = x[0::2], x2 = x[1::2]):
    x1' = x1 cos - x2 sin,  x2' = x1 sin + x2 cos
Computed in the input dtype; position ids are gathered on the device (no host read).
"""

from __future__ import annotations

import torch

from .registry import MS_DOMAIN, register
from .util import opt


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [B, S, N, H]; cos/sin [B or 1, S, R/2] with R <= H. Returns the rotated x [B, S, N, H]."""
    rot = 2 * cos.shape[-1]
    xr, rest = x[..., :rot], x[..., rot:]
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)  # [B, S, 1, R/2]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    else:
        x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
    real, imag = x1 * c - x2 * s, x1 * s + x2 * c
    out = torch.stack((real, imag), dim=-1).flatten(-2) if interleaved else torch.cat((real, imag), dim=-1)
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def _to_bsnh(x: torch.Tensor, num_heads: int, head_size: int, where: str) -> torch.Tensor:
    """3D [B, S, N*H] or 4D [B, N, S, H] input as [B, S, N, H]."""
    if x.dim() == 4:
        return x.transpose(1, 2)
    if x.dim() != 3:
        raise ValueError(f"{where}: input must be 3D [batch, seq, hidden] or 4D [batch, heads, seq, head], "
                         f"got shape {list(x.shape)}")
    if num_heads <= 0 or x.shape[2] % num_heads:
        raise ValueError(f"{where}: hidden size {x.shape[2]} is not a multiple of num_heads={num_heads}")
    return x.reshape(x.shape[0], x.shape[1], num_heads, head_size)


def _from_bsnh(y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return y.transpose(1, 2) if like.dim() == 4 else y.reshape(like.shape)


def _check_rot(rot_dim: int, cos: torch.Tensor, where: str) -> None:
    if rot_dim and cos.shape[-1] * 2 != rot_dim:
        raise ValueError(f"{where}: cos_cache last dimension {cos.shape[-1]} != "
                         f"rotary_embedding_dim / 2 = {rot_dim // 2}")


@register("RotaryEmbedding")
def onnx_rotary(inputs, attrs, ctx):
    x, cos, sin, pos = inputs[0], inputs[1], inputs[2], opt(inputs, 3)
    where = f"RotaryEmbedding node {ctx.node_name!r}"
    num_heads, rot_dim = attrs.get("num_heads", 0), attrs.get("rotary_embedding_dim", 0)
    head_size = x.shape[-1] if x.dim() == 4 else (x.shape[-1] // num_heads if num_heads else 0)
    _check_rot(rot_dim or head_size, cos, where)
    if pos is not None:  # caches [max_pos, R/2] gathered by position ids [B, S]
        cos, sin = cos[pos], sin[pos]
    y = apply_rotary(_to_bsnh(x, num_heads, head_size, where), cos, sin, bool(attrs.get("interleaved", 0)))
    return [_from_bsnh(y, x)]


@register("RotaryEmbedding", domain=MS_DOMAIN)
def ms_rotary(inputs, attrs, ctx):
    x, pos, cos, sin = inputs[0], inputs[1], inputs[2], inputs[3]  # pos [1] (offset) or [B, S]
    where = f"com.microsoft RotaryEmbedding node {ctx.node_name!r}"
    if attrs.get("is_packed_batching", 0):
        raise NotImplementedError(f"{where}: is_packed_batching=1 is not supported")
    num_heads, rot_dim = attrs.get("num_heads", 0), attrs.get("rotary_embedding_dim", 0)
    if x.dim() == 4:
        head_size = x.shape[-1]
    elif num_heads:
        head_size = x.shape[-1] // num_heads
    else:  # full rotation: the cache width gives the head size
        head_size = 2 * cos.shape[-1]
        num_heads = x.shape[-1] // head_size
    _check_rot(rot_dim or head_size, cos, where)
    seq = x.shape[2] if x.dim() == 4 else x.shape[1]
    if pos.numel() == 1:  # one start offset for every batch row
        pos = pos.reshape(1, 1) + torch.arange(seq, device=pos.device).unsqueeze(0)
    y = apply_rotary(_to_bsnh(x, num_heads, head_size, where), cos[pos], sin[pos], bool(attrs.get("interleaved", 0)))
    return [_from_bsnh(y, x)]
