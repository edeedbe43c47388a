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
