"""Initializers written straight to external data files, in row chunks, as they are evaluated (streaming export).

`ExternalData(first_file, max_shard_bytes)` appends each tensor's bytes to the current data file and returns the
TensorProto that points at them (location / offset / length; no data in the proto). A lazy initializer larger
than CHUNK_BYTES is written CHUNK_BYTES of rows at a time, each chunk evaluated through `slicing.narrow` (only
the checkpoint rows it needs are read); the bytes are exactly those `graph.tensor_proto` would hold. The file
writes run on one writer thread, at most PENDING chunks behind, so that evaluating the next chunk (reading a
checkpoint, drawing random weights, transposing) overlaps writing the last one. With
`max_shard_bytes`, a tensor that would take the current file past it starts the next file: `model.onnx.data`,
`model.onnx.data.1`, `model.onnx.data.2`, ... (ONNX keeps a location per tensor; a tensor is never split).
"""

from __future__ import annotations

import math
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import onnx
import torch

from ..interface import dtypes
from . import slicing
from .lazy import LazyTensor, materialize

CHUNK_BYTES = 64 << 20
PENDING = 2  # chunks handed to the writer thread and not yet written, at most


def parse_size(text: str | int | None) -> int | None:
    """'4GB' / '512MB' / '1.5GiB' / a byte count -> bytes; None, '', 'off', '0' -> None (one file)."""
    if text is None or isinstance(text, int):
        return text or None
    t = str(text).strip().lower().replace(" ", "")
    if t in ("", "off", "none", "0"):
        return None
    units = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000 ** 2, "mb": 1000 ** 2, "mib": 1024 ** 2,
             "g": 1000 ** 3, "gb": 1000 ** 3, "gib": 1024 ** 3, "t": 1000 ** 4, "tb": 1000 ** 4, "tib": 1024 ** 4}
    num = t.rstrip("kmgtib")
    unit = t[len(num):]
    try:
        if unit not in units or not num:
            raise ValueError
        value = int(float(num) * units[unit])
    except ValueError:
        raise ValueError(f"size {text!r}: expected a number with an optional unit (B, KB, MB, GB, TB, KiB, ...)"
                         ) from None
    if value <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return value


def shard_name(first: str, k: int) -> str:
    return first if k == 0 else f"{first}.{k}"


def data_files(model_path: Path) -> list[Path]:
    """The external data files of an export beside `model_path` (model.onnx.data, model.onnx.data.1, ...)."""
    first = model_path.with_name(model_path.name + ".data")
    out, k = [], 0
    while (p := first.with_name(shard_name(first.name, k))).exists():
        out.append(p)
        k += 1
    return out


def remove_data_files(model_path: Path) -> None:
    for p in data_files(model_path):
        p.unlink()


def _bytes_of(t: torch.Tensor, dtype: torch.dtype) -> memoryview:
    t = t.detach().to("cpu").to(dtype).contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


class ExternalData:
    """The writer (module doc). Use as a context manager, or close()."""

    def __init__(self, first: Path, max_shard_bytes: int | None = None):
        self.first, self.max = Path(first), max_shard_bytes
        self.files: list[Path] = []
        self._sink = None
        self._pos = 0  # bytes handed to the current file
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="pagedkit-write")
        self._pending: deque[Future] = deque()
        self._open(0)

    def _drain(self, keep: int = 0) -> None:
        """Wait until at most `keep` writes are pending (a failed write raises here)."""
        while len(self._pending) > keep:
            self._pending.popleft().result()

    def _put(self, data: memoryview) -> int:
        self._drain(PENDING - 1)
        self._pending.append(self._writer.submit(self._sink.write, data))  # data keeps its tensor alive
        self._pos += len(data)
        return len(data)

    def _open(self, k: int) -> None:
        self._drain()
        if self._sink is not None:
            self._sink.close()
        path = self.first.with_name(shard_name(self.first.name, k))
        self.files.append(path)
        self._sink = open(path, "wb")
        self._pos = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        try:
            self._drain()
        finally:
            self._pending.clear()
            self._writer.shutdown(wait=True)
            if self._sink is not None:
                self._sink.close()
                self._sink = None

    def write(self, name: str, value, elem_type: int) -> onnx.TensorProto:
        """Write one initializer; returns its TensorProto (external)."""
        dtype = dtypes.torch_dtype(elem_type)
        shape = [int(d) for d in value.shape]
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        pos = self._pos
        if self.max is not None and pos and pos + size > self.max:
            self._open(len(self.files))
            pos = 0
        try:
            if isinstance(value, LazyTensor) and size > CHUNK_BYTES and len(shape) >= 1 and shape[0] > 1:
                step = max(1, CHUNK_BYTES // (size // shape[0]))
                for a in range(0, shape[0], step):
                    self._put(_bytes_of(slicing.narrow(value, 0, a, min(shape[0], a + step)), dtype))
                    slicing.end_chunk()
            else:
                self._put(_bytes_of(torch.as_tensor(materialize(value)), dtype))
        finally:
            slicing.clear()  # what this initializer's evaluation kept (tensors read whole for slicing)
        written = self._pos - pos
        if written != size:
            raise RuntimeError(f"{name}: wrote {written} bytes, expected {size}")
        proto = onnx.TensorProto()
        proto.name, proto.data_type = name, elem_type
        proto.dims.extend(shape)
        proto.data_location = onnx.TensorProto.EXTERNAL
        for k, v in (("location", self.files[-1].name), ("offset", str(pos)), ("length", str(size))):
            entry = proto.external_data.add()
            entry.key, entry.value = k, v
        return proto
