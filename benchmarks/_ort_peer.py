"""onnxruntime, the peer of the device benchmarks (attention.py, attention_gqa.py): one place for the import
(after torch, preload_dlls: ../shared/tools/ort-gpu.md), the session (CUDAExecutionProvider, optionally with
its CUDA graph; the CPU provider for --dry-run), the IOBinding of torch tensors by data pointer (host tensors
such as attention_metadata / total_sequence_length stay CPU inputs; outputs bound to given buffers, e.g. the
caches) and the unsynchronized timed run. Failures raise `Unavailable` with a one-line reason."""

from __future__ import annotations

import functools
from typing import Callable

import torch


class Unavailable(Exception):
    """onnxruntime cannot run this arm (not installed, no CUDA provider, refuses the model or the run)."""


def _line(exc: BaseException, limit: int = 400) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit // 2] + " ... " + text[-limit // 2:]


@functools.cache
def module(device_type: str):
    try:
        import onnxruntime as ort  # after torch (ort-gpu.md)
    except ImportError as exc:
        raise Unavailable(f"onnxruntime does not import: {_line(exc)}") from None
    if device_type == "cuda":
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise Unavailable(f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (needs onnxruntime-gpu)")
        if hasattr(ort, "preload_dlls"):
            ort.preload_dlls()
    return ort


def bound_call(model, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor], device: torch.device,
               graph: bool) -> Callable[[], None]:
    """A session of the one-node `model` with every input and output bound; the returned call runs it once
    without ORT's per-run device sync (run option disable_synchronize_execution_providers=1)."""
    from pagedkit.validators.nodeview import onnx_dtype_of

    ort = module(device.type)
    try:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        providers = ([("CUDAExecutionProvider", {"device_id": str(device.index or 0)}
                       | ({"enable_cuda_graph": "1"} if graph else {}))] if device.type == "cuda"
                     else ["CPUExecutionProvider"])
        sess = ort.InferenceSession(model.SerializeToString(), so, providers=providers)
    except Exception as exc:  # noqa: BLE001 - a refusal
        raise Unavailable(f"session: {_line(exc)}") from None
    if device.type == "cuda" and sess.get_providers()[0] != "CUDAExecutionProvider":
        raise Unavailable(f"the session runs on {sess.get_providers()}")
    binding = sess.io_binding()
    for name, t in inputs.items():
        binding.bind_input(name, "cuda" if t.is_cuda else "cpu", t.device.index or 0, onnx_dtype_of(t),
                           list(t.shape), t.data_ptr())
    for name, t in outputs.items():
        binding.bind_output(name, t.device.type, t.device.index or 0, onnx_dtype_of(t), list(t.shape), t.data_ptr())
    ro = ort.RunOptions()
    ro.add_run_config_entry("disable_synchronize_execution_providers", "1")

    def call():
        sess.run_with_iobinding(binding, ro)

    call.session, call.binding = sess, binding  # kept alive with the call
    return call


def time_runs(call: Callable[[], None], device: torch.device, graph: bool, *, warmup: int, replays: int,
              batches: int) -> list[float]:
    """Warm-up runs (ORT: a regular run, then the capture, then replays), then ms per run of each batch of
    `replays` unsynchronized runs, wall clock with a device sync around each batch."""
    from _timing import sync, time_wall

    try:
        sync(device)
        for _ in range(max(warmup, 3)):
            call()
        sync(device)
        return time_wall(call, replays, batches, device)
    except Exception as exc:  # noqa: BLE001 - a refusal at run time
        raise Unavailable(f"run{' (CUDA graph)' if graph else ''}: {_line(exc)}") from None
