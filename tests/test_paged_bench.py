"""paged-bench (pagedkit/apps/bench) on the CPU over a tiny random Llama export: the JSON it writes,
the floor arithmetic against an independent count, skipped rows and arms, the plot, bad arguments; and
the ORT arm's loop (plans, in-place caches, greedy tokens, parity) driven by a stand-in runner that runs
pagedkit's own session, since onnxruntime's PagedAttention is CUDA-only (the real OrtRunner is not run
here)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from pagedkit.apps.bench import cli, ort_arm

ARGS = ["--device", "cpu", "--batches", "1", "2", "--contexts", "32", "64", "--decode-steps", "4", "--no-progress"]


@pytest.fixture(scope="module")
def bench(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-out")
    rc = cli.main([str(tiny_llama), *ARGS, "--contexts", "32", "64", "1000", "--out", str(out)])
    assert rc == 0
    return json.loads((out / "paged_bench.json").read_text()), out


def _independent_counts(model_dir: Path):
    model = onnx.load(str(model_dir / "model.onnx"))
    weights = sum(numpy_helper.to_array(t).nbytes for t in model.graph.initializer)
    cfg = json.loads((model_dir / "genai_config.json").read_text())["model"]["decoder"]
    kv_per_token = cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * 2 * cfg["head_size"] * 2  # K+V fp16
    return weights, kv_per_token


def test_json_fields(bench):
    result, out = bench
    for key in ("command", "device", "device_name", "date", "versions", "pagedkit_commit", "model", "settings",
                "arms", "rows"):
        assert key in result, key
    assert result["command"].startswith("paged-bench ")
    assert result["device"] == "cpu"
    assert {"torch", "onnxruntime"} <= set(result["versions"])
    assert result["model"]["layers"] == 2 and result["model"]["heads"] == 4 and result["model"]["kv_heads"] == 2
    assert result["model"]["dtype"] == "float16"
    assert result["arms"]["pagedkit"]["cuda_graphs"] is False
    assert result["arms"]["ort"]["cuda_graph"] is False
    assert [(r["batch"], r["context"]) for r in result["rows"]] == [(b, c) for c in (32, 64, 1000) for b in (1, 2)]
    assert (out / "paged_bench.png").stat().st_size > 1000


def test_pagedkit_arm_positive(bench):
    result, _ = bench
    rows = [r for r in result["rows"] if "skipped" not in r]
    assert len(rows) == 4
    for r in rows:
        pk = r["arms"]["pagedkit"]
        assert r["prompt_tokens"] == r["context"] - 4
        for k in ("ms_per_step", "tokens_per_s", "ttft_ms", "fraction_of_floor"):
            assert pk[k] > 0, (k, r)
        assert pk["decode_tokens"] == r["batch"] * 4
        assert pk["min_sequences_per_step"] == r["batch"]
        assert r["pagedkit_over_ort"] is None


def test_ort_arm_skipped_naming_cuda(bench):
    result, _ = bench
    assert result["arms"]["ort"]["ran"] is False
    assert "CUDA" in result["arms"]["ort"]["skipped"]
    for r in result["rows"]:
        if "skipped" not in r:
            assert "CUDA" in r["arms"]["ort"]["skipped"]


def test_floor_arithmetic(bench, tiny_llama):
    result, _ = bench
    weights, kv_per_token = _independent_counts(tiny_llama)
    assert result["model"]["weight_bytes"] == weights
    for r in result["rows"]:
        if "skipped" in r:
            continue
        f = r["floor"]
        kv = r["batch"] * r["context"] * kv_per_token
        assert (f["weight_bytes"], f["kv_bytes"], f["bytes_per_step"]) == (weights, kv, weights + kv)
        assert f["ms_per_step"] == pytest.approx((weights + kv) / 4.4e12 * 1e3)
        assert f["tokens_per_s"] == pytest.approx(r["batch"] / ((weights + kv) / 4.4e12))
        pk = r["arms"]["pagedkit"]
        assert pk["fraction_of_floor"] == pytest.approx(pk["tokens_per_s"] / f["tokens_per_s"])


def test_prefill_floor_arithmetic(bench):
    """The prefill floor from the HF config's dimensions (tests/export_utils.TINY), counted by hand: every product of a
    token (q, k, v, o, gate, up, down), the tied LM head for one row a prompt, causal attention, one weight read."""
    from export_utils import TINY

    h, inter, layers, heads, kv, d, vocab = (TINY[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                                "num_attention_heads", "num_key_value_heads", "head_dim",
                                                                "vocab_size"))
    per_token = layers * (h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * inter)
    result, _ = bench
    weights = result["model"]["weight_bytes"]
    for r in result["rows"]:
        if "skipped" in r:
            continue
        b, t = r["batch"], r["prompt_tokens"]
        attention = b * layers * 4 * heads * d * t * (t + 1) // 2
        flops = 2 * per_token * b * t + 2 * h * vocab * b + attention
        f = r["prefill_floor"]
        assert (f["flops"], f["attention_flops"], f["weight_bytes"]) == (flops, attention, weights)
        assert f["ms"] == pytest.approx((flops / 790e12 + weights / 4.4e12) * 1e3)


def test_prefill_floor_of_windowed_layers_and_experts():
    from pagedkit.apps.bench import floor

    layers = [floor.CacheLayer(0, 1), floor.CacheLayer(1, 1, window=3)]
    f = floor.prefill_floor(0, (10, 7), layers, 2, 4, batch=2, tokens=7)
    seen = (1 + 2 + 3 + 4 + 5 + 6 + 7) + (1 + 2 + 3 + 3 + 3 + 3 + 3)  # a query sees min(i, window) keys
    assert f["attention_flops"] == 2 * 4 * 2 * 4 * seen
    assert f["flops"] == 2 * 10 * 2 * 7 + 2 * 7 * 2 + f["attention_flops"]


def test_moe_floor_counts_the_experts_a_step_touched(tmp_path, monkeypatch):
    """A MoE model's decode floor reads the routed experts its real rows chose, not every expert: at batch 1
    exactly k of E (a token's top-k are distinct), so the weight bytes are all of them less (1 - k/E) of every
    per-expert initializer, counted here from the file by hand; at batch 2 between k and min(E, 2k)."""
    from export_utils import export_tiny, tiny_model

    monkeypatch.setenv("PAGEDKIT_CPU_BACKEND", "torch")  # the MoE nodes run in pagedkit's session, as on CUDA
    export_tiny(tiny_model("MixtralConfig", num_local_experts=4, num_experts_per_tok=2, intermediate_size=48),
                tmp_path / "m")
    out = tmp_path / "out"
    assert cli.main([str(tmp_path / "m"), "--device", "cpu", "--batches", "1", "2", "--contexts", "32",
                     "--decode-steps", "3", "--no-progress", "--out", str(out)]) == 0
    result = json.loads((out / "paged_bench.json").read_text())
    model = onnx.load(str(tmp_path / "m" / "model.onnx"))
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    moe = [n for n in model.graph.node if n.op_type == "MoE"]
    assert len(moe) == 2
    per_expert = sum(inits[i].nbytes for n in moe for i in n.input[2:] if i in inits and inits[i].shape[0] == 4)
    everything = sum(a.nbytes for a in inits.values())
    rows = {r["batch"]: r for r in result["rows"]}
    f1, f2 = rows[1]["floor"], rows[2]["floor"]
    assert f1["weight_bytes_all"] == everything and f1["experts_touched"]["mean_per_node"] == 2
    assert f1["weight_bytes"] == everything - per_expert // 2
    assert f1["bytes_per_step"] == f1["weight_bytes"] + f1["kv_bytes"]
    assert 2 <= f2["experts_touched"]["mean_per_node"] <= 4
    assert everything - per_expert // 2 <= f2["weight_bytes"] <= everything
    # the prefill floor's products: every MatMul weight but the head, the experts' k / E share, the head apart
    from pagedkit.apps.bench import floor

    head = next(n for n in model.graph.node if n.op_type == "MatMul" and n.name.startswith("/lm_head/"))
    mats = sum(inits[n.input[1]].size for n in model.graph.node
               if n.op_type == "MatMul" and n.input[1] in inits and n is not head)
    experts = sum(inits[i].size for n in moe for i in (n.input[2], n.input[4]))  # fc1, fc2 [E, ...]
    assert floor.product_weights(tmp_path / "m" / "model.onnx") == (mats + experts * 2 // 4, inits[head.input[1]].size)
    pk = rows[1]["arms"]["pagedkit"]
    assert "experts_touched" not in pk
    assert pk["fraction_of_floor"] == pytest.approx(pk["tokens_per_s"] / f1["tokens_per_s"])


def test_touched_experts_reads_the_real_rows_of_decode_calls():
    import torch

    from pagedkit.apps.bench import floor

    log = {"a": [torch.tensor([[0, 1], [2, 3], [5, 6]]),  # a decode call padded to 3 rows: the pad row is not counted
                 torch.tensor([[0, 1], [1, 0], [7, 7]]),
                 torch.arange(40).reshape(20, 2)],  # a prefill call (20 rows): not a decode step
           "b": [torch.tensor([[4, 5]])]}  # only a call of another size
    got = floor.touched_experts(log, batch=2, sizes={2, 3})
    assert got == {"a": (4 + 2) / 2}
    experts = {"a": (800, 8), "b": (100, 4)}
    assert floor.weights_read(1000, experts, got) == 1000 - round(800 * (1 - 3 / 8))


def test_context_beyond_length_skipped(bench):
    result, _ = bench
    skipped = [r for r in result["rows"] if r["context"] == 1000]
    assert len(skipped) == 2
    assert all("exceeds the model's context_length 256" in r["skipped"] for r in skipped)


@pytest.mark.parametrize("argv, expected", [
    (["--batches", "0"], "--batches: expected integers >= 1, got 0"),
    (["--contexts", "-4"], "--contexts: expected integers >= 1, got -4"),
    (["--decode-steps", "0"], "--decode-steps: expected an integer >= 1, got 0"),
    (["--arms", "vllm"], "--arms: expected some of pagedkit ort genai, got 'vllm'"),
])
def test_bad_arguments(tiny_llama, tmp_path, capsys, argv, expected):
    assert cli.main([str(tiny_llama), "--device", "cpu", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"paged-bench: error: {expected}"]


def test_folder_without_model(tiny_llama, tmp_path, capsys):
    (tmp_path / "genai_config.json").write_text((tiny_llama / "genai_config.json").read_text())
    assert cli.main([str(tmp_path), "--device", "cpu", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no model.onnx" in err[0] and "Traceback" not in err[0]
    assert cli.main([str(tmp_path / "missing"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a folder" in err[0]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main([str(empty), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "genai_config.json" in err[0]


class PagedkitAsOrt:
    """Stands in for OrtRunner on the CPU: the same `run(feeds, outputs)` contract (outputs filled in
    place, present caches = the past tensors), served by pagedkit's session of the engine."""

    cuda_graph = False
    version = "stand-in"

    def __init__(self, pm):
        self.pm = pm
        self.input_names = set(pm.input_names)
        self.output_types = {o.name: o.type for o in pm.session.get_outputs()}
        self.calls = 0

    def run(self, feeds, outputs):
        past = self.pm.mgr.cache_feeds()
        for name, t in outputs.items():  # the present outputs alias the bound past inputs
            if name != self.pm.logits_name:
                assert any(t is p for p in past.values()), name
        out = self.pm.session.run_torch(feeds, [self.pm.logits_name])[self.pm.logits_name]
        outputs[self.pm.logits_name].copy_(out.reshape(outputs[self.pm.logits_name].shape))
        self.calls += 1


def test_ort_arm_loop_with_stand_in_runner(tiny_llama, tmp_path, monkeypatch):
    """The whole CLI with both arms, the ORT arm's runner replaced: rows get ratios and a parity check
    whose greedy tokens agree (the same session computes both), and the pool is left empty."""
    made = []

    def runner(model_path, host_inputs, cuda_graph=False):
        assert host_inputs == {"attention_metadata"}
        if cuda_graph:  # this stand-in has no graph mode: refused at creation, the CLI falls back to plain runs
            raise RuntimeError("stand-in: no CUDA graph")
        made.append(PagedkitAsOrt(engine_model[0]))
        return made[-1]

    engine_model = []  # the PagedModel of the Engine the CLI builds (cli imports Engine at run time)
    from pagedkit import engine as engine_pkg

    orig = engine_pkg.Engine

    class Recording(orig):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            engine_model.append(self.model)

    monkeypatch.setattr(engine_pkg, "Engine", Recording)
    monkeypatch.setattr(ort_arm, "unavailable", lambda device: None)
    monkeypatch.setattr(ort_arm, "OrtRunner", runner)
    assert cli.main([str(tiny_llama), *ARGS, "--out", str(tmp_path), "--max-num-tokens", "40"]) == 0
    result = json.loads((tmp_path / "paged_bench.json").read_text())
    assert result["arms"]["ort"]["ran"] is True and "skipped" not in result["arms"]["ort"]
    assert made and made[0].calls > 0
    assert result["arms"]["ort"]["cuda_graph"] is False
    for r in result["rows"]:
        ort = r["arms"]["ort"]
        assert ort["tokens_per_s"] > 0 and ort["ttft_ms"] > 0 and ort["decode_tokens"] == r["batch"] * 4
        assert r["pagedkit_over_ort"] == pytest.approx(r["arms"]["pagedkit"]["tokens_per_s"] / ort["tokens_per_s"])
        assert r["parity"]["equal"], r["parity"]
        if r["batch"] * r["prompt_tokens"] > 40:
            assert ort["prefill_steps"] > 1 and r["arms"]["pagedkit"]["prefill_steps"] > 1  # chunked
    pm = engine_model[0]
    assert not pm.mgr.seqs and pm.mgr.check_invariants() == []


def test_parity_reports_mismatch():
    rep = ort_arm.parity([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]], steps=2)
    assert rep["equal"] is False and rep["mismatched_requests"] == [1]
    assert rep["first_mismatch_position"] == {"1": 1}


def test_kv_bytes_quantized_and_latent():
    from pagedkit.apps.bench import floor
    from pagedkit.runtime.kv.config import LayerCacheSpec

    assert floor.layer_kv_bytes_per_token(LayerCacheSpec(0, 8, 128, "float16")) == 8 * 2 * 128 * 2
    assert floor.layer_kv_bytes_per_token(LayerCacheSpec(0, 8, 128, "int8", "float32", "float32")) == 8 * 2 * 128 + 8 * 2 * 4
    assert floor.layer_kv_bytes_per_token(LayerCacheSpec(0, 8, 128, "int4", "float16", "float16")) == 8 * 2 * 64 + 8 * 2 * 2
    assert floor.layer_kv_bytes_per_token(LayerCacheSpec(0, 1, 576, "float16", latent=True)) == 576 * 2
    layers = [floor.CacheLayer(0, 100), floor.CacheLayer(1, 100, window=16)]
    assert floor.kv_bytes(layers, 2, 64) == 2 * (64 * 100 + 16 * 100)
    assert np.isclose(floor.floor_row(1000, layers, 2, 64)["ms_per_step"], (1000 + 2 * 8000) / 4.4e12 * 1e3)


def test_ort_refusal_skips_the_arm(tiny_llama, tmp_path, monkeypatch, capsys):
    """onnxruntime refusing the model at session creation: the arm is skipped with that reason, printed."""
    def refuse(model_path, host_inputs, cuda_graph=False):
        raise RuntimeError("Could not find an implementation for PagedAttention(1) node with name 'attn_0'")

    monkeypatch.setattr(ort_arm, "unavailable", lambda device: None)
    monkeypatch.setattr(ort_arm, "OrtRunner", refuse)
    args = ["--device", "cpu", "--batches", "1", "--contexts", "32", "--decode-steps", "2", "--no-progress"]
    assert cli.main([str(tiny_llama), *args, "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "paged_bench.json").read_text())
    reason = result["arms"]["ort"]["skipped"]
    assert reason.startswith("onnxruntime refused the model: RuntimeError: Could not find an implementation")
    assert result["rows"][0]["arms"]["ort"] == {"skipped": reason}
    assert result["rows"][0]["arms"]["pagedkit"]["tokens_per_s"] > 0
    assert "ort arm skipped: onnxruntime refused the model" in capsys.readouterr().err


def test_chunked_prefill_rows_leave_headroom_for_the_early_requests():
    """With a chunked prefill, the first requests decode while later ones prefill: their prompts are shortened by
    the prefill's steps so every timed step still decodes all B sequences within the context."""
    from pagedkit.apps.bench.engine_arm import Row, with_headroom

    assert with_headroom(Row(1, 4096, 32), 16384) == Row(1, 4096, 32)  # one prefill step: nothing to leave
    r = with_headroom(Row(32, 4096, 32), 16384)
    assert r.headroom == -(-32 * 4064 // (16384 - 32)) == 8 and r.prompt_tokens == 4056


class PagedkitAsOrtGraph(PagedkitAsOrt):
    """The stand-in in onnxruntime's CUDA-graph mode: keyed decode runs must bind the same buffers every step of
    a key (a replay reads fixed addresses) with the replay-wide metadata of the key."""

    cuda_graph = True

    def __init__(self, pm):
        super().__init__(pm)
        self.keys, self.plain, self.kept = {}, 0, {}

    def run(self, feeds, outputs, graph_key=None):
        if graph_key is None:
            self.plain += 1
        else:
            ptrs = {n: t.data_ptr() for n, t in (feeds | outputs).items()}
            assert self.keys.setdefault(graph_key, ptrs) == ptrs, f"buffers moved within graph key {graph_key}"
            assert feeds["attention_metadata"].tolist() == [1, graph_key[1], 0]
        super().run(feeds, outputs)


def test_ort_arm_graph_mode_binds_fixed_buffers_per_key(tiny_llama, tmp_path, monkeypatch):
    made = []
    from pagedkit import engine as engine_pkg

    orig, engine_model = engine_pkg.Engine, []

    class Recording(orig):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            engine_model.append(self.model)

    def runner(model_path, host_inputs, cuda_graph=False):
        made.append((PagedkitAsOrtGraph if cuda_graph else PagedkitAsOrt)(engine_model[0]))
        return made[-1]

    monkeypatch.setattr(engine_pkg, "Engine", Recording)
    monkeypatch.setattr(ort_arm, "unavailable", lambda device: None)
    monkeypatch.setattr(ort_arm, "OrtRunner", runner)
    assert cli.main([str(tiny_llama), *ARGS, "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "paged_bench.json").read_text())
    (r,) = made
    assert isinstance(r, PagedkitAsOrtGraph) and r.keys and r.plain > 0  # prefills plain, decodes keyed
    assert result["arms"]["ort"]["cuda_graph"] is True
    for row in result["rows"]:
        assert row["parity"]["equal"], row["parity"]  # the same logits as the engine through the graph path


def test_teeth_graph_buffers_made_per_row_are_caught(tiny_llama, tmp_path, monkeypatch):
    """Buffers kept per row instead of per runner would move under a captured graph: the row fails, named."""
    from pagedkit import engine as engine_pkg

    orig, engine_model = engine_pkg.Engine, []

    class Recording(orig):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            engine_model.append(self.model)

    class Forgetful(PagedkitAsOrtGraph):
        kept = property(lambda self: {}, lambda self, v: None)  # a fresh dict at every row

    monkeypatch.setattr(engine_pkg, "Engine", Recording)
    monkeypatch.setattr(ort_arm, "unavailable", lambda device: None)
    monkeypatch.setattr(ort_arm, "OrtRunner", lambda p, h, cuda_graph=False: Forgetful(engine_model[0]))
    assert cli.main([str(tiny_llama), *ARGS, "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "paged_bench.json").read_text())
    assert all("buffers moved" in r["arms"]["ort"]["skipped"] for r in result["rows"])


def test_engine_arm_with_overlap_times_full_decode_steps(tiny_llama):
    """With overlap (one step of lookahead), the row's prompts leave one more step of headroom, every timed
    step() returns the B tokens of a step, and the tokens equal the synchronous engine's."""
    from pagedkit.apps.bench.engine_arm import Row, prompts_for, run_row, with_headroom
    from pagedkit.engine import Engine

    row = with_headroom(Row(3, 64, 8), 4096, lookahead=1)
    assert row.headroom == 1 and row.prompt_tokens == 64 - 8 - 1
    prompts = prompts_for(row, 144, seed=1)
    recs = {}
    for overlap in (False, True):
        eng = Engine(tiny_llama, max_batch_size=4, max_num_tokens=256, enable_prefix_caching=False,
                     cuda_graphs="padded", overlap=overlap)
        recs[overlap] = run_row(eng, row, prompts, "cpu")
        assert eng.check_invariants() == []
    rec = recs[True]
    assert rec["overlap"] and rec["overlapped_steps"] >= row.decode_steps
    assert rec["decode_tokens"] == row.batch * row.decode_steps and rec["min_sequences_per_step"] == row.batch
    n = row.decode_steps + 1
    assert [t[:n] for t in rec["tokens"]] == [t[:n] for t in recs[False]["tokens"]]
    assert all(len(t) >= n for t in rec["tokens"])


def test_repeats_interleave_the_arms_and_combine(tiny_llama, tmp_path, monkeypatch):
    """--repeats 3: each arm runs the row 3 times, the arms interleaved; tokens/s = all tokens / all time
    (recomputed here from the per-repeat figures), the step and the TTFT = the medians of the repeats; the ORT arm
    reports its run time alone (run_ms, at most its step)."""
    order = []
    monkeypatch.setattr(ort_arm, "unavailable", lambda device: None)
    from pagedkit import engine as engine_pkg
    from pagedkit.apps.bench import engine_arm

    models = []
    orig_engine = engine_pkg.Engine

    class Recording(orig_engine):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            models.append(self.model)

    def runner(model_path, host_inputs, cuda_graph=False):
        if cuda_graph:
            raise RuntimeError("stand-in: no CUDA graph")
        return PagedkitAsOrt(models[0])

    real_pk, real_ort = engine_arm.run_row, ort_arm.run_row
    monkeypatch.setattr(engine_pkg, "Engine", Recording)
    monkeypatch.setattr(ort_arm, "OrtRunner", runner)
    monkeypatch.setattr(engine_arm, "run_row", lambda *a, **k: order.append("pagedkit") or real_pk(*a, **k))
    monkeypatch.setattr(ort_arm, "run_row", lambda *a, **k: order.append("ort") or real_ort(*a, **k))
    argv = [str(tiny_llama), "--device", "cpu", "--batches", "2", "--contexts", "32", "--decode-steps", "4",
            "--no-progress", "--repeats", "3", "--warmup", "1", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    assert order == ["pagedkit", "pagedkit", "ort", "ort", "pagedkit", "ort", "pagedkit", "ort"]  # warm-up first
    result = json.loads((tmp_path / "paged_bench.json").read_text())
    assert result["settings"]["repeats"] == 3
    (row,) = result["rows"]
    for name, arm in row["arms"].items():
        reps = arm["repeats"]
        assert len(reps) == 3 and arm["decode_tokens"] == 3 * 2 * 4
        total = sum(2 * 4 / r["tokens_per_s"] for r in reps)
        assert arm["tokens_per_s"] == pytest.approx(arm["decode_tokens"] / total)
        assert arm["ms_per_step"] == pytest.approx(sorted(r["ms_per_step"] for r in reps)[1])
        assert arm["ttft_ms"] == pytest.approx(sorted(r["ttft_ms"] for r in reps)[1])  # the median, not the first
    ort = row["arms"]["ort"]
    assert 0 < ort["run_ms"] <= ort["ms_per_step"] * 1.5 and all("run_ms" in r for r in ort["repeats"])
    assert cli.main([str(tiny_llama), "--device", "cpu", "--repeats", "0", "--out", str(tmp_path)]) == 2


def test_weight_bytes_of_subgraphs_external_files_and_int4(tmp_path):
    """The floor's weight bytes, counted by hand: an If branch's initializer, an external tensor with no recorded
    length (its file from the offset on), two such tensors in one file (the file once), int4 data (two a byte)."""
    from onnx import TensorProto, helper

    from pagedkit.apps.bench import floor

    (tmp_path / "a.bin").write_bytes(b"\0" * 100)
    (tmp_path / "b.bin").write_bytes(b"\0" * 64)

    def ext(name, location, offset=None):
        t = helper.make_tensor(name, TensorProto.FLOAT, [4], [0.0] * 4)
        t.ClearField("float_data")
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", location),) + ((("offset", str(offset)),) if offset is not None else ()):
            e = t.external_data.add()
            e.key, e.value = k, v
        return t

    branch = helper.make_graph([helper.make_node("Identity", ["inner"], ["y"])], "then", [],
                               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
                               [helper.make_tensor("inner", TensorProto.FLOAT, [3], [1.0, 2.0, 3.0])])
    int4 = helper.make_tensor("q", TensorProto.INT4, [5], [1, 2, 3, 4, 5])
    g = helper.make_graph([helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=branch)], "g",
                          [helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
                          [ext("e1", "a.bin", offset=36), ext("e2", "b.bin"), ext("e3", "b.bin", offset=16), int4])
    onnx.save(helper.make_model(g), tmp_path / "m.onnx")
    # e1: 100 - 36; e2 / e3 share b.bin without lengths: the file once, from e2's offset 0; int4: 5 codes in 3 bytes;
    # "inner" twice (then and else are the same graph proto, both walked): 2 x 12
    assert floor.weight_bytes(tmp_path / "m.onnx") == (100 - 36) + 64 + 3 + 2 * 12
