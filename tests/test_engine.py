"""The continuous-batching engine (pagedkit/engine) on the CPU against an independent oracle: the
single-sequence Generator running each request alone on the same tiny random Llama export.

Greedy tokens must agree; a disagreement is accepted only at a near-tie of the oracle's logits (top-1 /
top-2 gap < NEAR_TIE x max|logit| at the first differing position), and every such case is reported
(warnings + ENGINE_NEAR_TIES). Seeded sampling is compared with an oracle loop over the Generator's
caches that draws with the same per-request torch.Generator.
"""

from __future__ import annotations

import json
import random
import shutil
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from pagedkit.engine import Engine, RequestOutput, SamplingParams, sample_token
from pagedkit.engine import engine as engine_mod
from pagedkit.runtime.generate import Generator

NEAR_TIE = 2e-2
ENGINE_NEAR_TIES: list[str] = []
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def oracle(tiny_llama) -> Generator:
    return Generator(tiny_llama)


def prompts_of(lengths, seed=0, vocab=144):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def greedy_alone(gen: Generator, prompt, n, ignore_eos=False):
    steps = list(gen.greedy(prompt, n, stop_at_eos=not ignore_eos))
    return [s.token for s in steps], [s.logits for s in steps]


def assert_same_greedy(got: list[int], gen: Generator, prompt, n, what="", ignore_eos=False):
    ref, logits = greedy_alone(gen, prompt, n, ignore_eos)
    if got == ref:
        return
    i = next((k for k, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
    assert i < len(got) and i < len(ref), f"{what}: lengths differ without a token difference: {got} vs {ref}"
    top = torch.topk(logits[i], 2).values
    gap, scale = float(top[0] - top[1]), float(logits[i].abs().max())
    assert gap < NEAR_TIE * scale, (f"{what}: engine token {got[i]} != alone {ref[i]} at step {i} "
                                    f"(gap {gap:.4g} = {gap / scale:.3g} x max|logit|, not a near-tie)\n{got}\n{ref}")
    msg = f"{what}: near-tie at step {i} (gap {gap / scale:.3g} x max|logit|): {got[i]} vs {ref[i]}"
    ENGINE_NEAR_TIES.append(msg)
    warnings.warn(msg)


def sampled_alone(gen: Generator, prompt, params: SamplingParams, eos=(2,)) -> list[int]:
    """Oracle: the Generator's single-sequence caches, one token a step, drawn by sample_token with a
    torch.Generator seeded like the engine's per-request one."""
    rng = torch.Generator().manual_seed(params.seed)
    state = gen.state
    state.start(prompt)
    out, feed = [], list(prompt)
    try:
        while len(out) < params.max_new_tokens:
            tok = sample_token(state.step(feed)[-1].float(), params, rng)
            out.append(tok)
            if not params.ignore_eos and tok in eos:
                break
            feed = [tok]
    finally:
        state.finish()
    return out


def run_all(engine: Engine, arrivals=None) -> dict[str, list[RequestOutput]]:
    """Step to completion; arrivals = {step index: [(prompt, params), ...]} added before that step.
    Returns every output per request id, in order."""
    arrivals = dict(arrivals or {})
    outs: dict[str, list[RequestOutput]] = {}
    step = 0
    while engine.has_unfinished() or arrivals:
        for prompt, params in arrivals.pop(step, []):
            outs.setdefault(engine.add_request(prompt, params), [])
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        step += 1
        assert step < 2000
    return outs


def check_stream(outs: list[RequestOutput]) -> list[int]:
    """The streamed pieces concatenate to the final token_ids; exactly one final output."""
    assert outs and outs[-1].finished and not any(o.finished for o in outs[:-1])
    streamed = [t for o in outs for t in o.new_token_ids]
    assert streamed == outs[-1].token_ids
    return outs[-1].token_ids


def assert_pool_free(engine: Engine):
    assert engine.check_invariants() == []
    assert engine.num_free_blocks() == engine.num_blocks()
    assert not engine.running and not engine.waiting and not engine.has_unfinished()


# ---- (1) batching: together and staggered ---------------------------------------------------------------

def test_batched_and_staggered_equal_alone(tiny_llama, oracle):
    engine = Engine(tiny_llama, max_batch_size=4, max_num_tokens=64)
    prompts = prompts_of((1, 5, 17, 33, 60, 9, 24), seed=1)
    params = SamplingParams(max_new_tokens=10)
    arrivals = {0: [(p, params) for p in prompts[:3]], 3: [(prompts[3], params)], 4: [(prompts[4], params)],
                7: [(p, params) for p in prompts[5:]]}
    order = [p for k in sorted(arrivals) for p, _ in arrivals[k]]
    outs = run_all(engine, arrivals)
    assert len(outs) == len(prompts)
    for rid, prompt in zip(outs, order):  # dict order = add order
        assert_same_greedy(check_stream(outs[rid]), oracle, prompt, 10, f"prompt of {len(prompt)}")
    assert engine.stats.max_batch == 4  # requests were admitted while others decoded
    assert_pool_free(engine)


def test_generate_keeps_input_order_and_per_request_params(tiny_llama, oracle):
    engine = Engine(tiny_llama, max_batch_size=3, max_num_tokens=32)
    prompts = prompts_of((12, 3, 30, 7), seed=2)
    params = [SamplingParams(max_new_tokens=n) for n in (4, 9, 2, 6)]
    outs = engine.generate(prompts, params)
    for o, p, sp in zip(outs, prompts, params):
        assert o.finished and o.finish_reason in ("length", "stop")
        assert_same_greedy(o.token_ids, oracle, p, sp.max_new_tokens)
    assert_pool_free(engine)


# ---- (2) chunked prefill ----------------------------------------------------------------------------------

def test_chunked_prefill_equals_alone(tiny_llama, oracle):
    engine = Engine(tiny_llama, max_batch_size=4, max_num_tokens=16)
    long_prompt, short = prompts_of((100, 6), seed=3)
    outs = run_all(engine, {0: [(short, SamplingParams(max_new_tokens=12))],
                            1: [(long_prompt, SamplingParams(max_new_tokens=8))]})
    a, b = outs.values()
    assert_same_greedy(check_stream(a), oracle, short, 12, "short")
    assert_same_greedy(check_stream(b), oracle, long_prompt, 8, "long, chunked")
    assert engine.stats.steps >= 100 // 16 + 8
    assert_pool_free(engine)


# ---- (3) preemption by recompute --------------------------------------------------------------------------

def _preemption_workload(oracle):
    prompts = prompts_of((20, 26, 18, 30), seed=4)
    params = [SamplingParams(max_new_tokens=24), SamplingParams(max_new_tokens=24, temperature=1.0, seed=11),
              SamplingParams(max_new_tokens=24, ignore_eos=True), SamplingParams(max_new_tokens=20, temperature=0.8,
                                                                                  top_p=0.9, seed=5, ignore_eos=True)]
    refs = []
    for p, sp in zip(prompts, params):
        if sp.temperature == 0:
            refs.append(greedy_alone(oracle, p, sp.max_new_tokens, sp.ignore_eos)[0])
        else:
            refs.append(sampled_alone(oracle, p, sp))
    return prompts, params, refs


def _run_preempting(tiny_llama, prompts, params):
    # each request alone needs <= 4 blocks of 16; 4 together need 12-14: a pool of 8 forces preemption
    engine = Engine(tiny_llama, max_batch_size=4, max_num_tokens=64, num_blocks=8)
    outs = run_all(engine, {0: list(zip(prompts, params))})
    return engine, [check_stream(o) for o in outs.values()]


def test_preemption_recomputes_and_matches_alone(tiny_llama, oracle):
    prompts, params, refs = _preemption_workload(oracle)
    engine, got = _run_preempting(tiny_llama, prompts, params)
    assert engine.stats.preemptions > 0
    for g, r, p, sp in zip(got, refs, prompts, params):
        if sp.temperature == 0:
            assert_same_greedy(g, oracle, p, sp.max_new_tokens, "preempted greedy", sp.ignore_eos)
        else:
            assert g == r, "preempted sampled request differs from the oracle"
    assert engine.stats.prefix_hit_tokens > 0  # a readmitted request found its own freed full blocks
    assert_pool_free(engine)


def test_preemption_teeth_resume_without_generated_tokens_fails(tiny_llama, oracle, monkeypatch):
    """A wrong resume (the generated tokens dropped from the recompute) is caught by the comparison."""
    prompts, params, refs = _preemption_workload(oracle)
    original = Engine._requeue

    def drop_generated(self, r):
        original(self, r)
        del r.tokens[len(r.prompt):]

    monkeypatch.setattr(Engine, "_requeue", drop_generated)
    engine = Engine(tiny_llama, max_batch_size=4, max_num_tokens=64, num_blocks=8)
    outs = run_all(engine, {0: list(zip(prompts, params))})
    assert engine.stats.preemptions > 0

    def consistent(o, ref):
        return [t for x in o for t in x.new_token_ids] == o[-1].token_ids == ref

    assert not all(consistent(o, r) for o, r in zip(outs.values(), refs))


def test_preemption_teeth_reemitting_streamed_tokens_fails(tiny_llama, oracle, monkeypatch):
    original = Engine._requeue

    def reemit(self, r):
        original(self, r)
        r.num_emitted = 0

    monkeypatch.setattr(Engine, "_requeue", reemit)
    prompts, params, _ = _preemption_workload(oracle)
    with pytest.raises(AssertionError):
        _run_preempting(tiny_llama, prompts, params)  # check_stream: streamed pieces != token_ids


def test_request_that_never_fits_is_aborted_with_a_reason(tiny_llama, oracle):
    engine = Engine(tiny_llama, max_batch_size=2, max_num_tokens=64, num_blocks=3)
    big, small = prompts_of((40, 5), seed=5)
    outs = run_all(engine, {0: [(big, SamplingParams(max_new_tokens=20)), (small, SamplingParams(max_new_tokens=6))]})
    a, b = outs.values()
    assert a[-1].finish_reason == "abort" and a[-1].token_ids == [] and "never hold" in a[-1].reason
    assert "num_blocks" in a[-1].reason
    assert_same_greedy(check_stream(b), oracle, small, 6)
    assert_pool_free(engine)


# ---- (4) abort ----------------------------------------------------------------------------------------------

def test_abort_mid_generation_frees_blocks(tiny_llama, oracle):
    engine = Engine(tiny_llama, max_batch_size=4, max_num_tokens=64)
    prompts = prompts_of((20, 8, 35), seed=6)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=12, ignore_eos=True)) for p in prompts]
    queued = engine.add_request(prompts[0], SamplingParams(max_new_tokens=4))
    engine.abort(queued)  # aborted before it was ever scheduled
    outs = {i: [] for i in ids}
    for _ in range(4):
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    assert outs[queued][-1].finish_reason == "abort" and outs[queued][-1].token_ids == []
    used = engine.num_blocks()["full"] - engine.num_free_blocks()["full"]
    held = len(engine.kv.block_table_row(ids[1], "full"))
    engine.abort(ids[1])
    engine.abort("no-such-request")  # unknown ids are left alone
    step_outs = engine.step()
    aborted = [o for o in step_outs if o.request_id == ids[1]]
    assert len(aborted) == 1 and aborted[0].finished and aborted[0].finish_reason == "abort"
    assert aborted[0].new_token_ids == [] and len(aborted[0].token_ids) == 4  # prefill + 3 decode steps
    for o in step_outs:
        outs[o.request_id].append(o)
    assert ids[1] not in engine.kv.seqs
    assert engine.num_blocks()["full"] - engine.num_free_blocks()["full"] == used - held
    engine.abort(ids[1])  # already finished: nothing happens
    for o in run_all(engine).values():
        outs[o[0].request_id] += o
    for i in (0, 2):
        assert_same_greedy(check_stream(outs[ids[i]]), oracle, prompts[i], 12, ignore_eos=True)
    assert_pool_free(engine)


# ---- (5) finishing rules ------------------------------------------------------------------------------------

def test_stop_rules(tiny_llama, oracle):
    engine = Engine(tiny_llama, max_batch_size=4)
    prompt = prompts_of((9,), seed=7)[0]
    ref, _ = greedy_alone(oracle, prompt, 12, ignore_eos=True)
    assert len(ref) == 12

    def first(tok):
        return ref.index(tok)

    t3 = ref[3]
    stop_tok = engine.generate([prompt], SamplingParams(max_new_tokens=12, stop_token_ids=(t3,), ignore_eos=True))[0]
    assert stop_tok.finish_reason == "stop" and stop_tok.token_ids == ref[:first(t3) + 1]
    seq = (ref[4], ref[5])
    end = next(i for i in range(1, 12) if tuple(ref[i - 1:i + 1]) == seq)
    outs = list(engine.stream(prompt, SamplingParams(max_new_tokens=12, stop_sequences=(seq,), ignore_eos=True)))
    assert outs[-1].finish_reason == "stop" and outs[-1].token_ids == ref[:end - 1]
    assert check_stream(outs) == ref[:end - 1]  # the matched sequence was never streamed
    length = engine.generate([prompt], SamplingParams(max_new_tokens=5, ignore_eos=True))[0]
    assert length.finish_reason == "length" and length.token_ids == ref[:5]
    engine.eos_token_ids = [ref[6]]  # the model's eos, as genai_config would give it
    eos = engine.generate([prompt], SamplingParams(max_new_tokens=12))[0]
    assert eos.finish_reason == "stop" and eos.token_ids == ref[:first(ref[6]) + 1]
    ignored = engine.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    assert ignored.finish_reason == "length" and ignored.token_ids == ref
    assert_pool_free(engine)


def test_context_length_ends_with_length(tiny_llama, oracle):
    engine = Engine(tiny_llama, max_batch_size=2, max_num_tokens=128)
    prompt = prompts_of((engine.max_seq_len - 2,), seed=8)[0]
    out = engine.generate([prompt], SamplingParams(max_new_tokens=10, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3  # prompt + 3 = max_seq_len + 1
    assert_same_greedy(out.token_ids, oracle, prompt, 3, ignore_eos=True)


# ---- (6) sampling -----------------------------------------------------------------------------------------

def test_seeded_sampling(tiny_llama, oracle):
    engine = Engine(tiny_llama, max_batch_size=8)
    prompt = prompts_of((10,), seed=9)[0]
    sp = [SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.95, seed=s, ignore_eos=True) for s in (1, 1, 2, 3)]
    a, b, c, d = engine.generate([prompt] * 4, sp)
    assert a.token_ids == b.token_ids == sampled_alone(oracle, prompt, sp[0])
    assert len({tuple(a.token_ids), tuple(c.token_ids), tuple(d.token_ids)}) > 1
    greedy, _ = greedy_alone(oracle, prompt, 12, ignore_eos=True)
    k1 = engine.generate([prompt], SamplingParams(max_new_tokens=12, temperature=1.5, top_k=1, seed=4,
                                                 ignore_eos=True))[0]
    assert k1.token_ids == greedy
    p_small = engine.generate([prompt], SamplingParams(max_new_tokens=12, temperature=1.0, top_p=1e-6, seed=4,
                                                      ignore_eos=True))[0]
    assert p_small.token_ids == greedy


def test_sample_token_restrictions():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.5, -1.0, 2.9])
    gen = torch.Generator().manual_seed(0)
    k3 = {sample_token(logits, SamplingParams(temperature=2.0, top_k=3), gen) for _ in range(400)}
    assert k3 == {1, 3, 5}
    probs = torch.softmax(logits, 0)  # nucleus 0.6: 1 (p .35), 5 (.31) reach it; 3 (.21) is beyond
    assert probs[1] < 0.6 < probs[1] + probs[5]
    p6 = {sample_token(logits, SamplingParams(temperature=1.0, top_p=0.6), gen) for _ in range(400)}
    assert p6 == {1, 5}
    counts = torch.bincount(torch.tensor([sample_token(logits, SamplingParams(temperature=1.0), gen)
                                          for _ in range(4000)]), minlength=6) / 4000
    assert (counts - probs).abs().max() < 0.04
    assert sample_token(logits, SamplingParams(), gen) == 1


# ---- (8) threads --------------------------------------------------------------------------------------------

def test_add_request_from_another_thread(tiny_llama, oracle):
    engine = Engine(tiny_llama, max_batch_size=4, max_num_tokens=32)
    prompts = prompts_of((7, 19, 4, 28, 11, 2), seed=10)
    ids: list[str] = []
    done = threading.Event()

    def producer():
        for p in prompts:
            ids.append(engine.add_request(p, SamplingParams(max_new_tokens=6)))
            time.sleep(0.003)
        done.set()

    outs: dict[str, list[RequestOutput]] = {}
    t = threading.Thread(target=producer)
    t.start()
    deadline = time.time() + 60
    while (not done.is_set() or engine.has_unfinished()) and time.time() < deadline:
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    t.join()
    assert sorted(outs) == sorted(ids)
    for rid, p in zip(ids, prompts):
        assert_same_greedy(check_stream(outs[rid]), oracle, p, 6)
    assert_pool_free(engine)


# ---- (9) bad input ------------------------------------------------------------------------------------------

def test_bad_inputs_name_the_parameter(tiny_llama, tmp_path):
    engine = Engine(tiny_llama, max_batch_size=2)
    with pytest.raises(ValueError, match="prompt_token_ids must hold at least one"):
        engine.add_request([])
    with pytest.raises(ValueError, match=r"prompt_token_ids has 257 tokens, beyond the model's max_seq_len 256"):
        engine.add_request([5] * 257)
    with pytest.raises(ValueError, match=r"prompt_token_ids must hold token ids in \[0, 144\)"):
        engine.add_request([5, 144])
    with pytest.raises(ValueError, match="SamplingParams.max_new_tokens must be an integer >= 1, got 0"):
        SamplingParams(max_new_tokens=0)
    for bad, field in ((dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_k=-2), "top_k"),
                       (dict(stop_sequences=((),)), "stop_sequences"), (dict(stop_token_ids=(-1,)), "stop_token_ids"),
                       (dict(num_draft_tokens=-1), "num_draft_tokens")):
        with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
            SamplingParams(**bad)
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        engine.add_request([1, 2], {"max_new_tokens": 3})
    rid = engine.add_request([1, 2], request_id="r1")
    with pytest.raises(ValueError, match="request_id 'r1' is already in use"):
        engine.add_request([1, 2], request_id="r1")
    with pytest.raises(ValueError, match="params: expected one SamplingParams per prompt"):
        engine.generate([[1], [2]], [SamplingParams()])
    engine.abort(rid)
    engine.step()
    with pytest.raises(ValueError, match="max_batch_size must be an integer >= 1"):
        Engine(tiny_llama, max_batch_size=0)
    with pytest.raises(ValueError, match="num_blocks must be an integer >= 1"):
        Engine(tiny_llama, num_blocks=0)
    with pytest.raises(ValueError, match="Engine: block_size: "):
        Engine(tiny_llama, block_size=3)
    gqa = tmp_path / "gqa"  # the GQA layout (attention_mask, no block_table) is refused before loading
    gqa.mkdir()
    cfg = json.loads((REPO / "examples/tiny-paged/genai_config.json").read_text())
    inputs = cfg["model"]["decoder"]["inputs"]
    del inputs["block_table"]
    inputs["attention_mask"] = "attention_mask"
    (gqa / "genai_config.json").write_text(json.dumps(cfg))
    shutil.copyfile(REPO / "examples/tiny-paged/model.onnx", gqa / "model.onnx")
    with pytest.raises(ValueError, match="the engine needs the paged layout .*GQA layout"):
        Engine(gqa)


def test_example_folder_runs(tiny_llama):
    """examples/tiny-paged (the model docs/engine.md uses) runs through the engine."""
    engine = Engine(REPO / "examples/tiny-paged", max_batch_size=2)
    outs = engine.generate([[1, 7, 9, 30], [1, 5]], SamplingParams(max_new_tokens=4, ignore_eos=True))
    gen = Generator(REPO / "examples/tiny-paged")
    for o, p in zip(outs, ([1, 7, 9, 30], [1, 5])):
        assert_same_greedy(o.token_ids, gen, p, 4, ignore_eos=True)


def test_step_refuses_concurrent_callers(tiny_llama, monkeypatch):
    engine = Engine(tiny_llama, max_batch_size=2)
    engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=2))
    entered, release = threading.Event(), threading.Event()
    original = engine_mod.Engine._schedule

    def slow(self, outputs):
        entered.set()
        release.wait(10)
        return original(self, outputs)

    monkeypatch.setattr(engine_mod.Engine, "_schedule", slow)
    t = threading.Thread(target=engine.step)
    t.start()
    entered.wait(10)
    with pytest.raises(RuntimeError, match="already running in another thread"):
        engine.step()
    release.set()
    t.join()


# ---- Hugging Face eager as a second oracle ------------------------------------------------------------

def test_batched_greedy_equals_hf_eager(tiny_llama):
    """Engine greedy (batched, chunked prefill, preemption) vs Hugging Face eager float32 on the same
    checkpoint (tiny_model is seeded: the same weights the export holds)."""
    from export_utils import hf_greedy_sequence, tiny_model

    hf = tiny_model("LlamaConfig")
    prompts = prompts_of((4, 23, 41), seed=12)
    engine = Engine(tiny_llama, max_batch_size=3, max_num_tokens=24, num_blocks=5)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert engine.stats.preemptions + engine.stats.unadmitted > 0
    for o, p in zip(outs, prompts):
        ids, logits = hf_greedy_sequence(hf, p, 10)
        ref = ids[len(p):]
        if o.token_ids == ref:
            continue
        i = next(k for k, (a, b) in enumerate(zip(o.token_ids, ref)) if a != b)
        row = torch.from_numpy(logits[len(p) - 1 + i])
        top = torch.topk(row, 2).values
        gap = float(top[0] - top[1]) / float(row.abs().max())
        assert gap < NEAR_TIE, f"prompt of {len(p)}: engine {o.token_ids} vs HF {ref} at step {i} (gap {gap:.3g})"
        ENGINE_NEAR_TIES.append(f"HF oracle, prompt of {len(p)}: near-tie at step {i} (gap {gap:.3g})")
        warnings.warn(ENGINE_NEAR_TIES[-1])


def test_prefix_cache_hits_give_the_same_tokens(tiny_llama, oracle):
    shared = prompts_of((40,), seed=13)[0]
    a, b = (shared + tail for tail in prompts_of((5, 9), seed=14))
    engine = Engine(tiny_llama, max_batch_size=4)
    outs = run_all(engine, {0: [(a, SamplingParams(max_new_tokens=6))], 2: [(b, SamplingParams(max_new_tokens=6))]})
    assert engine.stats.prefix_hit_tokens == 32  # b reuses a's two full blocks of the shared 40 tokens
    for o, p in zip(outs.values(), (a, b)):
        assert_same_greedy(check_stream(o), oracle, p, 6, "prefix hit")
    off = Engine(tiny_llama, max_batch_size=4, enable_prefix_caching=False)
    run_all(off, {0: [(a, SamplingParams(max_new_tokens=6))], 2: [(b, SamplingParams(max_new_tokens=6))]})
    assert off.stats.prefix_hit_tokens == 0 and off.model.prefix_caching_off_reason == "enable_prefix_caching=False"
    assert_pool_free(engine)


def test_abort_from_another_thread(tiny_llama):
    engine = Engine(tiny_llama, max_batch_size=4)
    rids = [engine.add_request(p, SamplingParams(max_new_tokens=200, ignore_eos=True)) for p in prompts_of((5, 9))]
    seen: dict[str, list[RequestOutput]] = {}
    started = threading.Event()

    def aborter():
        started.wait(10)
        for r in rids:
            engine.abort(r)

    t = threading.Thread(target=aborter)
    t.start()
    for _ in range(400):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            seen.setdefault(o.request_id, []).append(o)
        started.set()
    t.join()
    for r in rids:
        assert seen[r][-1].finish_reason == "abort" and len(seen[r][-1].token_ids) < 200
        check_stream(seen[r])
    assert_pool_free(engine)


def test_a_step_of_more_tokens_than_the_context_runs_on_the_cpu(tiny_llama, oracle):
    """32 prompts prefilled in one step of more tokens than the model's context (onnxruntime's RotaryEmbedding
    refuses one row of T positions longer than its cos / sin tables: each token is its own row), each
    request's tokens equal to running it alone."""
    engine = Engine(tiny_llama, max_batch_size=32, max_num_tokens=2048)
    prompts = prompts_of([12] * 32, seed=31)
    assert sum(map(len, prompts)) > engine.max_seq_len
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert engine.stats.max_batch == 32 and engine.stats.steps <= 4  # the prefill was one step
    for p, o in zip(prompts, outs):
        assert_same_greedy(o.token_ids, oracle, p, 3, "one long step", ignore_eos=True)
    assert_pool_free(engine)
