"""paged-export --via genai (pagedkit/exporters/via_genai.py): onnxruntime-genai's builder on a local checkpoint,
pagedkit's corrections (genai_fixups.py), the GQA -> PagedAttention rewrite, pagedkit's KV-cache options.

Parity uses tests/family_harness.py unchanged: `family_harness.export_case` is swapped for the via-genai export
of the case's checkpoint (save_tiny_checkpoint of the same HF model), so check_export / check_teeth apply their
own bounds (fp16 2e-2; fp32 8e-3 vs HF and 1e-3 vs HF with the node's fp16 boundary) to the route's model.
- Phi-2 ("phi", no native family): fp32 in CI, fp16 slow; OLMo 1 ("olmo", no native family) slow, with the
  teeth of its builder fix (without it the builder's RMSNorm is 0.9 x max|logit| away);
- llama, qwen3, gemma2 (native families too): both routes pass parity and agree with each other (slow);
- every other served architecture: fp16 parity (slow); quantized caches against the quantized oracle;
- refusals (one line): unserved architectures, configurations the builder drops, flags the route does not
  apply, a builder failure (its own message), an unknown model_type without --via (both routes listed);
- teeth: a 5% wrong attention scale in the rewritten model fails parity.
Builds are cached per (checkpoint, precision, layers) for the session (the builder takes 5-20 s).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime_genai")
pytest.importorskip("transformers")

import family_harness  # noqa: E402
from export_utils import (TOL, assert_close_logits, check_parity, export_tiny, mutated_export,  # noqa: E402
                          run_tokens, save_tiny_checkpoint)
from family_harness import FamilyCase, check_export, check_teeth, model_of, torch_session  # noqa: E402

from pagedkit.exporters import via_genai  # noqa: E402
from pagedkit.exporters.families.base import ExportOptions, KVOptions  # noqa: E402

PHI = FamilyCase("PhiConfig", seed=4)
OLMO = FamilyCase("OlmoConfig", seed=5)
BOTH_ROUTES = {
    "llama": FamilyCase("LlamaConfig", seed=1, overrides=dict(attention_bias=True)),
    "qwen3": FamilyCase("Qwen3Config", seed=2),
    "gemma2": FamilyCase("Gemma2Config", seed=6, chunk=16, overrides=dict(
        num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=20.0,
        final_logit_softcapping=10.0)),
}
OTHERS = {  # the other served architectures, features active where the builder exports them
    "mistral": FamilyCase("MistralConfig", seed=7, overrides=dict(sliding_window=None)),
    "qwen2": FamilyCase("Qwen2Config", seed=8, chunk=16, overrides=dict(use_sliding_window=True, sliding_window=8,
                                                                       max_window_layers=1)),
    "phi3": FamilyCase("Phi3Config", seed=9, overrides=dict(original_max_position_embeddings=256)),
    "gemma": FamilyCase("GemmaConfig", seed=10),
    "granite": FamilyCase("GraniteConfig", seed=11, overrides=dict(
        embedding_multiplier=3.0, logits_scaling=2.0, residual_multiplier=0.5, attention_multiplier=0.2)),
    "nemotron": FamilyCase("NemotronConfig", seed=12),
    "smollm3": FamilyCase("SmolLM3Config", seed=13),
    "ernie4_5": FamilyCase("Ernie4_5Config", seed=14, overrides=dict(use_bias=True)),
    "gpt_oss": FamilyCase("GptOssConfig", seed=15, chunk=16, overrides=dict(
        num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"])),
}
_CHECKPOINTS: dict[tuple, Path] = {}
_BUILDS: dict[tuple, Path] = {}


@pytest.fixture(scope="session")
def cache_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("via-genai")


def checkpoint_of(case: FamilyCase, root: Path) -> Path:
    """save_pretrained of the case's HF model (+ a local tokenizer), once per session."""
    if case.key not in _CHECKPOINTS:
        _CHECKPOINTS[case.key] = save_tiny_checkpoint(model_of(case)[0], root / f"hf-{len(_CHECKPOINTS)}")
    return _CHECKPOINTS[case.key]


@pytest.fixture(autouse=True)
def cached_builds(monkeypatch, cache_root):
    """The builder runs once per (checkpoint, precision, num_layers) for the session; failures are not cached."""
    real = via_genai.run_builder

    def run(folder, out, cache, precision, num_layers=None, timeout=None, progress=False, int4=None):
        key = (str(Path(folder).resolve()), precision, num_layers, repr(int4))
        if key not in _BUILDS:
            _BUILDS[key] = real(folder, cache_root / f"build-{len(_BUILDS)}", cache, precision, num_layers, timeout,
                                int4=int4)
        shutil.copytree(_BUILDS[key], out)
        return Path(out)

    monkeypatch.setattr(via_genai, "run_builder", run)


@pytest.fixture
def via_route(monkeypatch, cache_root):
    """family_harness's checks on the via-genai export of each case's checkpoint."""
    def export_case(case, out, dtype="fp16", **opts):
        via_genai.export_via_genai(checkpoint_of(case, cache_root), out,
                                   ExportOptions(dtype=dtype, progress=False, **opts))
        return out

    monkeypatch.setattr(family_harness, "export_case", export_case)
    return export_case


def _source(out: Path) -> dict:
    from pagedkit.interface import read_pagedkit_section

    return read_pagedkit_section(out)["source"]


# ---- Phi-2 (CI) and OLMo 1: no native family ----------------------------------------------------------------

def test_phi_fp32_parity(via_route, tmp_path, cache_root):
    print("phi via genai", check_export(PHI, tmp_path, "fp32"))
    src = _source(tmp_path / "fp32")
    assert src["route"] == "genai" and src["architecture"] == "PhiForCausalLM"
    assert Path(src["checkpoint"]) == checkpoint_of(PHI, cache_root).resolve() and src["num_hidden_layers"] == 2


def test_wrong_scale_fails_parity(via_route, tmp_path):
    """Teeth: the rewritten Phi model with a 5% larger attention scale on every node fails the harness's fp32
    check against HF with the node's fp16 boundary emulated (1e-3; the correct model: 4e-4, the wrong one
    about 9e-3, which is also just past the plain 8e-3 bound)."""
    hf = model_of(PHI)[0]
    out = via_route(PHI, tmp_path / "ok", "fp32")
    bad = mutated_export(out, tmp_path / "bad", scale=0.25 * 1.05)
    for model_dir, fails in ((out, False), (bad, True)):
        with family_harness.fp16_node_boundary(hf, model_dir):
            run = lambda: check_parity(hf, model_dir, prompt_lens=PHI.prompt_lens, steps=PHI.steps,  # noqa: E731
                                       tol=family_harness.FP32_BOUNDARY_TOL, session=torch_session(model_dir))
            if fails:
                with pytest.raises(AssertionError, match="max\\|diff\\||greedy argmax"):
                    run()
            else:
                run()


@pytest.mark.slow
def test_phi_fp16_parity(via_route, tmp_path):
    print("phi via genai", check_export(PHI, tmp_path, "fp16"))


@pytest.mark.slow
def test_phi_bf16_parity(tmp_path, cache_root):
    """--dtype bf16 (-e cuda -p bf16): against HF over the bf16-rounded weights at the native route's bf16 bound."""
    from export_utils import BF16_TOL, assert_valid_export, bf16_weights

    via_genai.export_via_genai(checkpoint_of(PHI, cache_root), tmp_path, ExportOptions(dtype="bf16", progress=False))
    assert_valid_export(tmp_path)
    print("phi bf16", check_parity(bf16_weights(model_of(PHI)[0]), tmp_path, prompt_lens=PHI.prompt_lens,
                                   steps=PHI.steps, tol=BF16_TOL, session=torch_session(tmp_path)).worst_ratio)


@pytest.mark.slow
def test_num_layers(tmp_path, cache_root):
    """--num-layers 1 is the builder's num_hidden_layers: the export equals HF cut to its first layer, and the
    recorded source says so (paged-run --parity loads the checkpoint cut the same way)."""
    from pagedkit.runtime.parity import load_hf

    ckpt = checkpoint_of(PHI, cache_root)
    via_genai.export_via_genai(ckpt, tmp_path, ExportOptions(dtype="fp32", progress=False), num_layers=1)
    source = _source(tmp_path)
    assert source["num_hidden_layers"] == 1
    hf = load_hf(ckpt, source["num_hidden_layers"])
    print("phi 1 layer", check_parity(hf, tmp_path, prompt_lens=PHI.prompt_lens, steps=PHI.steps,
                                       tol=family_harness.FP32_TOL, session=torch_session(tmp_path)).worst_ratio)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_olmo_parity(via_route, tmp_path, dtype):
    print("olmo via genai", check_export(OLMO, tmp_path, dtype))
    assert any("OLMo norms" in f for f in _source(tmp_path / dtype)["fixes"])


@pytest.mark.slow
def test_olmo_norm_fix_has_teeth(via_route, tmp_path, monkeypatch):
    from pagedkit.exporters import genai_fixups

    check_teeth(OLMO, tmp_path, monkeypatch, lambda m: m.setattr(genai_fixups, "olmo_layer_norms", lambda model: 0))


# ---- llama, qwen3, gemma2: both routes agree with HF and with each other --------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", list(BOTH_ROUTES))
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_both_routes_agree(via_route, tmp_path, name, dtype):
    case = BOTH_ROUTES[name]
    via = check_export(case, tmp_path / "via", dtype)
    native_dir = tmp_path / "native"
    export_tiny(model_of(case)[0], native_dir, dtype=dtype)
    native = family_harness._parity(case, native_dir, TOL if dtype == "fp16" else family_harness.FP32_TOL)
    tokens = [list(range(3, 3 + n + case.steps)) for n in case.prompt_lens]
    got = run_tokens(tmp_path / "via" / dtype, tokens, case.prompt_lens, chunk=case.chunk)
    ref = run_tokens(native_dir, tokens, case.prompt_lens, chunk=case.chunk)
    between = assert_close_logits(got, ref, TOL if dtype == "fp16" else family_harness.FP32_TOL, "via vs native")
    print(name, dtype, "via", via, "native", native.worst_ratio, "via vs native", between)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OTHERS))
def test_other_served_architectures(via_route, tmp_path, name):
    print(name, "via genai", check_export(OTHERS[name], tmp_path, "fp16"))


@pytest.mark.slow
@pytest.mark.parametrize("kv", [dict(k_dtype="int8", v_dtype="int8", k_quant="PER_TENSOR", v_quant="PER_TENSOR"),
                                dict(k_dtype="int4", v_dtype="int4", k_quant="PER_TOKEN", v_quant="PER_TOKEN",
                                     rotate=True),
                                dict(k_dtype="float8e4m3fn", v_dtype="float8e4m3fn", k_quant="PER_CHANNEL",
                                     v_quant="PER_CHANNEL")], ids=["int8-per-tensor", "int4-per-token-rotated",
                                                                   "fp8-per-channel"])
def test_quantized_caches(via_route, tmp_path, kv):
    """--kv-cache / --kv-quant / --rotate-kv on the rewrite: the quantized oracle of the native route's tests
    (HF attending over the export's dequantized cache; the codes are HF's K / V quantized)."""
    from export_quant_utils import check_quantized_parity
    from export_utils import assert_valid_export, attention_attrs

    case = BOTH_ROUTES["llama"]
    out = via_route(case, tmp_path, "fp16", kv=KVOptions(**kv))
    assert_valid_export(out)
    for a in attention_attrs(out / "model.onnx"):
        assert a.get("k_quant_type") == kv["k_quant"] and a.get("qk_rotation", 0) == int(kv.get("rotate", False))
    print(kv, check_quantized_parity(model_of(case)[0], out))


@pytest.mark.slow
@pytest.mark.parametrize("tied,lm_head", [(False, True), (True, True), (True, False)])
def test_int4_weights(tmp_path, cache_root, tied, lm_head):
    """--weights int4 is the builder's -p int4 (accuracy_level 0 here): against HF over the decoded int4 weights
    at the fp16 bound (the native route's int4 oracle); untied, the int4 tensors equal the native route's."""
    from collections import Counter

    import onnx
    from onnx import numpy_helper

    from export_quant_utils import int4_decoded_hf

    case = FamilyCase("LlamaConfig", seed=16, overrides=dict(tie_word_embeddings=tied))
    hf = model_of(case)[0]
    via_genai.export_via_genai(checkpoint_of(case, cache_root), tmp_path / "via", ExportOptions(
        dtype="fp32", progress=False), weights="int4", int4_lm_head=lm_head, int4_accuracy_level=0)
    graph = onnx.load(str(tmp_path / "via" / "model.onnx")).graph
    ops = Counter(n.op_type for n in graph.node)
    assert ops["MatMulNBits"] == 10 + lm_head and ops["GatherBlockQuantized"] == int(tied and lm_head), ops
    ref, done = int4_decoded_hf(hf, tmp_path / "via")
    assert ("lm_head" in done) == lm_head
    print("int4", tied, lm_head, check_parity(ref, tmp_path / "via", prompt_lens=case.prompt_lens, steps=case.steps,
                                             session=torch_session(tmp_path / "via")).worst_ratio)
    if not tied:
        from pagedkit.exporters.export import export_hf_model

        export_hf_model(hf, tmp_path / "native", ExportOptions(dtype="fp32", progress=False), weight_format="int4",
                        int4_accuracy_level=0)
        native = {t.name: numpy_helper.to_array(t) for t in
                  onnx.load(str(tmp_path / "native" / "model.onnx")).graph.initializer if t.name.endswith("_Q4")}
        via = {t.name: numpy_helper.to_array(t) for t in graph.initializer if t.name.endswith("_Q4")}
        assert via.keys() == native.keys() and all((via[k] == native[k]).all() for k in via)


# ---- refusals: one line, exit status 2 -------------------------------------------------------------------------

def _cli(capsys, *args) -> tuple[int, str, str]:
    from pagedkit.exporters.cli import main

    capsys.readouterr()  # what came before (save_pretrained's progress bar) is not the command's
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def _one_line_error(err: str, needle: str) -> None:
    """The error is one line, the last one on stderr (before it only transformers' progress bars may appear)."""
    lines = err.rstrip("\n").split("\n")
    assert "Traceback" not in err and sum("error" in l for l in lines) == 1, err
    assert lines[-1].startswith("paged-export: error: ") and needle in lines[-1], err


def _tiny_checkpoint(tmp_path: Path, config: str, **overrides) -> Path:
    from export_utils import tiny_model

    return save_tiny_checkpoint(tiny_model(config, **overrides), tmp_path / config)


@pytest.mark.parametrize("config,overrides,needle", [
    ("PhiConfig", dict(qk_layernorm=True), "qk_layernorm true: the builder drops"),
    ("OlmoConfig", dict(clip_qkv=0.5), "clip_qkv 0.5"),
    ("SmolLM3Config", dict(num_hidden_layers=4), "NoPE layers"),
    ("Phi3Config", dict(original_max_position_embeddings=64), "LongRoPE"),
    ("Lfm2Config", dict(layer_types=["conv", "full_attention"]), "convolution state"),
])
def test_unserved_configuration_refused(tmp_path, capsys, config, overrides, needle):
    ckpt = _tiny_checkpoint(tmp_path, config, **overrides)
    rc, _, err = _cli(capsys, "--via", "genai", "--model", str(ckpt), "--output", str(tmp_path / "o"), "--quiet")
    assert rc == 2
    _one_line_error(err, needle)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("flags,needle", [(["--num-experts", "2"], "--num-experts with --via genai"),
                                          (["--extra-inputs", "slot_mapping"], "--extra-inputs with --via genai"),
                                          (["--max-seq-len", "64"], "--max-seq-len with --via genai")])
def test_flags_the_route_does_not_apply(tmp_path, capsys, cache_root, flags, needle):
    ckpt = checkpoint_of(PHI, cache_root)
    rc, _, err = _cli(capsys, "--via", "genai", "--model", str(ckpt), "--output", str(tmp_path / "o"), *flags)
    assert rc == 2
    _one_line_error(err, needle)


def test_builder_failure_is_one_line(tmp_path, capsys, cache_root):
    """A checkpoint whose safetensors file is truncated: the builder's own error, on one line."""
    ckpt = tmp_path / "broken"
    shutil.copytree(checkpoint_of(PHI, cache_root), ckpt)
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    rc, _, err = _cli(capsys, "--via", "genai", "--model", str(ckpt), "--output", str(tmp_path / "o"), "--quiet")
    assert rc == 2
    _one_line_error(err, "onnxruntime-genai's builder failed on")
    assert "SafetensorError" in err


def test_unknown_model_type_lists_both_routes(tmp_path, capsys, cache_root):
    ckpt = checkpoint_of(PHI, cache_root)
    rc, _, err = _cli(capsys, "--model", str(ckpt), "--output", str(tmp_path / "o"), "--quiet")
    assert rc == 2
    _one_line_error(err, "model_type 'phi' has no native pagedkit exporter; native: ")
    assert "llama" in err and "`--via genai`" in err and "use `paged-export --via genai`" in err


@pytest.mark.slow
def test_dropped_window_refused(tmp_path, capsys):
    """Mistral with a binding window: the builder writes local_window_size -1; the route refuses it."""
    ckpt = _tiny_checkpoint(tmp_path, "MistralConfig", sliding_window=8)
    rc, _, err = _cli(capsys, "--via", "genai", "--model", str(ckpt), "--output", str(tmp_path / "o"), "--quiet")
    assert rc == 2
    _one_line_error(err, "wrote local_window_size [-1, -1] for MistralForCausalLM where the config")


# ---- --list and docs/export.md ---------------------------------------------------------------------------------

def test_list_is_generated_from_the_registry(capsys):
    from pagedkit.exporters.registry import families

    rc, out, _ = _cli(capsys, "--list")
    assert rc == 0
    lines = {l.split(":", 1)[0]: l for l in out.splitlines() if ":" in l}
    for mt in families():
        assert mt in lines and "native" in lines[mt], mt
    assert "via genai" in lines["phi"] and "native" not in lines["phi"] and "PhiForCausalLM" in lines["phi"]
    assert "llama-3.1-8b" in lines["llama"]
    assert "Lfm2ForCausalLM: holds a convolution state" in out


def test_export_doc_table_is_current():
    from pagedkit.exporters import docs

    assert not docs.stale(), f"stale model-type table in docs/export.md; regenerate it with `{docs.COMMAND}`"


def test_export_doc_check_mode(tmp_path, capsys):
    from pagedkit.exporters import docs
    from pagedkit.exporters.registry import families

    out = tmp_path / "export.md"
    out.write_text(f"# x\n\n{docs.BEGIN}\nSTALE-ROW\n{docs.END}\n\nafter\n")
    assert docs.main(["--out", str(out), "--check"]) == 1
    assert f"regenerate with `{docs.COMMAND}`" in capsys.readouterr().out
    assert docs.main(["--out", str(out)]) == 0 and docs.main(["--out", str(out), "--check"]) == 0
    text = out.read_text()
    assert text.startswith("# x\n") and text.endswith("\nafter\n") and "STALE-ROW" not in text
    for mt in list(families()) + via_genai.served_model_types():
        assert f"| `{mt}` |" in text, mt


@pytest.mark.slow
def test_doc_example_runs(tmp_path, capsys):
    """docs/export.md's --via genai example, as written (paths moved under tmp_path): the python block builds
    the checkpoint, the shell block exports it and runs paged-run --parity."""
    from pagedkit.exporters.cli import main as export_main
    from pagedkit.apps.run.cli import main as run_main

    text = (Path(__file__).resolve().parents[1] / "docs" / "export.md").read_text(encoding="utf-8")
    section = text.split("## Second route: `--via genai`", 1)[1].split("\n## ", 1)[0]
    code = re.findall(r"```python\n(.*?)```", section, re.S)[0].replace("/tmp/", f"{tmp_path}/")
    exec(compile(code, "docs/export.md --via genai example", "exec"), {})
    shell = re.findall(r"```\n(paged-export --via genai.*?)```", section, re.S)[0].replace("/tmp/", f"{tmp_path}/")
    for line in shell.strip().splitlines():
        prog, *args = shlex.split(line)
        assert {"paged-export": export_main, "paged-run": run_main}[prog](args) == 0, line
    out = capsys.readouterr().out
    assert "via onnxruntime-genai" in out and "parity OK" in out
    assert json.loads((tmp_path / "phi-paged" / "genai_config.json").read_text())["model"]["type"] == "phi"


@pytest.mark.parametrize("window, context, want", [
    (1024, 4096, 1024), (4095, 4096, 4095), (4096, 4096, -1), (8192, 4096, -1), (0, 4096, -1), (None, 4096, -1),
    (-1, 4096, -1), (512, None, 512), ("256", 0, 256)])
def test_effective_window(window, context, want):
    """A sliding window that never binds within the context (>= max_position_embeddings) is full attention."""
    from pagedkit.exporters.genai_fixups import _effective

    assert _effective(window, context) == want


@pytest.mark.parametrize("layers, refused", [([1, 1, 1, 0], True), ([0, 1], True), ([1, 1, 1, 1], False),
                                             (None, False), ([], False)])
def test_smollm3_nope_layers_refused(layers, refused):
    """--via genai refuses SmolLM3 with NoPE layers (a 0 in no_rope_layers), not one that rotates every layer."""
    cfg = {} if layers is None else {"no_rope_layers": layers}
    got = via_genai.config_problem("SmolLM3ForCausalLM", cfg)
    assert (got is not None) == refused, got
    if refused:
        assert "NoPE layers" in got
