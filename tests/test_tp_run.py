"""Tensor parallelism on the CPU: `paged-export --tp 2` run on two gloo processes (pagedkit.runtime.distributed)
gives the logits of the single-device export within 1e-3 x max|ref| and the same greedy tokens (fp32 exports,
tests/tp_harness.py), for Llama (KV heads split), Mixtral and GPT-OSS (MoE experts cut along their intermediate
dimension; GPT-OSS: sinks, biases on every projection and expert, alternating windowed layers), DeepSeek-V2 (MLA:
query heads split, the latent cache replicated; MoE with shared experts) and Qwen2 with one KV head (replicated
on both ranks; a vocabulary of 145 rows: the last rank's LM head slice padded). The teeth: an all-reduce removed
from one layer, the two ranks' files swapped, or the query heads of the ranks swapped (K / V kept) fail it.

One set of two processes serves every test of the module (each test loads its model on it, then drops it).
"""

from __future__ import annotations

import json
import shutil

import pytest

import tp_harness as H

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

MOE = (("num_local_experts", 4), ("num_experts_per_tok", 2))
CASES = {
    "llama": H.Case("LlamaConfig"),
    "mixtral": H.Case("MixtralConfig", MOE + (("sliding_window", 8),), seed=11),
    "gpt_oss": H.Case("GptOssConfig", MOE + (("sliding_window", 8),), seed=7),
    "qwen2-one-kv-head": H.Case("Qwen2Config", (("num_key_value_heads", 1), ("vocab_size", 145)), seed=3),
}


@pytest.fixture(scope="module")
def tp():
    from pagedkit.runtime.distributed import TensorParallel

    with TensorParallel(2, timeout=60, threads=1) as s:
        yield s


# every other family plan.SUPPORTED names, with its export test's features (window, QK-norm, shared experts with a
# gate, dense layers among MoE ones, softcaps and sandwich norms, multipliers, fused qkv / gate_up and a tied head)
MORE = {
    "mistral": H.Case("MistralConfig", (("sliding_window", 8),), seed=1),
    "qwen3": H.Case("Qwen3Config", seed=2),
    "qwen2_moe": H.Case("Qwen2MoeConfig", (("num_hidden_layers", 3), ("num_experts", 4), ("num_experts_per_tok", 2),
                                           ("moe_intermediate_size", 32), ("shared_expert_intermediate_size", 48),
                                           ("norm_topk_prob", False), ("mlp_only_layers", [1])), seed=5),
    "qwen3_moe": H.Case("Qwen3MoeConfig", (("num_experts", 4), ("num_experts_per_tok", 2),
                                           ("moe_intermediate_size", 32), ("norm_topk_prob", True),
                                           ("decoder_sparse_step", 2)), seed=7),
    "gemma": H.Case("GemmaConfig", (("hidden_act", "gelu"), ("hidden_activation", "gelu"),
                                    ("attention_bias", True)), seed=4),
    "granite": H.Case("GraniteConfig", (("embedding_multiplier", 3.0), ("residual_multiplier", 0.5),
                                        ("attention_multiplier", 0.1), ("logits_scaling", 4.0),
                                        ("attention_bias", True), ("mlp_bias", True)), seed=5),
    "phi3": H.Case("Phi3Config", (("tie_word_embeddings", True),), seed=1),
}


def _model(name: str):
    if name == "deepseek-v2":
        from test_export_deepseek import V2, deepseek

        return deepseek("DeepseekV2Config", seed=11, **V2)
    if name == "gemma2":
        from test_export_gemma2 import tiny_gemma2

        return tiny_gemma2()
    return (CASES | MORE)[name].model()


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    made = {}

    def get(name: str):
        if name not in made:
            hf = _model(name)
            made[name] = (hf, *H.export_pair(hf, tmp_path_factory.mktemp(name)))
        return made[name]

    return get


@pytest.mark.parametrize("name", [*CASES, "deepseek-v2"])
def test_tp2_matches_single_device(tp, exports, name):
    _, one, two = exports(name)
    ref = H.reference(one)
    worst = H.compare(ref, H.run_set(tp, two, [r.token for r in ref]))
    print(f"{name}: TP=2 vs TP=1 worst max|diff|/max|ref| {worst:.3g}")


@pytest.mark.parametrize("name", [*MORE, "gemma2"])
def test_tp2_other_families(tp, exports, name):
    _, one, two = exports(name)
    ref = H.reference(one)
    print(f"{name}: worst {H.compare(ref, H.run_set(tp, two, [r.token for r in ref])):.3g}")


def test_tp2_on_torch_kernels(tp, exports):
    """The same on pagedkit's own kernels everywhere (no onnxruntime segments between the collectives)."""
    _, one, two = exports("llama")
    ref = H.reference(one, cpu_backend="torch")
    H.compare(ref, H.run_set(tp, two, [r.token for r in ref], cpu_backend="torch"))


def test_rank_graphs(exports):
    """What each rank holds: its heads and KV heads, one all-reduce after each attention and feed-forward block,
    the vocabulary gathered once."""
    import onnx

    hf, _, two = exports("qwen2-one-kv-head")
    cfg = json.loads((two / "genai_config.json").read_text())
    section = json.loads(cfg["pagedkit"])["tensor_parallel"]
    assert section["world_size"] == 2 and section["ranks"] == ["rank_0/model.onnx", "rank_1/model.onnx"]
    assert section["kv_heads"] == "replicated x2" and section["vocab_per_rank"] == 73
    assert cfg["model"]["decoder"]["num_key_value_heads"] == 1 and cfg["model"]["vocab_size"] == 145
    for r in range(2):
        m = onnx.load(str(two / f"rank_{r}" / "model.onnx"))
        ops = [n.op_type for n in m.graph.node]
        assert ops.count("AllReduce") == 2 * hf.config.num_hidden_layers and ops.count("AllGather") == 1
        attn = [n for n in m.graph.node if n.op_type == "PagedAttention"]
        heads = {a.name: a.i for a in attn[0].attribute if a.name in ("num_heads", "kv_num_heads")}
        assert heads == {"num_heads": 2, "kv_num_heads": 1}
        key = next(i for i in m.graph.input if i.name == "past_key_values.0.key")
        assert key.type.tensor_type.shape.dim[2].dim_value == 1


# ---- teeth ---------------------------------------------------------------------------------------------------

def _fails(tp, one, bad):
    ref = H.reference(one)
    with pytest.raises(AssertionError, match="max\\|diff\\|") as exc:
        H.compare(ref, H.run_set(tp, bad, [r.token for r in ref]))
    return str(exc.value)


def test_teeth_all_reduce_removed_from_one_layer(tp, exports, tmp_path, monkeypatch):
    from pagedkit.exporters.families.base import ExportOptions
    from pagedkit.exporters.tp import build
    from pagedkit.exporters.tp.export import export_tp_model

    hf, one, _ = exports("llama")
    real = build.all_reduce
    monkeypatch.setattr(build, "all_reduce", lambda g, x, name: x if name == "/model/layers.1/mlp/AllReduce"
                        else real(g, x, name))
    export_tp_model(hf, tmp_path / "bad", ExportOptions(dtype="fp32", progress=False), tp=2)
    print("all-reduce removed:", _fails(tp, one, tmp_path / "bad"))


def test_teeth_rank_files_swapped(tp, exports, tmp_path):
    _, one, two = exports("llama")
    bad = tmp_path / "bad"
    shutil.copytree(two, bad)
    cfg = json.loads((bad / "genai_config.json").read_text())
    section = json.loads(cfg["pagedkit"])
    section["tensor_parallel"]["ranks"].reverse()
    cfg["pagedkit"] = json.dumps(section)
    (bad / "genai_config.json").write_text(json.dumps(cfg))
    print("rank files swapped:", _fails(tp, one, bad))


def test_teeth_query_heads_swapped(tp, exports, tmp_path, monkeypatch):
    """Each rank's query heads (q rows, o columns, sinks) are the other rank's, its K / V heads its own."""
    from pagedkit.exporters.families.base import ExportOptions
    from pagedkit.exporters.tp import plan
    from pagedkit.exporters.tp.export import export_tp_model

    hf, one, _ = exports("llama")
    real = plan.ShardPlan.unit_range
    monkeypatch.setattr(plan.ShardPlan, "unit_range", lambda self, kind, units, rank:
                        real(self, kind, units, self.world - 1 - rank if kind == plan.Q else rank))
    export_tp_model(hf, tmp_path / "bad", ExportOptions(dtype="fp32", progress=False), tp=2)
    print("query heads swapped:", _fails(tp, one, tmp_path / "bad"))


def test_tp2_int4_matches_single_device_int4(tp, tmp_path):
    """int4 weights (MatMulNBits, blocks of 32): every row-parallel shard holds whole blocks, so each rank's
    quantized weights are exactly the single-device model's rows (tests/test_tp_export.py checks the bytes); with
    accuracy_level 0 (float32 activations) only the sums' order differs. (At accuracy_level 4 onnxruntime also
    quantizes the activations to int8, per product: the cut products differ by that quantization, 2.6e-2 here.)"""
    from pagedkit.exporters.export import export_hf_model
    from pagedkit.exporters.families.base import ExportOptions
    from pagedkit.exporters.tp.export import export_tp_model

    hf = H.Case("LlamaConfig", (("intermediate_size", 128),), seed=4).model()
    opts = dict(dtype="fp32", progress=False)
    export_hf_model(hf, tmp_path / "one", ExportOptions(**opts), weight_format="int4", int4_accuracy_level=0)
    export_tp_model(hf, tmp_path / "two", ExportOptions(**opts), tp=2, weight_format="int4", int4_accuracy_level=0)
    ref = H.reference(tmp_path / "one")
    print("int4:", H.compare(ref, H.run_set(tp, tmp_path / "two", [r.token for r in ref])))


def _forked_step(session_or_none, folder):
    """Logits of a decode step of a sequence forked from a 19-token prefill (its last block shared, then copied on
    write by the KV manager: a block copy every rank must make on its own caches)."""
    from pagedkit.runtime.generate import Generator, step_feeds

    gen = Generator(folder, session=session_or_none, max_seq_len=64, cpu_backend="auto")
    st, sess = gen.state, gen.session
    mgr = st.mgr

    def run(seq, ids):
        plan = mgr.plan([(seq, ids)])
        feeds = step_feeds(plan, mgr, ids, st.renames, st.input_names, gen.config.input("input_ids"))
        out = sess.run_torch(feeds, [gen.logits_name], plan=plan.hint, distinct_slots=True)[gen.logits_name]
        mgr.commit(plan)
        return out[-1].float()

    mgr.add_sequence(1, H.PROMPT)
    run(1, H.PROMPT)
    mgr.fork(1, 2)
    copies = []
    real = mgr.blocks["full"].copy_block
    mgr.blocks["full"].copy_block = lambda s, d: (copies.append((s, d)), real(s, d))
    out = run(2, [7])
    assert copies, "the fork's decode step made no block copy"
    return out


def test_block_copies_reach_every_rank(tp, exports, monkeypatch):
    """A copy-on-write block copy rank 0's KV manager makes is made by the follower too (DistributedSession.
    mirror_copies); without it the follower's copy of the block would be missing the prefix's keys."""
    from pagedkit.runtime.distributed.session import DistributedSession

    _, one, two = exports("llama")
    ref = _forked_step(None, one)
    scale = float(ref.abs().max())
    session = tp.session(two, cpu_backend="auto")
    try:
        got = _forked_step(session, two)
    finally:
        session.close()
    assert float((got - ref).abs().max()) <= H.TOL * scale
    monkeypatch.setattr(DistributedSession, "mirror_copies", lambda self, mgr: None)  # the teeth
    session = tp.session(two, cpu_backend="auto")
    try:
        bad = _forked_step(session, two)
    finally:
        session.close()
    print("forked step without mirrored copies:", float((bad - ref).abs().max()) / scale)
    assert float((bad - ref).abs().max()) > 10 * H.TOL * scale
