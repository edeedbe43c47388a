"""The onnxruntime arm: the very same model.onnx under onnxruntime's CUDAExecutionProvider (ORT's own
com.microsoft::PagedAttention kernel, CUDA-only), fed exactly what the engine feeds.

The step inputs come from the engine's own KVCacheManager (`PagedModel.mgr`): its plans write
block_table(s), cumulative_sequence_lengths, past_sequence_lengths, attention_metadata (host) and the
optional slot_mapping / query_positions into persistent buffers, and its cache tensors are bound in
place with IOBinding: every `past_key_values.*` input and the `present.*` output the config pairs it
with share one device buffer (no copies). Inputs the ORT graph does not have are dropped, as the engine
does. The row: the B prompts prefilled (chunked to the engine's token budget), then `decode_steps` greedy
steps (argmax of ORT's own logits), each timed up to `torch.cuda.synchronize()`.

ORT's CUDA graphs (`enable_cuda_graph`) are not tried (a replay needs fixed input addresses and shapes: one
session or graph id per batch shape, host inputs bound once); the JSON records `"cuda_graph": false`.
"""

from __future__ import annotations

import statistics
import time

import torch

from ...interface import dtypes
from ...interface import names as N
from .engine_arm import Row, _sync


def unavailable(device: str) -> str | None:
    """Why the ORT arm cannot run here (None when onnxruntime with CUDA is importable)."""
    if device != "cuda":
        return ("needs --device cuda: onnxruntime's PagedAttention kernel is CUDA-only "
                "(CUDAExecutionProvider; onnxruntime-gpu)")
    try:
        import onnxruntime as ort
    except ImportError:
        return "onnxruntime is not installed (pip install onnxruntime-gpu for its CUDAExecutionProvider)"
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return (f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (providers "
                f"{ort.get_available_providers()}; install onnxruntime-gpu)")
    return None


class OrtRunner:
    """An onnxruntime session on CUDA with IOBinding; `run(feeds, outputs)` binds torch tensors in place."""

    cuda_graph = False

    def __init__(self, model_path: str, host_inputs: set[str]):
        import onnxruntime as ort

        if hasattr(ort, "preload_dlls"):
            ort.preload_dlls()
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        self.session = ort.InferenceSession(model_path, opts, providers=["CUDAExecutionProvider"])
        if self.session.get_providers()[0] != "CUDAExecutionProvider":
            raise RuntimeError(f"onnxruntime placed the model on {self.session.get_providers()}, not CUDA")
        self.input_names = {i.name for i in self.session.get_inputs()}
        self.output_types = {o.name: o.type for o in self.session.get_outputs()}
        self.host_inputs = host_inputs
        self.version = ort.__version__

    def run(self, feeds: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]) -> None:
        binding = self.session.io_binding()
        for name, t in feeds.items():
            host = name in self.host_inputs
            t = t.cpu() if host else t.cuda()
            feeds[name] = t = t.contiguous()  # keep the buffer alive until the run ends
            binding.bind_input(name, "cpu" if host else "cuda", 0, dtypes.elem_type_of_torch(t.dtype),
                               list(t.shape), t.data_ptr())
        for name, t in outputs.items():
            binding.bind_output(name, "cuda", 0, dtypes.elem_type_of_torch(t.dtype), list(t.shape), t.data_ptr())
        torch.cuda.synchronize()  # the plan's buffers are written on torch's stream; ORT runs on its own
        self.session.run_with_iobinding(binding)
        torch.cuda.synchronize()


def step_feeds(pm, runner, plan, token_ids: list[int]) -> tuple[dict, dict]:
    """(inputs, outputs) of one planned step, as PagedModel.run builds them; outputs: the present caches
    (the very tensors of their past inputs) and a fresh logits buffer [T, V]."""
    mgr = pm.mgr
    feeds = pm.feeds(plan, token_ids, runner.input_names)
    outputs = {k: v for k, v in mgr.cache_feeds(present=True).items() if k in runner.output_types}
    logits_type = runner.output_types[pm.logits_name]
    vocab = pm.config.vocab_size
    if vocab is None:
        raise ValueError("genai_config.json has no model.vocab_size (the ORT arm sizes its logits buffer with it)")
    outputs[pm.logits_name] = torch.empty((len(token_ids), vocab), dtype=dtypes.torch_dtype(logits_type),
                                          device=mgr.config.device)
    return feeds, outputs


def _step(pm, runner, batch: list[tuple[str, list[int]]]) -> torch.Tensor:
    """Plan, run and commit one step; the logits [T, V] of its tokens."""
    mgr = pm.mgr
    plan = mgr.plan(batch)
    try:
        feeds, outputs = step_feeds(pm, runner, plan, [t for _, ids in batch for t in ids])
        runner.run(feeds, outputs)
    except BaseException:
        mgr.abort(plan)
        raise
    mgr.commit(plan)
    return outputs[pm.logits_name]


def run_row(pm, runner, row: Row, prompts: list[list[int]], device: str) -> dict:
    """Measure one row with the runner over the engine's KV cache manager (its sequences freed after)."""
    mgr = pm.mgr
    budget = mgr.config.max_num_tokens
    sids = [f"ort-bench-{i}" for i in range(len(prompts))]
    tokens = {s: [] for s in sids}
    try:
        _sync(device)
        t0 = time.perf_counter()
        for s, p in zip(sids, prompts):
            mgr.add_sequence(s, p)
        done = {s: 0 for s in sids}  # prompt tokens cached
        length = {s: len(p) for s, p in zip(sids, prompts)}
        prefill = 0
        while any(done[s] < len(p) for s, p in zip(sids, prompts)):
            batch, left = [], budget
            for s, p in zip(sids, prompts):
                if done[s] < len(p) and left > 0:
                    n = min(left, len(p) - done[s], mgr.max_step_tokens(s))
                    batch.append((s, p[done[s]:done[s] + n]))
                    left -= n
            logits = _step(pm, runner, batch)
            prefill += 1
            end, ready, rows = 0, [], []  # sequences whose prompt is now cached, and their last flat position
            for s, ids in batch:
                end += len(ids)
                done[s] += len(ids)
                if done[s] == length[s]:
                    ready.append(s)
                    rows.append(end - 1)
            if rows:  # one argmax and one copy to the host for the step, not one a sequence
                for s, t in zip(ready, logits[rows].float().argmax(-1).tolist()):
                    tokens[s].append(int(t))
        _sync(device)
        ttft = time.perf_counter() - t0
        times = []
        for _ in range(row.decode_steps):
            s0 = time.perf_counter()
            logits = _step(pm, runner, [(s, [tokens[s][-1]]) for s in sids])
            nxt = logits.float().argmax(-1).tolist()
            _sync(device)
            times.append(time.perf_counter() - s0)
            for s, t in zip(sids, nxt):
                tokens[s].append(int(t))
    finally:
        for s in sids:
            if s in mgr.seqs:
                mgr.free(s)
    total = sum(times)
    return {"ttft_ms": ttft * 1e3, "prefill_steps": prefill, "ms_per_step": statistics.median(times) * 1e3,
            "ms_per_step_mean": total / len(times) * 1e3, "tokens_per_s": row.batch * len(times) / total,
            "decode_tokens": row.batch * len(times), "cuda_graph": getattr(runner, "cuda_graph", False),
            "tokens": [tokens[s] for s in sids]}


def host_input_names(pm) -> set[str]:
    """The host-resident inputs (ORT's OrtMemTypeCPUInput): attention_metadata under its configured name."""
    return {pm.config.input(N.ATTENTION_METADATA)}


def parity(a: list[list[int]], b: list[list[int]], steps: int) -> dict:
    """Greedy tokens of the first `steps` + 1 positions (first token + decode steps) compared per request."""
    n = steps + 1
    bad = [i for i, (x, y) in enumerate(zip(a, b)) if x[:n] != y[:n]]
    first = {i: next(j for j, (p, q) in enumerate(zip(a[i][:n], b[i][:n])) if p != q) for i in bad
             if any(p != q for p, q in zip(a[i][:n], b[i][:n]))}
    return {"compared_tokens": n, "requests": len(a), "mismatched_requests": bad,
            "first_mismatch_position": {str(k): v for k, v in first.items()}, "equal": not bad}
