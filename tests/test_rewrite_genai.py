"""Whole-model rewrites of onnxruntime-genai builder models (pagedkit/rewriters/gqa_to_paged.py,
paged_to_gqa.py, rewrite.py) and the `paged-rewrite` CLI.

Models: a random tiny 2-layer checkpoint (tests/genai_models.py) with Q and K projections x10 so that attention
scores are O(1) (rewrite_helpers.save_sharp_checkpoint: at random init the logits cannot see a 2% scale
error), run through the builder (GQA layout: float32 for CPU; paged layout: fp16 with
use_paged_attention=true). Checks:
- GQA -> paged: the builder's GQA model in onnxruntime CPU vs its rewrite in pagedkit.InferenceSession, all
  sequences packed in one ragged batch over a shuffled block table, prompt then forced decode tokens
  (teacher-forced): logits within 5e-3 * max |ref| (the rewrite computes attention in fp16); its graph I/O
  (names, shapes) and genai_config.json equal the builder's own paged export of the same checkpoint, except
  the allowed differences (docs/rewrite.md): logits float32 (the source is float32), the "pagedkit" section.
- paged -> GQA: the builder's paged model in pagedkit vs its GQA rewrite in onnxruntime CPU.
- round trip GQA -> paged -> GQA in onnxruntime CPU vs the original.
- teeth: a 2% scale change in the rewritten graph fails each comparison.
Llama, Gemma 2 (window + softcap), Qwen3 (QK-norm) and GPT-OSS (sinks, window, MoE); the eight builder models are
built in one builder process (the `genai_root` fixture).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest

pytest.importorskip("onnxruntime_genai")
pytest.importorskip("transformers")
ort = pytest.importorskip("onnxruntime")

import pagedkit  # noqa: E402
from genai_models import BuilderFailed  # noqa: E402
from rewrite_helpers import (build_sharp_model, build_sharp_models, og_greedy, rel_err, run_gqa,  # noqa: E402
                             run_paged)
from pagedkit.rewriters.cli import main  # noqa: E402
from pagedkit.rewriters.rewrite import rewrite_file  # noqa: E402

TOL = 5e-3
VOCAB = 128
PROMPTS = [[5, 9, 17, 33, 4, 8, 90, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [7, 7, 100], [40, 41, 42, 43, 44]]
STEPS = 4
FAMILIES = ("gemma2", "qwen3", "gpt_oss")  # Gemma 2: window + softcap; Qwen3: QK-norm; GPT-OSS: sinks, window, MoE


@pytest.fixture(scope="session")
def genai_root(tmp_path_factory) -> Path:
    """Built models live here for the session (PAGEDKIT_REWRITE_MODELS=<dir> reuses a folder across runs); every
    family's two layouts are built up front in one builder process (~5 s: the builder's imports; each build is
    ~0.05 s). Should that batch fail, each test builds its own and reports its own failure."""
    keep = os.environ.get("PAGEDKIT_REWRITE_MODELS")
    root = Path(keep) if keep else tmp_path_factory.mktemp("rewrite-genai")
    build_sharp_models([(f, layout) for f in ("llama", *FAMILIES) for layout in ("gqa", "paged")], root)
    return root


def built(root: Path, family: str, layout: str) -> Path:
    try:
        return build_sharp_model(family, layout, root)
    except BuilderFailed as exc:
        pytest.skip(f"onnxruntime-genai builder could not build {family}/{layout}: {exc}")


def _ort(path) -> "ort.InferenceSession":
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _io(path) -> dict:
    m = onnx.load(str(path), load_external_data=False)

    def desc(v):
        t = v.type.tensor_type
        return (t.elem_type, tuple(d.dim_param or d.dim_value for d in t.shape.dim))
    return {"inputs": {v.name: desc(v) for v in m.graph.input},
            "outputs": {v.name: desc(v) for v in m.graph.output}}


def _scale_mutated(src: Path, dst: Path, op: str, factor: float = 1.02) -> Path:
    """A copy of the model with every `op` node's scale multiplied by factor (external data shared)."""
    m = onnx.load(str(src), load_external_data=False)
    for n in m.graph.node:
        if n.op_type == op:
            a = next((a for a in n.attribute if a.name == "scale"), None)
            if a is None:
                n.attribute.append(onnx.helper.make_attribute("scale", 0.25 * factor))
            else:
                a.f *= factor
    onnx.save(m, str(dst))
    return dst


def _gqa_to_paged(root: Path, family: str, tmp: Path) -> tuple[Path, Path]:
    src = built(root, family, "gqa")
    out = tmp / f"{family}-rewrite" / "model.onnx"
    rewrite_file(src / "model.onnx", out, "paged")
    return src, out


def _paged_vs_gqa(paged_model, gqa_model, windowed=False) -> list[float]:
    p = pagedkit.InferenceSession(str(paged_model))
    g = _ort(gqa_model)
    got = run_paged(p, PROMPTS, STEPS, VOCAB, windowed=windowed)
    return [rel_err(o, run_gqa(g, pr, STEPS, VOCAB)) for pr, o in zip(PROMPTS, got)]


# ------------------------------------------------------------------------------------------------
# Llama (default run)
# ------------------------------------------------------------------------------------------------

def test_llama_gqa_to_paged_logits(genai_root, tmp_path):
    src, out = _gqa_to_paged(genai_root, "llama", tmp_path)
    errs = _paged_vs_gqa(out, src / "model.onnx")
    assert max(errs) <= TOL, errs
    # teeth: a 2% wrong scale in the rewrite fails the same comparison
    bad = _scale_mutated(out, out.parent / "bad.onnx", "PagedAttention")
    assert max(_paged_vs_gqa(bad, src / "model.onnx")) > TOL


def test_llama_rewrite_io_and_config_equal_builder_paged(genai_root, tmp_path):
    _, out = _gqa_to_paged(genai_root, "llama", tmp_path)
    builder = built(genai_root, "llama", "paged")
    mine, theirs = _io(out), _io(builder / "model.onnx")
    assert list(mine["inputs"]) == list(theirs["inputs"]) or set(mine["inputs"]) == set(theirs["inputs"])
    assert mine["inputs"] == theirs["inputs"]
    # allowed: logits are float32 (the source GQA model is float32), shapes and names equal
    assert mine["outputs"].pop("logits") == (onnx.TensorProto.FLOAT, theirs["outputs"]["logits"][1])
    theirs["outputs"].pop("logits")
    assert mine["outputs"] == theirs["outputs"]
    cfg = json.loads((out.parent / "genai_config.json").read_text())
    ref = json.loads((builder / "genai_config.json").read_text())
    assert "pagedkit" in cfg
    cfg.pop("pagedkit")
    assert cfg == ref


def test_llama_paged_to_gqa_logits(genai_root, tmp_path):
    src = built(genai_root, "llama", "paged")
    out = tmp_path / "gqa" / "model.onnx"
    rewrite_file(src, out, "gqa")
    errs = _paged_vs_gqa(src / "model.onnx", out)
    assert max(errs) <= TOL, errs
    cfg = json.loads((out.parent / "genai_config.json").read_text())
    ref = json.loads((built(genai_root, "llama", "gqa") / "genai_config.json").read_text())
    assert cfg["model"]["decoder"]["inputs"] == ref["model"]["decoder"]["inputs"]
    assert cfg["model"]["decoder"]["outputs"] == ref["model"]["decoder"]["outputs"]
    bad = _scale_mutated(out, out.parent / "bad.onnx", "GroupQueryAttention")
    assert max(_paged_vs_gqa(src / "model.onnx", bad)) > TOL


def test_llama_round_trip_gqa_paged_gqa(genai_root, tmp_path):
    src, paged = _gqa_to_paged(genai_root, "llama", tmp_path)
    back = tmp_path / "back" / "model.onnx"
    rewrite_file(paged, back, "gqa")
    a, b = _ort(src / "model.onnx"), _ort(back)
    errs = [rel_err(run_gqa(b, pr, STEPS, VOCAB), run_gqa(a, pr, STEPS, VOCAB)) for pr in PROMPTS]
    assert max(errs) <= TOL, errs
    assert _io(back)["inputs"].keys() == _io(src / "model.onnx")["inputs"].keys()


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------

def test_cli_rewrites_and_summarizes(genai_root, tmp_path, capsys):
    src = built(genai_root, "llama", "gqa")
    out = tmp_path / "cli" / "model.onnx"
    assert main([str(src / "model.onnx"), str(out), "--to", "paged", "--block-size", "16"]) == 0
    text = capsys.readouterr().out
    assert "2 attention node(s) rewritten, 0 skipped" in text and "validated" in text
    assert (out.parent / "model.onnx.data").is_file()  # external data kept external
    assert json.loads((out.parent / "genai_config.json").read_text())["engine"]["dynamic_batching"]["block_size"] == 16


@pytest.mark.parametrize("args,needle", [
    (["--to", "paged", "--block-size", "24"], "block_size must be a power of two >= 16, got 24"),
    (["--to", "gqa"], "no com.microsoft::PagedAttention node"),
])
def test_cli_refusal_is_one_line(genai_root, tmp_path, capsys, args, needle):
    src = built(genai_root, "llama", "gqa")
    assert main([str(src / "model.onnx"), str(tmp_path / "o" / "model.onnx"), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("paged-rewrite: error: ") and needle in err


def test_cli_unsafe_external_data_refused(genai_root, tmp_path, capsys):
    src = built(genai_root, "llama", "gqa")
    m = onnx.load(str(src / "model.onnx"), load_external_data=False)
    for t in m.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "../elsewhere.data"
    (tmp_path / "evil").mkdir()
    onnx.save(m, str(tmp_path / "evil" / "model.onnx"))
    assert main([str(tmp_path / "evil" / "model.onnx"), str(tmp_path / "o" / "model.onnx"), "--to", "paged"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "external data" in err


# ------------------------------------------------------------------------------------------------
# other families
# ------------------------------------------------------------------------------------------------

LONG = [[3 + (i * 7) % 120 for i in range(45)]]  # past Gemma 2's / GPT-OSS's window of 32
WINDOWED = ("gemma2", "gpt_oss")


def _window_mutated(src: Path, dst: Path) -> Path:
    m = onnx.load(str(src), load_external_data=False)
    for n in m.graph.node:
        for a in n.attribute:
            if n.op_type == "PagedAttention" and a.name == "local_window_size":
                a.i = -1
    onnx.save(m, str(dst))
    return dst


@pytest.mark.parametrize("family", FAMILIES)
def test_family_gqa_to_paged_logits(genai_root, tmp_path, family):
    """Gemma 2: a windowed layer (sliding_window_cache=1 in the source, block_table_windowed in the rewrite)
    and softcap, with a 45-token prompt past the window; Qwen3: QK-norm (standard ops before the node in both
    of the builder's layouts, onnxruntime-genai 0.18); GPT-OSS: sinks (head_sink, float32 initializers cast to
    float16), window, MoE."""
    src, out = _gqa_to_paged(genai_root, family, tmp_path)
    prompts = PROMPTS + (LONG if family in WINDOWED else [])
    g, p = _ort(src / "model.onnx"), pagedkit.InferenceSession(str(out))
    refs = [run_gqa(g, pr, STEPS, VOCAB) for pr in prompts]
    errs = [rel_err(o, r) for o, r in zip(run_paged(p, prompts, STEPS, VOCAB), refs)]
    assert max(errs) <= TOL, errs
    builder = built(genai_root, family, "paged")
    mine, theirs = _io(out), _io(builder / "model.onnx")
    assert mine["inputs"] == theirs["inputs"]
    mine["outputs"].pop("logits"), theirs["outputs"].pop("logits")
    assert mine["outputs"] == theirs["outputs"]
    cfg = json.loads((out.parent / "genai_config.json").read_text())
    ref = json.loads((builder / "genai_config.json").read_text())
    cfg.pop("pagedkit")
    assert cfg == ref
    bad = _scale_mutated(out, out.parent / "bad.onnx", "PagedAttention")
    bad_p = pagedkit.InferenceSession(str(bad))
    assert max(rel_err(o, r) for o, r in zip(run_paged(bad_p, prompts, STEPS, VOCAB), refs)) > TOL
    if family == "gpt_oss":  # teeth: the sinks dropped
        m = onnx.load(str(out), load_external_data=False)
        for n in m.graph.node:
            if n.op_type == "PagedAttention":
                n.input[11] = ""
        onnx.save(m, str(out.parent / "nosink.onnx"))
        nosink = pagedkit.InferenceSession(str(out.parent / "nosink.onnx"))
        assert max(rel_err(o, r) for o, r in zip(run_paged(nosink, prompts, STEPS, VOCAB), refs)) > TOL
    if family in WINDOWED:  # teeth: the window dropped
        nowin = pagedkit.InferenceSession(str(_window_mutated(out, out.parent / "nowin.onnx")))
        got = run_paged(nowin, LONG, STEPS, VOCAB)
        assert rel_err(got[0], refs[-1]) > TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_family_paged_to_gqa_logits(genai_root, tmp_path, family):
    """The builder's paged export (Gemma 2: windowed layer over block_table_windowed; Qwen3: QK-norm, which
    onnxruntime-genai 0.18 leaves as standard ops before the node; a fused one would be moved out, see
    test_rewrite_nodes.test_paged_qk_norm_unfused_for_onnxruntime_cpu) -> GQA in onnxruntime CPU vs pagedkit
    on the paged original."""
    src = built(genai_root, family, "paged")
    out = tmp_path / "gqa" / "model.onnx"
    report = rewrite_file(src, out, "gqa")
    fused = any(n.op_type == "PagedAttention" and len(n.input) > 12 and n.input[12]
                for n in onnx.load(str(src / "model.onnx"), load_external_data=False).graph.node)
    assert fused == any("QK-norm moved out" in m for m in report.model)
    prompts = PROMPTS + (LONG if family in WINDOWED else [])
    p, g = pagedkit.InferenceSession(str(src / "model.onnx")), _ort(out)
    got = run_paged(p, prompts, STEPS, VOCAB)
    errs = [rel_err(run_gqa(g, pr, STEPS, VOCAB), o) for pr, o in zip(prompts, got)]
    assert max(errs) <= TOL, errs


def test_example_script_runs(genai_root, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "rewrite_example", Path(__file__).resolve().parent.parent / "examples" / "rewrite_genai_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([str(built(genai_root, "llama", "gqa"))]) == 0
    out = capsys.readouterr().out
    assert "largest logit difference" in out and "same greedy token at" in out
    rel = float(out.split(" of the largest logit")[0].rsplit("(", 1)[1])
    assert rel <= TOL


def test_gqa_rewrite_of_paged_export_runs_in_onnxruntime_genai(genai_root, tmp_path):
    """Interop: the builder's paged Llama rewritten to GQA loads in onnxruntime-genai on the CPU (og.Model) and
    generates the same 16 greedy tokens as pagedkit on the paged original (shuffled block table)."""
    pytest.importorskip("onnxruntime_genai")
    from rewrite_helpers import greedy_paged

    src = built(genai_root, "llama", "paged")
    out = tmp_path / "og" / "model.onnx"
    rewrite_file(src, out, "gqa")
    prompt = [1, 17, 33, 52, 8, 90, 11]
    og_tokens = og_greedy(out.parent, prompt, 16)
    ours = greedy_paged(pagedkit.InferenceSession(str(src / "model.onnx")), prompt, 16)
    assert og_tokens == ours


def test_pagedkit_generator_serves_gemma2_rewrite(genai_root, tmp_path):
    """pagedkit's Generator reads the rewrite's genai_config.json (two pools: block_table_windowed for the
    windowed layer) and generates the same greedy tokens as on the GQA source, past the window."""
    from pagedkit.runtime.generate import Generator

    src = built(genai_root, "gemma2", "gqa")
    out = tmp_path / "gen" / "model.onnx"
    rewrite_file(src, out, "paged", block_size=16)
    prompt = PROMPTS[0] + LONG[0]
    gen = Generator(out.parent, block_size=16, shuffle_seed=3)
    assert len(gen.state.mgr.pools) == 2
    mine = [s.token for s in gen.greedy(prompt, 12, stop_at_eos=False)]
    ref = [s.token for s in Generator(src).greedy(prompt, 12, stop_at_eos=False)]
    assert mine == ref


def test_pagedkit_export_to_gqa_runs_in_onnxruntime_and_genai(tmp_path):
    """A pagedkit export (examples/tiny-paged, fp16) -> GQA: onnxruntime CPU matches pagedkit on the paged
    original (teacher-forced, two sequences), and onnxruntime-genai (og.Model, CPU) generates the same 16
    greedy tokens as pagedkit."""
    pytest.importorskip("onnxruntime_genai")
    from rewrite_helpers import greedy_paged

    src = Path(__file__).resolve().parent.parent / "examples" / "tiny-paged"
    out = tmp_path / "gqa" / "model.onnx"
    rewrite_file(src, out, "gqa")
    paged = pagedkit.InferenceSession(str(src / "model.onnx"))
    prompts = [[5, 9, 17, 33, 4, 8, 90, 11, 12, 13], [7, 7, 100]]
    got = run_paged(paged, prompts, 3, VOCAB)
    g = _ort(out)
    assert max(rel_err(run_gqa(g, pr, 3, VOCAB), o) for pr, o in zip(prompts, got)) <= TOL
    prompt = [1, 17, 33, 52, 8, 90, 11]
    assert og_greedy(out.parent, prompt, 16) == greedy_paged(paged, prompt, 16)
