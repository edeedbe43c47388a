"""Constants laid out once in their compute layout (the prepack step of session creation).

A prepack function (registry.prepack) replaces a node's constant input by a `Packed` object: the
weight in the form its kernel reads (transposed, another dtype, a backend's opaque packed layout, int4
nibbles repacked for an int4 matmul kernel), made once at session creation and replacing, not
duplicating, the stored tensor. Implementations test `isinstance(x, Packed)` in the slot they prepack
and call the object; an unpacked tensor in that slot still works (single-node runs, constant folding).

`Packed` is the base; each variant states what it holds (`layout`) so the session can report it
(`InferenceSession.prepacked`).
"""

from __future__ import annotations

import torch


class Packed:
    """A prepacked constant. Subclasses set `layout` (a short description), `shape` / `dtype` of the
    tensor they stand for (the ONNX value's), `nbytes` (memory they hold) and implement their op."""

    layout: str = "packed"
    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32
    nbytes: int = 0
    device: torch.device = torch.device("cpu")

    def describe(self) -> str:
        return f"{self.layout} ({self.nbytes / 2**20:.1f} MiB)"


class PackedLinear(Packed):
    """The B operand of a product y = a @ B (+ bias): `matmul(a)` takes a [..., K] and returns [..., N] in
    `out_dtype` (default a's dtype)."""

    in_features: int = 0  # K
    out_features: int = 0  # N

    def matmul(self, a: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError


RELEASE_BYTES = 64 << 20  # sources at least this large are released while they are transposed
_CHUNK_BYTES = 16 << 20  # rows copied per chunk


def _madvise_dontneed():
    """libc madvise(MADV_DONTNEED) on Linux, else None."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
        fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        return lambda addr, n: fn(addr, n, 4)  # MADV_DONTNEED
    except (OSError, AttributeError):  # pragma: no cover
        return None


def transpose_releasing(src: torch.Tensor, release_min: int = RELEASE_BYTES) -> torch.Tensor:
    """src [K, N] (CPU) -> a contiguous [N, K] copy; when src is large, contiguous and the caller's to give up
    (nobody reads it afterwards), its pages are handed back to the system chunk by chunk as they are copied, so
    the transposition never holds two full copies (session creation's peak memory: the biggest weight, a
    vocabulary projection, would otherwise be held twice while every other weight is loaded). src must not be
    read afterwards (its released pages read as zeros)."""
    if src.T.is_contiguous():
        return src.T  # already [N, K] in memory (a transposed view)
    k, n = src.shape
    row = n * src.element_size()
    release = _madvise_dontneed() if src.is_contiguous() and src.device.type == "cpu" and \
        src.numel() * src.element_size() >= max(release_min, 1) else None
    if release is None:
        return src.T.contiguous()
    import mmap

    page = mmap.PAGESIZE
    dst = torch.empty((n, k), dtype=src.dtype)
    base = src.data_ptr()
    freed = -(-base // page) * page  # first whole page of src not yet released
    step = max(1, _CHUNK_BYTES // row)
    for k0 in range(0, k, step):
        k1 = min(k, k0 + step)
        dst[:, k0:k1].copy_(src[k0:k1].T)
        end = (base + k1 * row) // page * page  # whole pages of the rows copied so far
        if end > freed:
            release(freed, end - freed)
            freed = end
    return dst
