"""Timing shared by the device benchmarks (attention, attention_gqa, cache_write, and probes/: attention_tuning,
prefill_tuning, mla_tuning, ...): `time_graph` warms up on a side stream, captures one call, replays `reps` times
between CUDA events, median over `batches`; `time_wall` / `time_events` time eager calls; `Skip` and `one_line` are
how an arm that does not run a row is recorded."""

from __future__ import annotations

import statistics
import time

import torch


def time_graph(fn, reps: int = 30, batches: int = 5, warmup: int = 3) -> float:
    """Median ms per replay of `fn` captured as one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(batches):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / reps)
    return statistics.median(samples)


class Skip(Exception):
    """An arm that does not run this row (a refusal, a missing module): recorded as skipped, not an error."""


def one_line(exc: BaseException, limit: int = 400) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit // 2] + " ... " + text[-limit // 2:]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_wall(call, reps: int, batches: int, device: torch.device) -> list[float]:
    """ms per call of each batch of reps calls (wall clock, a device sync before and after each batch)."""
    out = []
    for _ in range(batches):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            call()
        sync(device)
        out.append((time.perf_counter() - t0) * 1e3 / reps)
    return out


def time_events(call, reps: int, batches: int) -> list[float]:
    """ms per call of each batch of reps calls between CUDA events on the current stream."""
    out = []
    for _ in range(batches):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            call()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / reps)
    return out
