"""Host work of an eager prefill step (the H200 trace at e1b092d: time to first token was host-bound, 27 ms of host
time against ~5 ms of GPU kernels at 991 tokens), pinned on the CPU so that a regression fails:

- the torch ops one `sdpa_prefill` layer issues (a counting TorchDispatchMode over the layers of one run scope):
  the step facts (gather indices, the device-side check of what the bounds promise) once per run, not per layer;
  per layer the cache write, two gathers, three views, the attention, the output copy and its NaN mask;
- `ops.write_kv` / `ops.paged_decode` run the implementation directly on a plain eager call (the custom op's
  dispatch took most of the 266 us a `pagedkit::write_kv` call cost on the H200 host), the custom op otherwise
  (a dispatch mode, fake tensors, autograd), with the same bits either way;
- the attention node's outputs already on the session's device are not moved (`cuda:0` against a session device
  `cuda`: three no-op `aten::to` a layer before);
- the session's operand placement returns the operands untouched when they are all on the device;
- benchmarks/probes/prefill_host.py's trace summary (top-level ops, gaps, kernels) on a synthetic trace.
Teeth: source mutants (tests/mutants.py) with the facts back per layer, the write through the dispatcher, and the
device comparison of before each fail their check."""

from __future__ import annotations

import collections
import os
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mutants import mutant
from paged_oracle import Spec, build, clone_inputs

triton = pytest.importorskip("triton") if not os.environ.get("CI") else __import__("triton")  # CI: never skip

from pagedkit.kernels import dispatch, scope  # noqa: E402
from pagedkit.kernels.triton import ops, sdpa_prefill  # noqa: E402

LAYERS = 4
# per layer: pagedkit::write_kv, index_select x 2 (K, V), as_strided x 3 (K, V, q views), the attention (stubbed
# here: one empty), o's transpose + the copy of its reshape (clone + _unsafe_view), masked_fill_ (the NaN rows)
OPS_PER_LAYER = {"write_kv": 1, "index_select": 2, "as_strided": 3, "empty": 1, "transpose": 1, "clone": 1,
                 "_unsafe_view": 1, "masked_fill_": 1}


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _step_inputs(m=20, b=2):
    """One prefill step's inputs for LAYERS layers: the shared step tensors (same objects), a cache pair each."""
    spec = Spec(q_lens=[m] * b, past=[0] * b, rotary="half", packed=True, seed=5)
    case = build(spec)
    layers = [clone_inputs(case.inputs) for _ in range(LAYERS)]
    meta = torch.tensor([m, m], dtype=torch.int32)
    for x in layers[1:]:
        for k in ("cumulative_sequence_length", "past_seqlens", "block_table", "cos_cache", "sin_cache"):
            x[k] = layers[0][k]
    for x in layers:
        x["attention_metadata"] = meta
    return case, layers


class _NoLaunch:
    """Stands in for a @triton.jit kernel: kernel[grid](...) launches nothing (the interpreter would run it)."""

    def __getitem__(self, grid):
        return lambda *args, **kw: None


def _counts(module, monkeypatch) -> list[collections.Counter]:
    """The ops of each layer's call of `module.paged_attention` in one run scope (the attention stubbed: the
    count is sdpa_prefill's own, whatever torch's SDPA decomposes into on this machine; the cache write's Triton
    launch too: the op count is the launcher's)."""
    from pagedkit.kernels.triton import cache_write

    monkeypatch.setattr(module, "fused_sdpa", lambda q, k, v, **kw: (torch.empty(q.shape, dtype=q.dtype), "math"))
    monkeypatch.setattr(cache_write, "_write_kernel", _NoLaunch())
    case, layers = _step_inputs()
    out = []
    with scope.run_scope(distinct_slots=True):
        for x in layers:
            with _Count() as c:
                module.paged_attention(x, outputs=["output"], validate=False, **case.attrs)
            out.append(c.ops)
    return out


def test_a_prefill_layer_issues_the_pinned_ops(monkeypatch):
    first, *rest = _counts(sdpa_prefill, monkeypatch)
    for layer in rest:
        assert dict(layer) == OPS_PER_LAYER, dict(layer)
    # the first layer also builds the step facts (once per run): comparisons, reductions, the int64 indices
    facts = first - collections.Counter(OPS_PER_LAYER)
    assert {"all", "clamp", "_to_copy"} <= set(facts) and sum(facts.values()) <= 20, dict(facts)


def test_teeth_step_facts_per_layer(tmp_path, monkeypatch):
    """sdpa_prefill with the facts recomputed by every layer (what it did before): every layer issues more."""
    bad = mutant(sdpa_prefill, [("ids, bad = memo(key, lambda: _step_facts(table, cu, past, kc.shape[0], nblk, m))",
                                 "ids, bad = _step_facts(table, cu, past, kc.shape[0], nblk, m)")],
                 tmp_path, monkeypatch)
    first, *rest = _counts(bad, monkeypatch)
    assert all(sum(layer.values()) > sum(OPS_PER_LAYER.values()) for layer in rest)


# ---- the custom ops' direct path ------------------------------------------------------------------------------


def _write_args():
    case, layers = _step_inputs(m=8, b=1)
    x = layers[0]
    args = (x["query"], None, None, x["cumulative_sequence_length"], x["past_seqlens"], x["block_table"],
            x["key_cache"], x["value_cache"], None, None, x["cos_cache"], x["sin_cache"], None, None, None, None,
            None, None)
    a = case.attrs
    kw = dict(num_heads=a["num_heads"], kv_num_heads=a["kv_num_heads"], head_size=x["key_cache"].shape[-1],
              k_fmt=0, k_scale_mode=0, v_fmt=0, v_scale_mode=0, rotary=True, rotary_interleaved=False,
              rotary_offset=0, qk_norm_epsilon=1e-6, qk_rotation=False, v_rotation=False, latent=False,
              unique_slots=True)
    return args, kw


def _clone(args):
    return tuple(None if t is None else t.clone() for t in args)


def _dispatched(fn, *args, **kw) -> tuple:
    """(result, whether the dispatcher ran pagedkit::write_kv) of one call, seen by the profiler (not a dispatch
    mode: that would turn the direct path off)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn(*args, **kw)
    return out, any(e.name == "pagedkit::write_kv" for e in prof.events())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype in (torch.float16, torch.bfloat16) else t


def test_write_kv_runs_directly_with_the_ops_bits(monkeypatch):
    args, kw = _write_args()
    direct_args, op_args = _clone(args), _clone(args)
    q1, via_op = _dispatched(ops.write_kv, *direct_args, **kw)
    assert not via_op, "a plain eager call went through the dispatcher"
    q2, via_op = _dispatched(torch.ops.pagedkit.write_kv, *op_args, **kw)
    assert via_op
    assert torch.equal(_bits(q1), _bits(q2))
    for i in (6, 7):  # the caches the write updated in place
        assert torch.equal(_bits(direct_args[i]), _bits(op_args[i]))
        assert not torch.equal(_bits(direct_args[i]), _bits(args[i]))  # it did write


def test_teeth_write_kv_through_the_dispatcher(tmp_path, monkeypatch):
    bad = mutant(ops, [("    if eager_call(args):\n        return _write_kv_impl(*args, **kw)\n", "")],
                 tmp_path, monkeypatch)
    args, kw = _write_args()
    _, via_op = _dispatched(bad.write_kv, *args, **kw)
    assert via_op


def test_eager_call_takes_plain_tensors_only():
    t = torch.zeros(2)
    assert ops.eager_call((t, None))
    assert not ops.eager_call((t, torch.zeros(2, requires_grad=True)))
    with _Count():  # any Python dispatch mode (make_fx's proxy mode, FakeTensorMode): the custom op
        assert not ops.eager_call((t,))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = mode.from_tensor(t)
    assert not ops.eager_call((fake,))


# ---- the runtime around the attention node --------------------------------------------------------------------


class _FakeOutput:
    """An output "tensor" on `device` that records moves."""

    def __init__(self, device: str):
        self.device, self.moved = torch.device(device), []

    def to(self, device):
        self.moved.append(device)
        return self


def _node_outputs(module, device: str, out_device: str) -> _FakeOutput:
    """AttentionCall.run of `module` (dispatch or a mutant) on a session device, the variant's output on another."""
    out = _FakeOutput(out_device)
    variant = types.SimpleNamespace(name="stub", op="PagedAttention", stages_on_cpu=False, capturable=False,
                                    serves_plan=lambda plan: True, load=lambda: lambda feed, **kw: {"output": out})
    call = module.AttentionCall(serving=[variant], refused={}, node_name="n", in_names=[], out_names=["output"],
                                attrs={}, device=torch.device(device))
    call.run([])
    return out


def test_outputs_on_the_sessions_device_stay_put():
    # a CUDA session's device has no index; its tensors are on cuda:0 (the device objects compare unequal)
    assert not _node_outputs(dispatch, "cuda", "cuda:0").moved
    assert _node_outputs(dispatch, "cuda", "cpu").moved == [torch.device("cuda")]
    assert _node_outputs(dispatch, "cuda:0", "cuda:1").moved
    assert not _node_outputs(dispatch, "cpu", "cpu").moved


def test_teeth_outputs_compared_as_devices(tmp_path, monkeypatch):
    bad = mutant(dispatch, [("elif not _on(t, self.device):", "elif t.device != self.device:")], tmp_path,
                 monkeypatch)
    assert _node_outputs(bad, "cuda", "cuda:0").moved  # a no-op move per output, per layer (before)


def test_placement_leaves_device_operands_untouched():
    from pagedkit.runtime.session import InferenceSession

    sess = types.SimpleNamespace(device=torch.device("meta"), _dev_copies={}, _capture_keep=None,
                                 _compiled=types.SimpleNamespace(host_const_ids=frozenset()))
    step = types.SimpleNamespace(host_in=frozenset({1}), call=None)
    on_dev = [torch.empty(2, device="meta"), torch.zeros(1), None]
    assert InferenceSession._place(sess, step, on_dev) is on_dev  # the host operand (slot 1) stays
    host_op = [torch.zeros(2), torch.zeros(1)]
    assert InferenceSession._place(sess, step, host_op) is host_op  # shape arithmetic stays on the host
    mixed = [torch.empty(2, device="meta"), torch.zeros(1), torch.zeros(3)]
    out = InferenceSession._place(sess, step, mixed)
    assert out[0] is mixed[0] and out[1] is mixed[1] and out[2].device.type == "meta"
    attention = types.SimpleNamespace(host_in=frozenset(), call=object())  # an attention node: always placed
    assert InferenceSession._place(sess, attention, [torch.zeros(2)])[0].device.type == "meta"


def test_the_probes_trace_summary():
    """benchmarks/probes/prefill_host.py's summary: top-level ops are those no other op contains; gaps are the
    span less their busy time; kernels are summed apart."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "probes" / "prefill_host.py"
    spec = importlib.util.spec_from_file_location("prefill_host_probe", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    ev = lambda name, ts, dur, cat="cpu_op": {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}  # noqa: E731
    trace = {"traceEvents": [ev("aten::matmul", 0, 10), ev("aten::mm", 2, 7), ev("aten::to", 15, 5),
                             ev("aten::matmul", 30, 10), ev("k", 3, 4, "kernel"), ev("k", 31, 6, "kernel"),
                             ev("cudaLaunchKernel", 4, 1, "cuda_runtime")]}
    got = probe.summarize(trace, layers=2)
    assert got["top_level_ops"] == 3 and got["top_level_ops_per_layer"] == 1.5
    assert got["host_span_ms"] == 0.04 and got["op_busy_ms"] == 0.025 and got["gaps_ms"] == 0.015
    assert got["kernels"] == 2 and got["kernel_ms"] == 0.01
    assert got["top_ops"][0] == {"name": "aten::matmul", "calls": 2, "us": 20.0}
