"""PagedAttention on the CPU as one onnxruntime custom op (pagedkit/kernels/cpu: paged_attention.c, lower.py; run
by the onnxruntime CPU backend, runtime/delegate.py).

Oracles: Hugging Face eager float32 (tests/export_utils.check_parity: prefill + teacher-forced decode of two
ragged sequences over a shuffled block pool with poisoned caches, chunked prefill, block size 32) and, for the
fp32 export's Llama-shaped families, HF with float16 rounding exactly at the attention node's boundary
(test_export_fp32.node_boundary_fp16, NODE_TOL 1e-3); the case files (tests/cases: the reference kernel's
outputs and caches for every feature) in tests/test_delegate.py. Teeth: mutants of the C source (a 2% wrong
scale, the context one key short, the window dropped, the sink dropped) built into a temporary library each
fail; caches bound as copies instead of in place are seen.
"""

from __future__ import annotations

import math
import shutil

import numpy as np
import onnx
import pytest
import torch

from export_utils import check_parity, export_tiny, tiny_model
from pagedkit.kernels.cpu import build as B
from pagedkit.kernels.cpu import lower as L
from pagedkit.runtime import InferenceSession
from pagedkit.runtime import delegate as D
from test_export_fp32 import FAMILIES, FP32_TOL, NODE_TOL, node_boundary_fp16

pytest.importorskip("onnxruntime")


@pytest.fixture(autouse=True)
def _kernel(monkeypatch):
    n = torch.get_num_threads()  # a delegating session sets torch to one thread (process-wide)
    monkeypatch.setenv("PAGEDKIT_CPU_BACKEND", "onnxruntime")
    monkeypatch.setenv("PAGEDKIT_CPU_ATTENTION", "kernel")  # an error, not a silent fallback, if it is not built
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def llama():
    return FAMILIES["llama"][0]()


@pytest.fixture(scope="module")
def llama32(llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("llama32k")
    export_tiny(llama, out, dtype="fp32")
    return out


def _lowered(model_dir) -> dict:
    d = InferenceSession(str(model_dir / "model.onnx")).delegated
    assert d["lowered"] and not d["decomposed"] and not d["torch"] and d["attention_nodes"] == 0, d
    return d


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3", "gemma2", "gpt_oss"])
def test_family_parity_through_the_kernel(family, tmp_path):
    """fp32 exports (the Casts around each node folded into it): RoPE (Llama), sliding window (Mistral), QK-norm
    (Qwen3), softcap and alternating windows (Gemma 2), sinks and windows (GPT-OSS) vs HF float32 within FP32_TOL,
    and vs HF with the node's float16 rounding within NODE_TOL where that emulation applies."""
    make, kw, boundary = FAMILIES[family]
    hf = make()
    export_tiny(hf, tmp_path, dtype="fp32")
    d = _lowered(tmp_path)
    assert len(d["lowered"]) == hf.config.num_hidden_layers
    rep = check_parity(hf, tmp_path, tol=FP32_TOL, **kw)
    line = f"{family} via the CPU kernel: vs HF fp32 {rep.worst_ratio:.3g}"
    if boundary:
        with node_boundary_fp16(hf):
            node = check_parity(hf, tmp_path, tol=NODE_TOL, **kw)
        line += f", vs HF with node-boundary fp16 {node.worst_ratio:.3g} (bound {NODE_TOL})"
    print(line)


def test_fp16_export_chunked_prefill_block_32(tmp_path):
    """An fp16 export (the node's own T in and out: no Casts folded), chunked prefill, 32-token blocks."""
    hf = tiny_model("LlamaConfig", seed=3)
    export_tiny(hf, tmp_path)
    sess = InferenceSession(str(tmp_path / "model.onnx"), cpu_backend="onnxruntime")
    check_parity(hf, tmp_path, prompt_lens=(40, 9), chunk=16, steps=6, block_size=32, seed=4, session=sess)
    assert sess.delegated["lowered"], sess.delegated


def _ort_models(monkeypatch) -> list[onnx.ModelProto]:
    seen, real = [], D._ort_session

    def record(m, *args, **kwargs):
        seen.append(m)
        return real(m, *args, **kwargs)

    monkeypatch.setattr(D, "_ort_session", record)
    return seen


def test_one_onnxruntime_node_per_layer_attention(llama, llama32, monkeypatch):
    """The attention of a layer is one onnxruntime node (no Casts around it, no shared bookkeeping nodes): the
    graph onnxruntime runs has as many nodes as the model without its attention, plus one a layer (plus the LM
    head's row selection, once per step). The
    op-by-op decomposition of the same model takes more than 20 a layer (what the kernel replaces)."""
    layers = llama.config.num_hidden_layers
    seen = _ort_models(monkeypatch)
    InferenceSession(str(llama32 / "model.onnx"))
    (m,) = seen
    model = onnx.load(str(llama32 / "model.onnx"), load_external_data=False)
    attention = [n for n in m.graph.node if "PagedAttention" in n.name]
    assert len(attention) == layers and all(n.domain == "pagedkit.cpu" for n in attention)
    assert all(n.op_type == "PagedAttention_f32_f16_f16" for n in attention)  # the float32 Casts folded in
    others = [n for n in model.graph.node if "PagedAttention" not in n.name]  # the node and its Casts
    rows = [n for n in m.graph.node if n.name.startswith("pagedkit.logit_rows/")]  # kernels/cpu/logits.py
    assert len(m.graph.node) == len(others) + layers + len(rows) and len(rows) <= 9
    seen.clear()
    monkeypatch.setenv("PAGEDKIT_CPU_ATTENTION", "decompose")
    InferenceSession(str(llama32 / "model.onnx"))
    (m,) = seen
    per_layer = sum("PagedAttention" in n.name and n.op_type != "Constant" for n in m.graph.node) / layers
    print(f"onnxruntime nodes of a layer's attention: kernel 1, decomposition {per_layer:.1f}")
    assert per_layer > 20


@pytest.mark.parametrize("pool", ["onnxruntime", "pool.h"])
def test_attention_over_threads_gives_the_serial_results(llama, llama32, monkeypatch, pool):
    """With every step's attention spread over 4 threads (onnxruntime's intra-op pool, or pool.h's), the logits are
    the one-thread ones bit for bit (each token x KV head item is computed alike, by whichever thread), and HF
    parity holds."""
    from export_utils import PagedRunner, _Seq

    from pagedkit.runtime.session import SessionOptions

    monkeypatch.setattr(L, "PARALLEL_MIN", 0 if pool == "pool.h" else 10**9)
    monkeypatch.setattr(L, "ORT_PARALLEL_MIN", 0 if pool == "onnxruntime" else -1)
    outs = {}
    for threads in (1, 4):
        sess = InferenceSession(str(llama32 / "model.onnx"), SessionOptions(intra_op_num_threads=threads),
                                cpu_backend="onnxruntime")
        assert sess.delegated["lowered"], sess.delegated
        runner = PagedRunner(llama32, seed=7, session=sess)
        seqs = [_Seq(list(range(3, 40))), _Seq(list(range(50, 61)))]
        got = [runner.step(seqs, [37, 11])]
        for _ in range(3):
            for s in seqs:
                s.tokens.append(5)
            got.append(runner.step(seqs, [1, 1]))
        outs[threads] = [o for step in got for o in step]
    assert all(np.array_equal(a, b) for a, b in zip(outs[1], outs[4]))
    check_parity(llama, llama32, tol=FP32_TOL, session=InferenceSession(
        str(llama32 / "model.onnx"), SessionOptions(intra_op_num_threads=4), cpu_backend="onnxruntime"))


def test_caches_written_in_place_and_teeth(llama32, monkeypatch):
    """run_torch's contract with the kernel: the fed caches are written in place (bound without a copy) and
    returned as the present outputs; bound as copies (teeth) the fed tensors stay untouched."""
    from test_delegate import _one_step

    import onnxruntime as ort

    before, fed, present = _one_step(llama32)
    assert present is fed and not torch.equal(fed, before)
    real = ort.OrtValue.ortvalue_from_numpy
    monkeypatch.setattr(ort.OrtValue, "ortvalue_from_numpy", staticmethod(lambda a, *r: real(a.copy(), *r)))
    before, fed, present = _one_step(llama32)
    assert torch.equal(fed, before)


def test_kernel_setting(llama32, monkeypatch):
    """PAGEDKIT_CPU_ATTENTION: decompose never uses the library; kernel raises when it cannot be built (auto
    then decomposes and says why)."""
    monkeypatch.setenv("PAGEDKIT_CPU_ATTENTION", "decompose")
    d = InferenceSession(str(llama32 / "model.onnx")).delegated
    assert d["decomposed"] and not d["lowered"] and "decompose" in d["cpu_kernel"], d
    monkeypatch.setattr(B, "_RESULT", (None, "no C compiler on PATH (for the test)"))
    monkeypatch.setenv("PAGEDKIT_CPU_ATTENTION", "kernel")
    with pytest.raises(RuntimeError, match="PAGEDKIT_CPU_ATTENTION=kernel"):
        InferenceSession(str(llama32 / "model.onnx"))
    monkeypatch.setenv("PAGEDKIT_CPU_ATTENTION", "auto")
    d = InferenceSession(str(llama32 / "model.onnx")).delegated
    assert d["decomposed"] and not d["lowered"] and "no C compiler" in d["cpu_kernel"], d


@pytest.mark.parametrize("heads,kv_heads,head_size,cache", [
    (9, 3, 64, torch.float16),  # SmolLM2: 3 heads a group, one 64-wide chunk
    (8, 8, 80, torch.float16),  # one head a group; a 64-wide chunk and a 16-wide one
    (24, 4, 128, torch.float16),  # 6 heads a group (the most in registers), two chunks
    (14, 2, 32, torch.float16),  # 7 heads a group: the generic loops
    (6, 2, 24, torch.float16),  # head size not a multiple of 16: the generic loops
])
def test_group_shapes_against_the_reference(heads, kv_heads, head_size, cache):
    """The kernel's register-held group path (simd.h qk_group / pv_group: G <= 6, head size a multiple of 16) and
    the generic loops beside it, against the torch reference kernel (kernels/paged/reference.py, float32 math):
    prefill and decode rows, contexts across blocks, RoPE."""
    from cases import Case as FileCase, Expected
    from nodes import make_paged_case
    from pagedkit.kernels.paged.reference import paged_attention
    from test_session_cases import single_node_model

    c = make_paged_case(num_heads=heads, kv_num_heads=kv_heads, head_size=head_size, past=(0, 37, 150),
                        q_lens=(6, 1, 2), dtype=cache, seed=heads * 1000 + head_size)
    want = paged_attention({k: v.clone() for k, v in c.inputs.items()}, outputs=c.outputs, **c.attrs)
    case = FileCase(f"group_{heads}_{kv_heads}_{head_size}", "PagedAttention", c.attrs, c.inputs, Expected(want, {}))
    sess = InferenceSession(single_node_model(case), cpu_backend="onnxruntime")
    assert sess.delegated["lowered"], sess.delegated
    got = sess.run_torch({k: v.clone() for k, v in c.inputs.items()})
    tol = 5e-3 if cache == torch.float16 else 2e-2
    for name, ref in want.items():
        have, ref = got[name].double(), ref.double()
        assert have.shape == ref.shape and torch.isfinite(have).all(), name
        rel = float((have - ref).abs().max() / ref.abs().max())
        assert rel <= tol, f"{name}: max|diff| / max|ref| = {rel:.3g} > {tol}"


def _mutant(tmp_path, old: str, new: str):
    src = tmp_path / "src"
    src.mkdir()
    for p in (B.SOURCE, *B.HEADERS):
        shutil.copy(p, src / p.name)
    text = (src / B.SOURCE.name).read_text()
    assert text.count(old) == 1, old
    (src / B.SOURCE.name).write_text(text.replace(old, new))
    path, why = B.build(out_dir=tmp_path, source_dir=src)
    assert path, why
    return path


MUTANTS = {
    "scale x1.02": ("const float scale = K->scale != 0.f ? K->scale : 1.0f / sqrtf((float)D);",
                    "const float scale = 1.02f * (K->scale != 0.f ? K->scale : 1.0f / sqrtf((float)D));"),
    "context one key short": ("int64_t hi = extent - 1, lo = 0;", "int64_t hi = extent - 2, lo = 0;"),
    "window dropped": ("if (K->window > 0 && pos - K->window + 1 > lo)", "if (0)"),
    "sink dropped": ("if (S->sink) den += expf(sink - m);", ""),
    "work items: tokens only": ("const int64_t items = T * HKV;", "const int64_t items = T;"),
    "group path: last key dropped": ("pv_group(acc, scores, (const uint16_t*)S->vcache, rows, n, G, D, K->c);",
                                     "pv_group(acc, scores, (const uint16_t*)S->vcache, rows, n - 1, G, D, K->c);"),
    "group path: one group's queries": ("qk_group(scores, q + (size_t)g * G * D,", "qk_group(scores, q,"),
}


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_teeth_mutated_kernel(mutant, tmp_path, monkeypatch):
    """Each mutant of the C kernel, built and used in place of the real one, fails: HF parity (GPT-OSS fp32:
    sinks and windows) and the case files of the features it breaks."""
    from cases import compare_case, load_cases
    from test_session_cases import single_node_model

    monkeypatch.setattr(B, "_RESULT", (_mutant(tmp_path, *MUTANTS[mutant]), ""))
    monkeypatch.setattr(L, "PARALLEL_MIN", 0)  # every step's attention over the threads
    monkeypatch.setattr(L, "ORT_PARALLEL_MIN", 0)
    failures = []
    for name in ("paged_sink_window_softcap", "paged_llama_fp16_rotary", "paged_bidirectional_window"):
        (case,) = load_cases([name])
        sess = InferenceSession(single_node_model(case), cpu_backend="onnxruntime")
        assert sess.delegated["lowered"], sess.delegated
        feeds = {k: (v.clone() if isinstance(v, torch.Tensor) else torch.as_tensor(v))
                 for k, v in case.inputs.items()}
        got = sess.run_torch(feeds)
        try:
            compare_case(case, {k: v.clone() for k, v in got.items()})
        except AssertionError:
            failures.append(name)
    make, kw, _ = FAMILIES["gpt_oss"]
    hf = make()
    export_tiny(hf, tmp_path / "m", dtype="fp32")
    try:
        worst = check_parity(hf, tmp_path / "m", tol=math.inf, greedy=False, **kw).worst_ratio
    except AssertionError:  # non-finite logits
        worst = math.inf
    print(f"{mutant}: case files failing {failures}; GPT-OSS vs HF {worst:.3g} (bound {FP32_TOL})")
    assert failures and worst > FP32_TOL


def test_generator_direct_path_matches_run_torch(llama32, monkeypatch):
    """Generator's direct path (the model is one onnxruntime segment: no run_torch checks, persistent step
    buffers, logits in a buffer of the segment's) gives the tokens and logits of the run_torch path, and history
    keeps each step's own logits (the buffer is reused). Teeth: a direct path that does not write the step's
    token into its id buffer is seen."""
    from pagedkit.runtime import generate as G

    prompt = [5, 17, 33, 9, 101, 64, 12]

    def run(direct: bool):
        gen = G.Generator(llama32, shuffle_seed=3)
        if not direct:
            gen.state._direct = False
        steps = list(gen.greedy(prompt, 10, stop_at_eos=False))
        assert bool(gen.state._direct) == direct
        return [s.token for s in steps], torch.stack([s.logits for s in steps])

    tokens, logits = run(True)
    ref_tokens, ref_logits = run(False)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    assert len({float(row.max()) for row in logits}) > 1  # each step's own logits, not the last buffer's

    real = G._PagedState._setup_direct

    def detached(self, feeds):  # the bug: ids written to an array that is not the bound buffer's memory
        out = real(self, feeds)
        self._id_np = self._id_np.copy()
        return out

    monkeypatch.setattr(G._PagedState, "_setup_direct", detached)
    bad_tokens, bad_logits = run(True)
    assert bad_tokens != ref_tokens or not torch.allclose(bad_logits, ref_logits, atol=1e-3)


# ---- the CPU default: float16 models widened to float32 outside attention (kernels/cpu/widen.py) ----------------

def _fp16_weights(hf):
    """A copy of `hf` with every parameter rounded to float16 (kept float32): the weights a float16 export holds."""
    import copy

    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.to(torch.float16).float())
    return ref


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_widened_fp16_export_parity(family, tmp_path, monkeypatch):
    """A float16 export on the CPU's default backend ("auto") runs in onnxruntime widened to float32 outside
    attention: against HF eager on the same float16-rounded weights with float16 rounding at the attention node's
    boundary it agrees within NODE_TOL (an export computing in float16 does not: teeth below)."""
    monkeypatch.setenv("PAGEDKIT_CPU_BACKEND", "auto")
    hf = FAMILIES[family][0]()
    export_tiny(hf, tmp_path)  # float16
    sess = InferenceSession(str(tmp_path / "model.onnx"))
    d = sess.delegated
    assert sess.cpu_backend == "onnxruntime" and d["widened"] > 0 and d["lowered"] and not d["torch"], d
    ref = _fp16_weights(hf)
    with node_boundary_fp16(ref):
        rep = check_parity(ref, tmp_path, tol=NODE_TOL, session=sess)
    print(f"{family} fp16 export, widened: vs HF (fp16 weights, node-boundary fp16) {rep.worst_ratio:.3g}")


def test_widening_teeth_float16_compute_fails_node_tol(tmp_path, monkeypatch):
    """The same float16 export computed in float16 (pagedkit's torch kernels) misses NODE_TOL against that
    reference: the bound tells float32 computation from float16."""
    hf = FAMILIES["llama"][0]()
    export_tiny(hf, tmp_path)
    sess = InferenceSession(str(tmp_path / "model.onnx"), cpu_backend="torch")
    ref = _fp16_weights(hf)
    with node_boundary_fp16(ref):
        rep = check_parity(ref, tmp_path, tol=math.inf, greedy=False, session=sess)
    assert rep.worst_ratio > NODE_TOL, rep.worst_ratio


def test_default_cpu_path_rule(tmp_path, monkeypatch):
    """The documented rule (docs/runtime.md): Generator / paged-run default to cpu_backend "auto": onnxruntime for
    float32 and int4 exports and for float16 PagedAttention exports (widened); torch for bfloat16; every
    PagedAttention node of an onnxruntime model on the attention kernel."""
    from pagedkit.runtime.generate import Generator

    monkeypatch.delenv("PAGEDKIT_CPU_BACKEND", raising=False)
    monkeypatch.setenv("PAGEDKIT_CPU_ATTENTION", "auto")
    hf = tiny_model("LlamaConfig", seed=4, vocab_size=20000)  # weights over the 1M-element rule
    from pagedkit.exporters.export import export_hf_model
    from pagedkit.exporters.families.base import ExportOptions

    got = {}
    for name, opts in {"fp32": dict(dtype="fp32"), "fp16": {}, "bf16": dict(dtype="bf16"),
                       "int4": dict(dtype="fp32")}.items():
        if name == "int4":
            export_hf_model(hf, tmp_path / name, ExportOptions(progress=False, **opts), weight_format="int4")
        else:
            export_tiny(hf, tmp_path / name, **opts)
        sess = Generator(tmp_path / name).session
        d = sess.delegated
        got[name] = (sess.cpu_backend, bool(d.get("lowered")), d.get("widened", 0) > 0)
    assert got == {"fp32": ("onnxruntime", True, False), "fp16": ("onnxruntime", True, True),
                   "bf16": ("torch", False, False), "int4": ("onnxruntime", True, False)}, got


def test_last_row_logits_and_teeth(llama32, monkeypatch):
    """Generator asks the model for its last row's logits only (kernels/cpu/logits.py: the LM head gathers the rows
    fed; run_torch, feeding none, gets every row): a prefill's last-row logits equal run_torch's last row. Teeth: a
    row index that never reaches the bound buffer (row 0 then) is seen on the prefill."""
    from pagedkit.kernels.cpu.logits import ROWS_INPUT
    from pagedkit.runtime import generate as G

    prompt = [5, 17, 33, 9, 101, 64, 12, 40, 41, 42]
    gen = G.Generator(llama32, shuffle_seed=1)
    first = list(gen.greedy(prompt, 2, stop_at_eos=False))  # run_torch: every row, then the direct path is set
    assert gen.state._rows is not None and gen.state._rows[0] == gen.session.single_segment()[1].index(ROWS_INPUT)
    again = list(gen.greedy(prompt, 2, stop_at_eos=False))  # the prefill on the direct path: its last row only
    torch.testing.assert_close(again[0].logits, first[0].logits, rtol=0, atol=1e-5)
    real = G._PagedState._setup_direct

    def detached(self, feeds):  # the bug: the row index written to an array that is not the bound tensor
        out = real(self, feeds)
        at, every, last, last_np = self._rows
        self._rows = (at, every, last, last_np.copy())
        return out

    monkeypatch.setattr(G._PagedState, "_setup_direct", detached)
    bad = G.Generator(llama32, shuffle_seed=1)
    list(bad.greedy(prompt, 2, stop_at_eos=False))
    wrong = list(bad.greedy(prompt, 2, stop_at_eos=False))
    assert not torch.allclose(wrong[0].logits, first[0].logits, atol=1e-3)


def test_run_torch_feeds_the_logit_rows(llama32):
    """`pagedkit.logit_rows` is an overridable initializer of the onnxruntime CPU path: run_torch may feed it (the
    engine / batch loops: each sequence's last token) and gets those rows, equal to the same rows of the full
    logits; fed nothing, every row. An unknown name is still refused."""
    from pagedkit.interface import names as N
    from pagedkit.kernels.cpu.logits import ROWS_INPUT
    from pagedkit.runtime.generate import Generator, step_feeds

    gen = Generator(llama32, shuffle_seed=2)
    sess, st = gen.session, gen.state
    assert [a.name for a in sess.get_overridable_initializers()] == [ROWS_INPUT]
    ids = [5, 17, 33, 9, 101, 64, 12, 40, 41, 42]
    st.start(ids)
    plan = st.mgr.plan([(st.seq, ids)])
    feeds = step_feeds(plan, st.mgr, ids, st.renames, st.input_names, gen.config.input(N.INPUT_IDS))
    every = sess.run_torch(feeds, ["logits"])["logits"].clone()  # the cache writes are the same both times
    some = sess.run_torch(feeds | {ROWS_INPUT: torch.tensor([3, 9])}, ["logits"])["logits"]
    st.mgr.commit(plan)
    assert every.shape[0] == len(ids) and some.shape[0] == 2
    torch.testing.assert_close(some, every[[3, 9]], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="invalid input name"):
        sess.run_torch(feeds | {"pagedkit.nope": torch.tensor([1])}, ["logits"])
