"""onnxruntime-genai's CPU models (`-p fp32 -e cpu` and `-p int4 -e cpu`) run through pagedkit's Generator and
through onnxruntime-genai itself (og.Model / og.Generator, get_logits after every appended token), teacher-forced
over the same 40-token prompt and 16 further tokens; logits compared step by step, norm-relative
(max|ours - ref| <= tol * max|ref|), greedy tokens equal except at near-ties (ref's top-2 logits closer than
the tolerance).

- fp32: tol 1e-4 (measured <= 2.2e-6 for the four families).
- int4, the model as built (MatMulNBits accuracy_level 4): onnxruntime's CPU kernel quantizes A to int8 blocks
  there, pagedkit rounds A to bfloat16 for torch's int4 kernel (ops/nbits.py); neither is the exact product,
  and the two errors add. Measured on these checkpoints and tokens, max over the 16 steps of
  max|diff| / max|ref| ("exact": genai on a copy of the model with accuracy_level 0, A not quantized):
      family (layout)        genai-int4 vs exact   pagedkit-int4 vs exact   pagedkit vs genai
      llama                  7.4e-2                2.2e-2                   7.9e-2
      llama (asym, b64)      8.6e-2                4.6e-2                   1.08e-1
      qwen3                  4.9e-2                2.6e-2                   4.9e-2
      gemma2                 2.0e-2                1.2e-2                   2.3e-2
      gpt_oss                0.41 (routing flip)   4.2e-2                   0.45 (the same step)
  The errors are that large because these random checkpoints amplify them (1.5 / sqrt(fan_in) weights: sharp
  attention, most of it from the qkv product); one product alone is off by ~4e-3 (benchmarks/int4_matmul.py).
  So the int4 checks are:
  (a) tight: on the accuracy_level 0 copy pagedkit takes its exact layout (weights dequantized once) and must
      match genai's exact run within the fp32 tolerance 1e-4 (measured <= 1.7e-6). This is the check with
      teeth: one MatMulNBits scale off by 2% fails it by 100x (test_int4_comparison_has_teeth);
  (b) pagedkit's int4 result is no further from the exact one than genai's own int4 result is (max over steps,
      a 1.25 margin: the measured ratio is 0.1..0.62 here, up to 1.03 on other forced tokens);
  (c) as built, pagedkit vs genai within INT4_TOL = 0.15 (1.4x the largest measured, 1.08e-1) at every step,
      except steps where genai's own int4 run is itself more than INT4_TOL from the exact one (GPT-OSS: a
      token's top-2 experts change under int8 rounding, a discontinuity no tolerance covers); greedy tokens
      agree except at near-ties (top-2 closer than INT4_TOL * max|ref|) or at such steps.

fp32 runs in CI for the four families, int4 for Llama; the int4 models of the asymmetric block-64 Llama (zero
points, K = 96 not a multiple of the block, GatherBlockQuantized over uint4 data), Qwen3, Gemma 2 (tied
embeddings: GatherBlockQuantized over the lm_head's uint8 weights) and GPT-OSS (QMoE experts; the checkpoint
carries the MXFP4 tensors genai's int4 builder reads) are `slow`. Every model is built up front in one builder
process (the `root` fixture).
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

og = pytest.importorskip("onnxruntime_genai")
transformers = pytest.importorskip("transformers")
onnx = pytest.importorskip("onnx")

import genai_models  # noqa: E402
from test_genai_run import PROMPT, STEPS, shared_root, write_checkpoint  # noqa: E402
from pagedkit.runtime.generate import Generator, History, StepResult  # noqa: E402
from pagedkit.runtime.parity import parity  # noqa: E402

FP32_TOL = 1e-4
INT4_TOL = 0.15
NO_WORSE = 1.25  # (b): pagedkit-int4 vs exact <= NO_WORSE * genai-int4 vs exact
FORCED = [int(t) for t in np.random.default_rng(3).integers(3, 128, STEPS)]


BUILDS = [(f, "gqa") for f in ("llama", "qwen3", "gemma2", "gpt_oss")] + [
    (f, "int4") for f in ("llama", "qwen3", "gemma2", "gpt_oss")] + [("llama", "int4-asym-b64")]


@pytest.fixture(scope="session")
def root(tmp_path_factory) -> Path:
    """The shared folder, with every model below built up front in one builder process (what that cannot build,
    each test's `build` builds or reports)."""
    root = shared_root(tmp_path_factory)
    genai_models.prebuild([(*_folders(root, f, layout), layout) for f, layout in BUILDS], root / "cache")
    return root


def write_gpt_oss_mxfp4(out: Path, seed: int = 0) -> Path:
    """test_genai_run's GPT-OSS checkpoint with MXFP4 experts: random E2M1 codes and E8M0 block exponents
    (`*_blocks` [E, N, K/32, 16], `*_scales` [E, N, K/32], the original checkpoint's tensors, which genai's
    int4 builder reads), and the HF expert weights set to their decoded values (the fp32 build uses those)."""
    from safetensors.torch import load_file, save_file

    write_checkpoint("gpt_oss", out, seed)
    sd = load_file(out / "model.safetensors")
    mag = torch.tensor((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0))
    g = torch.Generator().manual_seed(seed + 7)
    for name in [n for n in sd if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
        e, k, n = sd[name].shape  # HF layout [E, in, out]
        blocks = torch.randint(0, 256, (e, n, k // 32, 16), dtype=torch.uint8, generator=g)
        expo = round(math.log2(0.75 / math.sqrt(k))) + 127  # |codes| ~ 2: weights ~ 1.5 / sqrt(k)
        scales = (expo + torch.randint(-1, 2, (e, n, k // 32), generator=g)).to(torch.uint8)
        codes = torch.stack([blocks & 15, blocks >> 4], -1).reshape(e, n, k // 32, 32)
        vals = torch.where((codes & 8) != 0, -mag[(codes & 7).long()], mag[(codes & 7).long()])
        w = (vals * torch.pow(2.0, scales.float() - 127).unsqueeze(-1)).reshape(e, n, k)
        sd[name] = w.transpose(1, 2).contiguous().to(sd[name].dtype)
        sd[f"{name}_blocks"], sd[f"{name}_scales"] = blocks, scales
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _folders(root: Path, family: str, layout: str):
    """(checkpoint folder, its writer, model folder) of family / layout."""
    hf = root / (f"hf-{family}" if family != "gpt_oss" else "hf-gpt_oss-mxfp4")
    write = write_gpt_oss_mxfp4 if family == "gpt_oss" else lambda out: write_checkpoint(family, out)
    return hf, write, root / (f"{family}-{layout}" if family != "gpt_oss" else f"gpt_oss-mxfp4-{layout}")


def build(root: Path, family: str, layout: str) -> Path:
    """The builder's model folder for family / layout ("gqa" = -p fp32 -e cpu, shared with test_genai_run)."""
    hf, write, out = _folders(root, family, layout)
    if not (hf / "config.json").exists():
        write(hf)
    if not (out / "model.onnx").exists():
        try:
            genai_models.run_builder(hf, out, layout, root / "cache")
        except genai_models.BuilderFailed as exc:
            pytest.skip(f"onnxruntime-genai builder could not build {family}/{layout}: {exc}")
    return out


def rewritten_copy(src: Path, dst: Path, edit) -> Path:
    """A copy of a model folder whose model.onnx (weights embedded) went through edit(model)."""
    if (dst / "model.onnx").exists():
        return dst
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.onnx", "model.onnx.data"))
    model = onnx.load(str(src / "model.onnx"))
    edit(model)
    onnx.save(model, str(dst / "model.onnx"))
    return dst


def exact_copy(model_dir: Path) -> Path:
    """The model with every accuracy_level set to 0 (A not quantized: onnxruntime computes the exact product,
    pagedkit takes its exact layout)."""
    def edit(model):
        for node in model.graph.node:
            for a in node.attribute:
                if a.name == "accuracy_level":
                    a.i = 0
    return rewritten_copy(model_dir, model_dir.with_name(model_dir.name + "-level0"), edit)


def genai_logits(model_dir: Path) -> list[torch.Tensor]:
    """onnxruntime-genai's logits after the prompt and after each forced token but the last."""
    model = og.Model(str(model_dir))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(PROMPT) + STEPS + 1, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(np.array([PROMPT], dtype=np.int32))
    out = [torch.from_numpy(gen.get_logits()[0, -1].astype(np.float32))]
    for tok in FORCED[:-1]:
        gen.append_tokens(np.array([[tok]], dtype=np.int32))
        out.append(torch.from_numpy(gen.get_logits()[0, -1].astype(np.float32)))
    return out


def ours(model_dir: Path, backend: str = "torch") -> tuple[History, dict[str, str]]:
    gen = Generator(model_dir, cpu_backend=backend)  # torch: pagedkit's own kernels against genai
    gen.teacher_forced(PROMPT, FORCED)
    return gen.history, gen.session.prepacked


def as_ref(logits: list[torch.Tensor]) -> torch.Tensor:
    """Per-step logits as the position-indexed table parity() reads."""
    ref = torch.zeros(len(PROMPT) + STEPS, logits[0].numel())
    ref[len(PROMPT) - 1:len(PROMPT) - 1 + len(logits)] = torch.stack(logits)
    return ref


def as_history(logits: list[torch.Tensor]) -> History:
    h = History(list(PROMPT))
    h.steps = [StepResult(t, lg, len(PROMPT) - 1 + k, 0.0) for k, (t, lg) in enumerate(zip(FORCED, logits))]
    return h


def check_tight(history: History, ref: list[torch.Tensor], what: str):
    report = parity(history, as_ref(ref), FP32_TOL)
    text = "\n".join(report.lines())
    print(f"\n{what}:\n{text}")
    assert len(report.steps) == STEPS
    assert report.max_rel <= FP32_TOL, text
    assert not report.disagreements, text
    return report


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "gpt_oss"])
def test_fp32_matches_genai(root, family):
    model_dir = build(root, family, "gqa")
    history, _ = ours(model_dir)
    check_tight(history, genai_logits(model_dir), f"{model_dir.name} pagedkit vs onnxruntime-genai")


def test_fp32_onnxruntime_backend_matches_genai(root):
    """The Generator's default CPU path on genai's GQA model: the whole graph in one onnxruntime session."""
    model_dir = build(root, "llama", "gqa")
    history, _ = ours(model_dir, "onnxruntime")
    check_tight(history, genai_logits(model_dir), f"{model_dir.name} pagedkit (onnxruntime backend) vs genai")


def check_int4(model_dir: Path) -> None:
    exact_dir = exact_copy(model_dir)
    ref4, ref0 = genai_logits(model_dir), genai_logits(exact_dir)
    hist4, packed4 = ours(model_dir)
    hist0, packed0 = ours(exact_dir)
    nbits_nodes = [n.name for n in onnx.load(str(exact_dir / "model.onnx"), load_external_data=False).graph.node
                   if n.op_type == "MatMulNBits"]
    assert nbits_nodes and all("int4 CPU kernel" in packed4[n] for n in nbits_nodes), packed4
    assert all("dequantized" in packed0[n] for n in nbits_nodes), packed0
    # (a) the exact layouts against genai's exact run
    check_tight(hist0, ref0, f"{exact_dir.name} (accuracy_level 0) pagedkit vs onnxruntime-genai")
    # (b) pagedkit's int4 arithmetic no further from the exact product than genai's own
    exact = as_ref(ref0)
    ours_err = parity(hist4, exact, INT4_TOL)
    genai_err = parity(as_history(ref4), exact, INT4_TOL)
    print(f"\n{model_dir.name}: max|diff|/max|ref| vs the exact run: pagedkit {ours_err.max_rel:.3e}, "
          f"onnxruntime-genai {genai_err.max_rel:.3e}")
    assert ours_err.max_rel <= NO_WORSE * genai_err.max_rel, (ours_err.max_rel, genai_err.max_rel)
    # (c) as built, pagedkit vs genai
    report = parity(hist4, as_ref(ref4), INT4_TOL)
    text = "\n".join(report.lines())
    print(f"{model_dir.name} pagedkit vs onnxruntime-genai (both int4):\n{text}")
    genai_off = {s.step for s in genai_err.steps if s.rel > INT4_TOL}  # genai's own int4 run far from exact
    assert all(s.rel <= INT4_TOL or s.step in genai_off for s in report.steps), text
    assert all(s.step in genai_off for s in report.disagreements), text
    assert len(genai_off) <= 3, f"genai's int4 run is off the exact one at steps {sorted(genai_off)}"


@pytest.mark.parametrize("family, layout", [
    ("llama", "int4"),
    pytest.param("llama", "int4-asym-b64", marks=pytest.mark.slow),
    pytest.param("qwen3", "int4", marks=pytest.mark.slow),
    pytest.param("gemma2", "int4", marks=pytest.mark.slow),
    pytest.param("gpt_oss", "int4", marks=pytest.mark.slow),
])
def test_int4_matches_genai(root, family, layout):
    check_int4(build(root, family, layout))


def test_int4_comparison_has_teeth(root):
    """One MatMulNBits scale (the largest of the lm_head's) 2% off fails the tight comparison (a)."""
    exact_dir = exact_copy(build(root, "llama", "int4"))

    def edit(model):
        init = next(t for t in model.graph.initializer if t.name == "lm_head.MatMul.weight_scales")
        s = onnx.numpy_helper.to_array(init).copy()
        i = np.unravel_index(np.abs(s).argmax(), s.shape)
        s[i] *= 1.02
        init.CopyFrom(onnx.numpy_helper.from_array(s, init.name))

    bad = rewritten_copy(exact_dir, exact_dir.with_name(exact_dir.name + "-scale2pct"), edit)
    ref0 = genai_logits(exact_dir)
    history, _ = ours(bad)
    report = parity(history, as_ref(ref0), FP32_TOL)
    print("\n" + "\n".join(report.lines()))
    assert report.max_rel > 10 * FP32_TOL
    with pytest.raises(AssertionError):
        check_tight(history, ref0, "perturbed")
