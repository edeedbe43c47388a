"""CUDA-graph timing shared by the device benchmarks (attention_tuning, prefill_tuning, mla_tuning, cache_write):
warm up on a side stream, capture one call, replay `reps` times between CUDA events, median over `batches`."""

from __future__ import annotations

import statistics

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
