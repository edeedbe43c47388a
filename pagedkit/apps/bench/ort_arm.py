"""The onnxruntime arm: the very same model.onnx under onnxruntime's CUDAExecutionProvider (ORT's own
com.microsoft::PagedAttention kernel, CUDA-only), fed exactly what the engine feeds.

The step inputs come from the engine's own KVCacheManager (`PagedModel.mgr`): its plans write
block_table(s), cumulative_sequence_lengths, past_sequence_lengths, attention_metadata (host) and the
optional slot_mapping / query_positions into persistent buffers, and its cache tensors are bound in
place with IOBinding: every `past_key_values.*` input and the `present.*` output the config pairs it
with share one device buffer (no copies). Inputs the ORT graph does not have are dropped, as the engine
does. The row: the B prompts prefilled (chunked to the engine's token budget), then `decode_steps` greedy
steps (argmax of ORT's own logits), each timed up to `torch.cuda.synchronize()`. `run_ms`: the median time of
onnxruntime's run alone in those steps (its two synchronizes included; the rest of a step is pagedkit's
planning, the ids' copy and the argmax).

With `cuda_graph=True` the session is created with `enable_cuda_graph=1` (onnxruntime at its best): decode
steps are planned with replay-wide attention_metadata bounds (1, KV bucket, 0; engine/graphs.kv_bucket) and
run with one `gpu_graph_id` per (batch, KV bucket), every input and output bound once to persistent buffers
(input ids and logits copied in / kept per key; the plan's inputs and the caches are persistent already), so
onnxruntime captures at a key's first run and replays afterwards; prefill steps run with `gpu_graph_id` -1
(no graph). If onnxruntime refuses the graph mode (at creation or at a run), the arm falls back to plain runs
and the JSON says why (`cuda_graph_refused`).
"""

from __future__ import annotations

import statistics
import time

import torch

from ...interface import dtypes
from ...interface import names as N
from ...engine.graphs import kv_bucket
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
    """An onnxruntime session on CUDA with IOBinding; `run(feeds, outputs)` binds torch tensors in place;
    with cuda_graph, `run(..., graph_key=k)` replays onnxruntime's CUDA graph of key k (module doc)."""

    def __init__(self, model_path: str, host_inputs: set[str], cuda_graph: bool = False):
        import onnxruntime as ort

        if hasattr(ort, "preload_dlls"):
            ort.preload_dlls()
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        cuda = ("CUDAExecutionProvider", {"enable_cuda_graph": "1"}) if cuda_graph else "CUDAExecutionProvider"
        self.session = ort.InferenceSession(model_path, opts, providers=[cuda])
        self.cuda_graph = self.graph_session = cuda_graph
        self.graph_refused: str | None = None
        self._graphs: dict = {}  # key -> (binding, run options, kept tensors, their data pointers)
        self.kept: dict = {}  # key -> (input ids, logits): the persistent buffers a key's graph binds (_step)
        self._ort = ort
        if self.session.get_providers()[0] != "CUDAExecutionProvider":
            raise RuntimeError(f"onnxruntime placed the model on {self.session.get_providers()}, not CUDA")
        self.input_names = {i.name for i in self.session.get_inputs()}
        self.output_types = {o.name: o.type for o in self.session.get_outputs()}
        self.host_inputs = host_inputs
        self.version = ort.__version__

    def _bind(self, feeds: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]):
        binding = self.session.io_binding()
        for name, t in feeds.items():
            host = name in self.host_inputs
            t = t.cpu() if host else t.cuda()
            feeds[name] = t = t.contiguous()  # keep the buffer alive until the run ends
            binding.bind_input(name, "cpu" if host else "cuda", 0, dtypes.elem_type_of_torch(t.dtype),
                               list(t.shape), t.data_ptr())
        for name, t in outputs.items():
            binding.bind_output(name, "cuda", 0, dtypes.elem_type_of_torch(t.dtype), list(t.shape), t.data_ptr())
        return binding

    def run(self, feeds: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor], graph_key=None) -> None:
        if self.cuda_graph and graph_key is not None:
            try:
                return self._run_graph(feeds, outputs, graph_key)
            except Exception as exc:  # onnxruntime refuses its graph for this model: plain runs from now on
                self.graph_refused = f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:500]
                self.cuda_graph = False
        binding = self._bind(feeds, outputs)
        ro = None
        if self.graph_session:  # a graph-enabled session runs without a graph only under gpu_graph_id -1
            ro = self._ort.RunOptions()
            ro.add_run_config_entry("gpu_graph_id", "-1")
        self._run(binding, ro)

    def _run_graph(self, feeds, outputs, key) -> None:
        g = self._graphs.get(key)
        ptrs = {n: t.data_ptr() for n, t in (feeds | outputs).items()}
        if g is None:
            ro = self._ort.RunOptions()
            ro.add_run_config_entry("gpu_graph_id", str(len(self._graphs) + 1))
            g = self._graphs[key] = (self._bind(feeds, outputs), ro, (feeds, outputs), ptrs)
        elif g[3] != ptrs:
            raise RuntimeError(f"ORT CUDA graph {key}: an input or output moved between steps")
        self._run(g[0], g[1])

    def _run(self, binding, ro) -> None:
        torch.cuda.synchronize()  # the plan's buffers are written on torch's stream; ORT runs on its own
        if ro is None:
            self.session.run_with_iobinding(binding)
        else:
            self.session.run_with_iobinding(binding, ro)
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


def _step(pm, runner, batch: list[tuple[str, list[int]]], persistent: dict | None = None,
          run_times: list | None = None) -> torch.Tensor:
    """Plan, run and commit one step; the logits [T, V] of its tokens. persistent (a decode step under
    onnxruntime's CUDA graph): replay-wide bounds, input ids and logits in buffers kept per graph key.
    run_times: the seconds runner.run took (its synchronizes included) are appended."""
    mgr = pm.mgr
    ids = [t for _, tokens in batch for t in tokens]
    key = None
    if persistent is not None:
        key = (len(batch), kv_bucket(max(mgr.length(s) + 1 for s, _ in batch), mgr.config.max_seq_len))
    plan = mgr.plan(batch, bounds=(1, key[1], 0)) if key else mgr.plan(batch)
    try:
        feeds, outputs = step_feeds(pm, runner, plan, ids)
        if key is not None:
            kept = persistent.get(key)
            if kept is None:
                kept = persistent[key] = (feeds[pm.input_ids_name].clone(), outputs[pm.logits_name])
            kept[0].copy_(feeds[pm.input_ids_name])
            feeds[pm.input_ids_name], outputs[pm.logits_name] = kept
        t0 = time.perf_counter()
        if key is not None:
            runner.run(feeds, outputs, graph_key=key)
        else:
            runner.run(feeds, outputs)
        if run_times is not None:
            run_times.append(time.perf_counter() - t0)
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
        times, run_times = [], []
        # decode steps under onnxruntime's CUDA graph: input ids / logits buffers kept with the runner, whose
        # graphs replay them (the same buffers in every row of a key)
        persistent = runner.kept if getattr(runner, "cuda_graph", False) else None
        for _ in range(row.decode_steps):
            s0 = time.perf_counter()
            logits = _step(pm, runner, [(s, [tokens[s][-1]]) for s in sids], persistent, run_times)
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
            "run_ms": statistics.median(run_times) * 1e3,
            "cuda_graph_refused": getattr(runner, "graph_refused", None),
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
