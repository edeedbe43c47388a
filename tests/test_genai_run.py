"""onnxruntime-genai builder models run unchanged through pagedkit.InferenceSession and match Hugging Face
eager (float32) teacher-forced over 16 decode steps, in both of the builder's layouts:
- paged (fp16, PagedAttention): caches owned by the KV block manager over a shuffled block pool, poisoned
  with large random values before the first write, a prompt spanning several blocks (and, for the
  windowed families, longer than the window, so the ring recycles blocks);
- GQA (fp32 CPU, GroupQueryAttention): caches grown step by step (windowed layers: fixed window buffer).
Our logits at each step must be within tol * max|ref| of HF's at the same position (1e-4 fp32, 2e-2
fp16), and our greedy token must equal HF's except at near-ties (HF's top-2 logits within the
tolerance), which the test reports.

Llama, Qwen3 (QK-norm), Gemma 2 (sliding window + softcap) and GPT-OSS (sinks, MoE, YaRN). The checkpoints
are written here (random weights at a scale that keeps logits far from flat); the builder is onnxruntime-genai's
own, through tests/genai_models.py, all eight models in one builder process (the `genai_root` fixture).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("onnxruntime_genai")
transformers = pytest.importorskip("transformers")

import genai_models  # noqa: E402
from pagedkit.runtime.generate import TOLERANCES, Generator  # noqa: E402
from pagedkit.runtime.parity import hf_logits, load_hf, parity  # noqa: E402

STEPS = 16
PROMPT = [1, 17, 5, 9, 33, 70, 4, 101, 66, 12, 45, 3, 88, 27, 54, 7, 99, 31, 120, 61] * 2  # 40 tokens


def write_checkpoint(family: str, out: Path, seed: int = 0) -> Path:
    """A random tiny checkpoint of `family` (genai_models.FAMILIES config) with weights at
    1.5 / sqrt(fan_in) and non-trivial norm gains, plus the local tokenizer the builder needs."""
    cls, extra = genai_models.FAMILIES[family]
    config = getattr(transformers, cls)(**(genai_models._COMMON | extra))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                base = 1.0 if "norm" in name and not family.startswith("gemma") else 0.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 / math.sqrt(p.shape[-1])))
    model.save_pretrained(out)
    genai_models._save_tokenizer(out, config.vocab_size)
    return out


def build(root: Path, family: str, layout: str) -> tuple[Path, Path]:
    """(builder model folder, HF checkpoint folder), built once under root; skips on a builder failure."""
    hf = root / f"hf-{family}"
    if not (hf / "config.json").exists():
        write_checkpoint(family, hf)
    out = root / f"{family}-{layout}"
    if not (out / "model.onnx").exists():
        try:
            genai_models.run_builder(hf, out, layout, root / "cache")
        except genai_models.BuilderFailed as exc:
            pytest.skip(f"onnxruntime-genai builder could not build {family}/{layout}: {exc}")
    return out, hf


def shared_root(tmp_path_factory) -> Path:
    """One build folder per pytest session, shared by the runtime test modules."""
    root = tmp_path_factory.getbasetemp() / "runtime-genai"
    root.mkdir(exist_ok=True)
    return root


FAMILIES = ("llama", "qwen3", "gemma2", "gpt_oss")


@pytest.fixture(scope="session")
def genai_root(tmp_path_factory) -> Path:
    """The shared folder, with every family's two layouts built up front in one builder process (~5 s: the
    builder's imports; a build is ~0.05 s); what that cannot build, each test's `build` builds or reports."""
    from functools import partial

    root = shared_root(tmp_path_factory)
    genai_models.prebuild([(root / f"hf-{f}", partial(write_checkpoint, f), root / f"{f}-{layout}", layout)
                           for f in FAMILIES for layout in ("paged", "gqa")], root / "cache")
    return root


def hf_greedy(hf_model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(torch.argmax(hf_logits(hf_model, ids)[-1])))
    return ids[len(prompt):]


def poison(gen: Generator, seed: int = 0) -> None:
    """Fill every cache with large random values: a read of a slot never written shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    for kinds in gen.state.mgr.caches.values():
        for t in kinds.values():
            t.copy_((torch.randn(t.shape, generator=g) * 50).to(t.dtype))


def check_parity(model_dir: Path, hf_dir: Path, layout: str) -> None:
    kw = dict(block_size=16, shuffle_seed=11) if layout == "paged" else {}
    gen = Generator(model_dir, **kw)
    if layout == "paged":
        poison(gen)
        assert len(gen.state.mgr.pools) == (2 if gen.config.windowed_layers else 1)
    hf = load_hf(hf_dir)
    forced = hf_greedy(hf, PROMPT, STEPS)
    steps = gen.teacher_forced(PROMPT, forced)
    assert [s.position for s in steps] == list(range(len(PROMPT) - 1, len(PROMPT) - 1 + STEPS))
    ref = hf_logits(hf, PROMPT + forced)
    report = parity(gen.history, ref, TOLERANCES[gen.dtype])
    text = "\n".join(report.lines())
    print(f"\n{model_dir.name}:\n{text}")  # near-ties are reported here (pytest -s / -rA)
    assert gen.dtype == (torch.float16 if layout == "paged" else torch.float32)
    assert len(report.steps) == STEPS
    assert report.max_rel <= report.tol, text
    assert not report.disagreements, text
    assert sum(s.agree for s in report.steps) >= STEPS - sum(s.near_tie for s in report.steps)
    if layout == "paged":
        assert gen.state.mgr.check_invariants() == []
        assert all(gen.state.mgr.num_free_blocks(g) == gen.state.mgr.pools[g].num_blocks for g in gen.state.mgr.pools)


@pytest.mark.parametrize("layout", ["paged", "gqa"])
def test_llama_matches_hf(genai_root, layout):
    model_dir, hf_dir = build(genai_root, "llama", layout)
    check_parity(model_dir, hf_dir, layout)


@pytest.mark.parametrize("layout", ["paged", "gqa"])
@pytest.mark.parametrize("family", ["qwen3", "gemma2", "gpt_oss"])
def test_other_families_match_hf(genai_root, family, layout):
    model_dir, hf_dir = build(genai_root, family, layout)
    check_parity(model_dir, hf_dir, layout)


def test_greedy_generation_is_teacher_forcing_on_its_own_tokens(genai_root):
    """Free-running greedy generation yields the tokens whose teacher-forced logits it reports."""
    model_dir, _ = build(genai_root, "llama", "paged")
    gen = Generator(model_dir, block_size=16, shuffle_seed=5)
    tokens = [s.token for s in gen.greedy(PROMPT[:7], max_new_tokens=6, stop_at_eos=False)]
    assert len(tokens) == 6 and tokens == [int(torch.argmax(s.logits)) for s in gen.history.steps]
    replay = Generator(model_dir, block_size=16, shuffle_seed=6, session=gen.session)
    again = replay.teacher_forced(PROMPT[:7], tokens)
    for a, b in zip(gen.history.steps, again):
        torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=0)  # block placement never matters
