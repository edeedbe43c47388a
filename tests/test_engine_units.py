"""The engine's small pieces called directly, each against hand arithmetic: prompt-lookup drafts (n-gram order, the
min_ngram floor, nothing when no n-gram recurs), the draft bound (num_draft_tokens, room, max_new_tokens and the
context), a request's stop sequence with logprobs, new_request's token-id range, token_logprobs' top-k, the pool
fraction and memory_fraction edges, the argument checks that run before the model is loaded, the first layer's
fixed block size, the tensor-parallel engine's graphs (off), the scheduler's block arithmetic and preemption victim,
and the CUDA-graph planner's (batch, kv) key and replay-wide bounds (on a KVCacheManager alone, no model)."""

from __future__ import annotations

import math
import re
import shutil
from types import SimpleNamespace

import pytest
import torch

from pagedkit.engine import Engine, SamplingParams
from pagedkit.engine import model as model_module
from pagedkit.engine.engine import _Entry
from pagedkit.engine.graphs import KV_BUCKET_MIN, DecodeGraphs
from pagedkit.engine.logits import token_logprobs
from pagedkit.engine.model import pool_blocks
from pagedkit.engine.request import FINISHED, RUNNING, WAITING, new_request
from pagedkit.engine.sampling import ngram_draft
from pagedkit.engine.speculative import drafts_for
from pagedkit.runtime.kv.cache import KVCacheExhausted, KVCacheManager
from pagedkit.runtime.kv.config import GroupConfig, KVCacheConfig, LayerCacheSpec


# ---- prompt-lookup drafts ------------------------------------------------------------------------------------
def test_ngram_draft_longest_latest_match_and_nothing_when_no_ngram_recurs():
    assert ngram_draft([1, 2, 3, 4], 3) == []  # no n-gram of any length recurs: no drafts (not the last token)
    assert ngram_draft([7], 2) == [] and ngram_draft([], 2) == []
    assert ngram_draft([1, 2, 3], 0) == []
    # trigram (1, 2, 3) recurs at 0 -> what followed it; the unigram 3's latest earlier match (index 4) would give 1
    toks = [1, 2, 3, 7, 3, 1, 2, 3]
    assert ngram_draft(toks, 2) == [7, 3]
    assert ngram_draft(toks, 2, max_ngram=1) == [1, 2]
    # the tail 9, 2 never occurred before; the unigram 2 did (index 2): min_ngram decides
    toks = [5, 1, 2, 9, 2]
    assert ngram_draft(toks, 3) == [9, 2]
    assert ngram_draft(toks, 3, min_ngram=2) == []
    assert ngram_draft([4, 4, 4], 5) == [4]  # the latest earlier bigram (index 0) is followed by one token


def _request(prompt, vocab=100, max_seq_len=64, drafter=None, **params):
    return new_request(prompt, SamplingParams(**params), None, drafter, vocab_size=vocab, max_seq_len=max_seq_len,
                       eos_token_ids=[2])


def test_drafts_for_bounds():
    many = lambda toks: list(range(10, 30))  # noqa: E731 - a drafter proposing 20 ids
    prompt = [5, 6, 7, 8]
    r = _request(prompt, max_seq_len=6, drafter=many, num_draft_tokens=5, max_new_tokens=50)
    assert r.max_total == 7  # max_seq_len + 1
    # the context bound: 7 - 4 - 1 = 2 drafts (the step also emits the target's own token)
    assert drafts_for(r, 10, 100) == [10, 11]
    r = _request(prompt, max_seq_len=4, drafter=many, num_draft_tokens=5, max_new_tokens=50)
    assert drafts_for(r, 10, 100) == []  # 5 - 4 - 1 = 0
    r = _request(prompt, drafter=many, num_draft_tokens=5, max_new_tokens=4)
    assert drafts_for(r, 10, 100) == [10, 11, 12]  # max_new_tokens - 0 generated - 1
    r = _request(prompt, drafter=many, num_draft_tokens=5, max_new_tokens=50)
    assert drafts_for(r, 2, 100) == [10, 11]  # room
    assert drafts_for(r, 10, 100) == [10, 11, 12, 13, 14]  # num_draft_tokens
    with pytest.raises(ValueError, match=r"draft token ids must be in \[0, 12\), got \[12"):
        drafts_for(r, 10, 12)


# ---- requests ------------------------------------------------------------------------------------------------
def test_stop_sequence_drops_its_tokens_and_their_logprobs():
    r = _request([3, 4], stop_sequences=[[7, 8]], logprobs=1, max_new_tokens=10)
    entries = [(-0.5, [(5, -0.5)]), (-0.7, [(7, -0.7)]), (-0.1, [(8, -0.1)])]
    assert not r.append(5, entries[0]) and not r.append(7, entries[1])
    assert r._holdback() == 1  # 7 may begin the stop sequence: not streamed yet
    assert r.append(8, entries[2]) and r.finished and r.status == FINISHED and r.finish_reason == "stop"
    assert r.output == [5] and r.logprobs == [entries[0]]  # one entry per visible token
    out = r.emit()
    assert out.token_ids == [5] and out.new_logprobs == [entries[0]] and out.finished


def test_holdback_longest_stop_prefix():
    r = _request([3], stop_sequences=[[7, 8, 9], [8, 1]], max_new_tokens=10)
    for t in (5, 7, 8):
        assert not r.append(t)
    assert r._holdback() == 2  # 7, 8 begins (7, 8, 9); 8 alone begins (8, 1)
    assert r.emit().new_token_ids == [5]
    assert not r.append(4) and r._holdback() == 0
    assert r.emit().new_token_ids == [7, 8, 4]


def test_new_request_token_id_range():
    for ok in ([0], [99], [0, 99, 1]):
        r = _request(ok, vocab=100)
        assert r.prompt == ok and r.status == WAITING and not r.finished
    for bad in (100, -1, True, 1.0):
        with pytest.raises(ValueError, match=r"prompt_token_ids must hold token ids in \[0, 100\)"):
            _request([3, bad], vocab=100)
    assert _request([10 ** 6], vocab=None).prompt == [10 ** 6]  # vocabulary unknown: any id >= 0


# ---- logprobs --------------------------------------------------------------------------------------------------
def test_token_logprobs_top_k_edges():
    raw = torch.tensor([1.0, 3.0, -2.0, 2.5])
    z = math.log(sum(math.exp(v) for v in raw.tolist()))
    ref = [v - z for v in raw.tolist()]
    lp, top = token_logprobs(raw, 2, 2)
    assert lp == pytest.approx(ref[2], abs=1e-12)
    assert [t for t, _ in top] == [1, 3] and [v for _, v in top] == pytest.approx([ref[1], ref[3]], abs=1e-12)
    for k in (0, -1, -5):  # no top list asked for
        lp, top = token_logprobs(raw, 0, k)
        assert top == [] and lp == pytest.approx(ref[0], abs=1e-12)
    assert [t for t, _ in token_logprobs(raw, 0, 10)[1]] == [1, 3, 0, 2]  # k beyond the vocabulary: all of it


# ---- pool sizing and the argument checks ----------------------------------------------------------------------
def test_pool_blocks_fraction_edges():
    assert pool_blocks(10_000, 1, 1_000, cap=100) == 10
    assert pool_blocks(10_000, 1e-9, 1_000, cap=100) == 1
    for bad in (0, 0.0, -0.5, 1.0001):
        with pytest.raises(ValueError, match=r"memory_fraction must be in \(0, 1\]"):
            pool_blocks(10_000, bad, 1_000, cap=100)


class _Loaded(Exception):
    """read_config was reached: every argument check passed."""


def _stop_at_loading(monkeypatch):
    def read_config(model_dir):
        raise _Loaded(str(model_dir))

    monkeypatch.setattr(model_module, "read_config", read_config)


def test_argument_checks_before_loading(tmp_path, monkeypatch):
    _stop_at_loading(monkeypatch)
    for mf in (0, 0.0, -0.5, -1, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match=r"memory_fraction must be a number in \(0, 1\]"):
            Engine(tmp_path, memory_fraction=mf)
    for mf in (1, 1.0, 0.01, None):
        with pytest.raises(_Loaded):
            Engine(tmp_path, memory_fraction=mf)
    with pytest.raises(ValueError, match="cuda_graphs=True needs device 'cuda'"):
        Engine(tmp_path, device="cpu", cuda_graphs=True)
    with pytest.raises(_Loaded):  # accepted on a CUDA device (whether this machine has one is checked later)
        Engine(tmp_path, device="cuda", cuda_graphs=True)
    with pytest.raises(_Loaded):
        Engine(tmp_path, device="cpu", cuda_graphs="padded")


def test_the_first_layers_fixed_block_size_decides(tiny_llama, tmp_path):
    """A model whose first layer's caches fix block_size 16 (dimension 1 static, as examples/tiny-paged's): another
    block size is refused by that input's name; the other layers' symbolic dimension does not decide."""
    import onnx

    folder = tmp_path / "fixed"
    shutil.copytree(tiny_llama, folder)
    m = onnx.load(str(folder / "model.onnx"))
    fixed = 0
    for i in m.graph.input:
        if i.name in ("past_key_values.0.key", "past_key_values.0.value"):
            i.type.tensor_type.shape.dim[1].dim_value = 16
            fixed += 1
    assert fixed == 2
    onnx.save(m, str(folder / "model.onnx"))
    with pytest.raises(ValueError, match=r"block_size 32: the model's caches fix block_size 16 .*past_key_values\.0\.key"):
        Engine(folder, max_batch_size=2, max_num_tokens=32, block_size=32)
    assert Engine(folder, max_batch_size=2, max_num_tokens=32).model.block_size == 16


def test_tensor_parallel_engine_runs_without_graphs(tiny_llama, monkeypatch):
    """With tp > 1 the steps are eager: cuda_graphs None becomes False (no pad block, no DecodeGraphs); asking for
    graphs is refused. The rank set is faked by a session of the single-device model."""
    from pagedkit.runtime.session import InferenceSession

    class FakeSession:
        def __init__(self, path):
            self._s = InferenceSession(str(path), None, providers=["CPUExecutionProvider"])

        def __getattr__(self, name):
            return getattr(self._s, name)

        def mirror_copies(self, mgr):
            pass

    class FakeTP:
        def __init__(self, world, device):
            self.world, self.closed = world, False

        def session(self, model_dir, cpu_backend=None):
            return FakeSession(model_dir / "model.onnx")

        def close(self):
            self.closed = True

    monkeypatch.setattr(model_module, "resolve_world", lambda model_dir, tp, who: tp or 1)
    monkeypatch.setattr(model_module, "TensorParallel", FakeTP)
    engine = Engine(tiny_llama, max_batch_size=2, max_num_tokens=32, tp=2)
    assert engine.model.tp.world == 2 and engine.model.graphs is None
    assert not engine.kv.config.pad_block and not engine.overlap
    with pytest.raises(ValueError, match="cuda_graphs with tensor parallelism is not built yet"):
        Engine(tiny_llama, max_batch_size=2, max_num_tokens=32, tp=2, cuda_graphs="padded")


# ---- the scheduler -----------------------------------------------------------------------------------------------
def _cached(kv, sid, n):
    """Register sequence sid with n cached tokens (plans committed without running the model)."""
    toks = [3 + (i % 100) for i in range(n)]
    kv.add_sequence(sid, toks)
    done = 0
    while done < n:
        chunk = toks[done:done + 32]
        kv.commit(kv.plan([(sid, chunk)]))
        done += len(chunk)


def test_new_blocks_at_block_edges(tiny_llama):
    engine = Engine(tiny_llama, max_batch_size=4, max_num_tokens=64, enable_prefix_caching=False)
    assert engine.model.block_size == 16
    stub = lambda sid: SimpleNamespace(request_id=sid)  # noqa: E731
    for length, step, want in ((15, 1, 0), (15, 2, 1), (16, 1, 1), (16, 16, 1), (16, 17, 2), (17, 15, 0),
                               (1, 47, 2), (32, 33, 3)):
        sid = f"s{length}-{step}"
        _cached(engine.kv, sid, length)
        assert engine.kv.length(sid) == length
        # ceil((length + step) / 16) - ceil(length / 16)
        assert want == math.ceil((length + step) / 16) - math.ceil(length / 16)
        assert engine._new_blocks(_Entry(stub(sid), [5] * step)) == want, (length, step)
        engine.kv.free(sid)


def _two_admitted(tiny_llama):
    engine = Engine(tiny_llama, max_batch_size=4, max_num_tokens=64)
    engine.add_request([3, 4, 5, 6], SamplingParams(max_new_tokens=4), request_id="first")
    engine.add_request([7, 8, 9], SamplingParams(max_new_tokens=4), request_id="second")
    assert engine._drain() == [] and len(engine.waiting) == 2
    return engine


def _exhaust_once(engine, monkeypatch):
    real, calls = engine.model.plan, []

    def plan(batch):
        calls.append([sid for sid, _ in batch])
        if len(calls) == 1:
            raise KVCacheExhausted("the test's pool is full")
        return real(batch)

    monkeypatch.setattr(engine.model, "plan", plan)
    return calls


def test_unadmitted_victim_is_the_newest(tiny_llama, monkeypatch):
    engine = _two_admitted(tiny_llama)
    entries = engine._schedule([])
    assert [e.req.request_id for e in entries] == ["first", "second"] and all(e.new for e in entries)
    calls = _exhaust_once(engine, monkeypatch)
    plan = engine._plan(entries, [])
    assert calls == [["first", "second"], ["first"]] and plan is not None
    assert [r.request_id for r in engine.running] == ["first"] and engine.running[0].status == RUNNING
    assert [r.request_id for r in engine.waiting] == ["second"] and engine.waiting[0].status == WAITING
    assert engine.stats.unadmitted == 1 and engine.stats.preemptions == 0
    engine.kv.abort(plan)


def test_preemption_victim_is_the_latest_admitted(tiny_llama, monkeypatch):
    engine = _two_admitted(tiny_llama)
    entries = [_Entry(e.req, e.ids) for e in engine._schedule([])]  # as if both were running already
    calls = _exhaust_once(engine, monkeypatch)
    plan = engine._plan(entries, [])
    assert calls == [["first", "second"], ["first"]] and plan is not None
    assert [r.request_id for r in engine.waiting] == ["second"] and engine.waiting[0].num_preemptions == 1
    assert engine.stats.preemptions == 1 and engine.stats.unadmitted == 0
    engine.kv.abort(plan)


# ---- the CUDA-graph planner ------------------------------------------------------------------------------------
def _padded_manager(max_seq_len=2048):
    group = GroupConfig("full", 200, 16, (LayerCacheSpec(0, 1, 16),))
    return KVCacheManager(KVCacheConfig((group,), max_batch_size=8, max_num_tokens=64, max_seq_len=max_seq_len,
                                        pad_block=True))


def test_decode_graphs_key_and_bounds():
    mgr = _padded_manager()
    graphs = DecodeGraphs(SimpleNamespace(mgr=mgr), capture=False)
    assert graphs.buckets == (1, 2, 4, 8)
    _cached(mgr, "long", 300)
    _cached(mgr, "short", 5)
    assert graphs.key([("short", [8])]) == (1, KV_BUCKET_MIN)
    assert graphs.key([("long", [8])]) == (1, 512)  # 301 tokens after this step: the next power of two
    assert graphs.key([("short", [8]), ("long", [9])]) == (2, 512)  # the longest sequence decides
    _cached(mgr, "edge", 511)
    assert graphs.key([("edge", [8])]) == (1, 512)
    mgr.commit(mgr.plan([("edge", [8])]))
    assert graphs.key([("edge", [8]), ("short", [9]), ("long", [1])]) == (4, 1024)  # 513 tokens
    plan = graphs.plan([("short", [8]), ("long", [9]), ("edge", [1])])
    assert graphs.serves(plan) and plan.pad_rows == 1
    # replay-wide bounds: one query token per row, the kv bucket, no lower bound
    assert plan.attention_metadata.tolist() == [1, 1024, 0]
    mgr.abort(plan)
    plain = graphs.plan([("short", [8, 9])])  # two tokens: not a graph step, exact metadata
    assert not graphs.serves(plain) and plain.attention_metadata.tolist() == [2, 7, 7]
    mgr.abort(plain)


def test_admission_stops_at_max_batch_size(tiny_llama):
    engine = Engine(tiny_llama, max_batch_size=2, max_num_tokens=64)
    for i in range(3):
        engine.add_request([3 + i, 4, 5], SamplingParams(max_new_tokens=2), request_id=f"r{i}")
    engine._drain()
    entries = engine._schedule([])
    assert [e.req.request_id for e in entries] == ["r0", "r1"] and [r.request_id for r in engine.waiting] == ["r2"]
    assert [r.admitted for r in engine.running] == [1, 2]
    # a group's parent waits until the batch has room for its siblings too
    engine = Engine(tiny_llama, max_batch_size=3, max_num_tokens=64)
    engine.add_request([3, 4, 5], SamplingParams(max_new_tokens=2), request_id="alone")
    engine.add_group([6, 7, 8], [SamplingParams(max_new_tokens=2)] * 3)
    engine._drain()
    entries = engine._schedule([])
    assert [e.req.request_id for e in entries] == ["alone"] and len(engine.waiting) == 1


# ---- chain_entries' length bounds (overlap) ------------------------------------------------------------------
def _chain(prompt_len, max_seq_len, max_new_tokens=50):
    from pagedkit.engine.overlap import chain_entries

    r = _request(list(range(3, 3 + prompt_len)), max_seq_len=max_seq_len, max_new_tokens=max_new_tokens)
    r.status, r.num_computed = RUNNING, prompt_len
    r.append(5)  # the previous step's token: decoding (everything but it cached)
    kv = SimpleNamespace(length=lambda rid: r.num_computed, config=SimpleNamespace(max_seq_len=max_seq_len))
    engine = SimpleNamespace(running=[r], waiting=[], kv=kv)
    prev = SimpleNamespace(entries=[SimpleNamespace(req=r)])
    return r, chain_entries(engine, prev, lambda req, ids: (req, ids))


def test_chain_entries_context_bound():
    # max_total = max_seq_len + 1 = 17; the in-flight step brings tokens to len + 1, the chained one to len + 2
    r, out = _chain(14, 16)  # 15 tokens: 15 + 2 = 17 <= 17, the chained token still fits
    assert out == [(r, [0])]
    r, out = _chain(15, 16)  # 16 tokens: the in-flight token (the 17th) ends the request by length
    assert not r.finished and out is None
    # far from the bound (40 tokens of 65): chained
    r, out = _chain(39, 64)
    assert out == [(r, [0])]
    r, out = _chain(39, 64, max_new_tokens=2)  # the in-flight token is the last one max_new_tokens allows
    assert out is None


# ---- SamplingParams' integer fields ----------------------------------------------------------------------------
@pytest.mark.parametrize("name,minimum", [("max_new_tokens", 1), ("top_k", 0), ("num_draft_tokens", 0),
                                          ("seed", 0), ("logprobs", 0)])
def test_sampling_params_integer_fields_reject_bools_floats_and_small(name, minimum):
    for bad in (True, False, 2.5, 3.0, minimum - 1):
        with pytest.raises(ValueError, match=rf"SamplingParams\.{name} must be an integer >= {minimum}, got {bad!r}"):
            SamplingParams(**{name: bad})
    assert getattr(SamplingParams(**{name: minimum + 2}), name) == minimum + 2


# ---- a failing token constraint's reason -----------------------------------------------------------------------
def test_constraint_failure_reason_capped_at_500_chars():
    class Boom:
        def accept(self, token):
            raise RuntimeError("x" * 1000)

    r = _request([3, 4], constraint=Boom, max_new_tokens=10)
    assert r.append(7) and r.finished and r.finish_reason == "abort"
    full = "the request's token constraint failed: RuntimeError: " + "x" * 1000
    assert len(r.reason) == 500 and r.reason == full[:500]


# ---- Choices' shape check and greedy_rows' dispatch ------------------------------------------------------------
def test_choices_rejects_logits_not_2d():
    from pagedkit.engine.sampling import Choices

    ps = [SamplingParams(), SamplingParams()]
    for shape in ((2, 1, 5), (2,), (3, 5)):
        with pytest.raises(ValueError, match=rf"Choices: logits should be \[2, vocab\], got {re.escape(str(shape))}"):
            Choices(torch.zeros(shape), ps)
    c = Choices(torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 3.0]]), ps)
    assert [c.token(0, None), c.token(1, None)] == [1, 0]  # ties to the lowest index


def test_greedy_rows_uses_the_triton_argmax_on_cuda_when_available(monkeypatch):
    from pagedkit.engine.sampling import greedy_rows
    from pagedkit.kernels.triton import argmax as argmax_mod
    from pagedkit.kernels.triton import common

    monkeypatch.setattr(argmax_mod, "argmax_rows", lambda x: "triton")
    fake = SimpleNamespace(is_cuda=True, device=torch.device("cuda"), dtype=torch.float32, argmax=lambda dim: "torch")
    monkeypatch.setattr(common, "HAVE_TRITON", True)
    assert greedy_rows(fake) == "triton"
    monkeypatch.setattr(common, "HAVE_TRITON", False)
    assert greedy_rows(fake) == "torch"
    assert greedy_rows(SimpleNamespace(is_cuda=False, device=torch.device("cpu"), dtype=torch.bfloat16,
                                       argmax=lambda dim: "torch")) == "torch"  # bf16: numpy has none


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_host_argmax_against_a_loop(dtype):
    """The CPU argmax (numpy's for float32 / float16) against a Python loop: the first maximum, the first NaN."""
    from pagedkit.engine.sampling import greedy_rows, host_argmax, sample_token

    g = torch.Generator().manual_seed(3)
    x = torch.randint(-3, 4, (6, 257), generator=g).to(dtype)  # many ties
    x[2, 100] = float("nan")
    x[2, 7] = float("nan")
    x[3] = float("-inf")
    x[4, 256] = 9  # the last column

    def oracle(row):
        vals = row.float().tolist()
        nan = [i for i, v in enumerate(vals) if v != v]
        return nan[0] if nan else vals.index(max(vals))

    want = [oracle(r) for r in x]
    for got in (host_argmax(x), greedy_rows(x)):
        assert got.dtype == torch.int64 and got.tolist() == want
    assert host_argmax(x[:, ::2]).tolist() == [oracle(r) for r in x[:, ::2]]  # a strided view
    assert [sample_token(r, SamplingParams(temperature=0.0), g) for r in x] == want
    assert host_argmax(torch.zeros(0, 5)).shape == (0,)
    assert [int(host_argmax(r)) for r in x] == want  # one row ([V]): each path along its last dim
