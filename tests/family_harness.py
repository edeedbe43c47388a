"""The checks every exporter family passes (issue 34), in one place; each family's test file declares its
`FamilyCase` (a tiny random configuration) and its feature teeth, and calls these.

- `check_export(case, dtype)`: export fp32 / fp16, validate (pagedkit's validator, onnx.checker, genai's config
  parser), then pagedkit.InferenceSession teacher-forced over two sequences (prompts of 11 and 37 tokens,
  scattered blocks, poisoned caches) for `case.steps` (>= 6) decode steps against Hugging Face eager float32:
  max|diff| <= tol x max|ref| at every step, greedy equal except at near-ties.
    fp16: tol 2e-2 (export_utils.TOL).
    fp32: PagedAttention's T is float16 / bfloat16 only (contract-decisions §6: the graph must stay loadable
    by onnxruntime-gpu), so an fp32 export rounds Q / K / V, cos / sin and the attention output to float16 at
    the node. Against plain HF eager it is checked at FP32_TOL = 8e-3 (test_export_fp32.py measures why);
    against HF eager with exactly that rounding emulated (`fp16_node_boundary`) at 1e-3: everything outside
    the node is float32-exact.
- `check_decomposed(case)`: the fp16 export with every PagedAttention node decomposed into standard ONNX ops
  (`paged-rewrite --to decomposed`'s rewrite), run by stock onnxruntime CPU through the same runner, against
  Hugging Face at 2e-2.
- `check_teeth(case, patch)`: `patch(monkeypatch)` breaks one feature of the family (drops a bias, a
  multiplier, a rule); the export must then fail the fp16 parity check.

One Hugging Face model and its reference logits are built once per case (module cache), so the exports of a
case (fp32, fp16, decomposed, teeth) share them.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

from export_utils import TOL, assert_valid_export, check_parity, export_tiny, tiny_model

FP32_TOL = 8e-3  # fp32 export vs plain HF eager (the node's fp16 boundary; tests/test_export_fp32.py)
FP32_BOUNDARY_TOL = 1e-3  # fp32 export vs HF eager with the node's fp16 rounding emulated


@dataclass(frozen=True)
class FamilyCase:
    """A tiny random Hugging Face model of one family: `config` is a transformers config class name,
    `overrides` its arguments on top of export_utils.TINY."""

    config: str
    overrides: dict = field(default_factory=dict, hash=False)
    seed: int = 0
    steps: int = 6
    prompt_lens: tuple = (11, 37)
    chunk: int | None = None  # prefill chunk (windowed models: a ring table needs chunks of <= ring capacity)
    boundary: bool = True  # the fp32 check against HF with the node's fp16 rounding emulated applies
    near_tie: float | None = None  # None: export_utils.NEAR_TIE

    @property
    def key(self) -> tuple:
        return (self.config, self.seed, repr(sorted(self.overrides.items())))


_MODELS: dict[tuple, tuple[torch.nn.Module, dict]] = {}


def model_of(case: FamilyCase) -> tuple[torch.nn.Module, dict]:
    """(HF model, reference memo) of a case, built once per test session."""
    if case.key not in _MODELS:
        _MODELS[case.key] = (tiny_model(case.config, seed=case.seed, **case.overrides), {})
    return _MODELS[case.key]


def torch_session(model_dir: Path):
    """pagedkit's session with the CPU backend pinned to torch (what these tests cover stays put when the
    default CPU backend changes)."""
    from pagedkit import InferenceSession

    return InferenceSession(str(Path(model_dir) / "model.onnx"), cpu_backend="torch")


def _parity(case: FamilyCase, model_dir: Path, tol: float, session=None, **kw):
    hf, memo = model_of(case)
    extra = {} if case.near_tie is None else {"near_tie": case.near_tie}
    return check_parity(hf, model_dir, prompt_lens=case.prompt_lens, steps=case.steps, chunk=case.chunk, tol=tol,
                        reference=memo, session=session if session is not None else torch_session(model_dir),
                        **extra, **kw)


def export_case(case: FamilyCase, out: Path, dtype: str = "fp16", **opts) -> Path:
    hf, _ = model_of(case)
    export_tiny(hf, out, dtype=dtype, **opts)
    return out


def check_export(case: FamilyCase, tmp_path: Path, dtype: str) -> dict:
    """Export in `dtype`, validate, parity vs HF (see the module doc). Returns the worst ratios."""
    out = export_case(case, tmp_path / dtype, dtype)
    assert_valid_export(out)
    if dtype == "fp16":
        return {"fp16": _parity(case, out, TOL).worst_ratio}
    worst = {"fp32": _parity(case, out, FP32_TOL).worst_ratio}
    if case.boundary:
        hf, _ = model_of(case)
        with fp16_node_boundary(hf, out):
            worst["fp32_boundary"] = check_parity(hf, out, prompt_lens=case.prompt_lens, steps=case.steps,
                                                  chunk=case.chunk, tol=FP32_BOUNDARY_TOL,
                                                  session=torch_session(out)).worst_ratio
    return worst


def check_builtin(name: str, tmp_path: Path, *, num_layers: int = 4, num_experts: int | None = None,
                  max_seq_len: int = 4096, steps: int = 6) -> float:
    """A built-in real configuration (pagedkit/exporters/builtin/NAME.json) cut to `num_layers` layers (and
    `num_experts` routed experts), random weights (Hugging Face's init): exported in fp16, validated, and run
    against HF eager float32 built from the same configuration and weights (2e-2, greedy up to near-ties).
    Memory: HF's reference logits are computed first, the model is dropped once the graph is built (the
    export's own holder), and the session then runs alone: the peak is the float32 model plus the fp16 graph."""
    import gc
    from types import SimpleNamespace

    from export_utils import hf_greedy_sequence

    from pagedkit.exporters.export import _export
    from pagedkit.exporters.families.base import ExportOptions
    from pagedkit.exporters.weights import load_model

    loaded = load_model(name, num_layers=num_layers, num_experts=num_experts, seed=0, dtype=torch.float32)
    holder = [loaded.model.eval()]
    config = loaded.model.config
    del loaded
    prompt_lens, seed = (11, 20), 0
    rng = np.random.default_rng(seed)  # the prompts check_parity draws (same generator, same order)
    memo = {}
    for n in prompt_lens:
        prompt = [int(t) for t in rng.integers(3, config.vocab_size, n)]
        memo[(tuple(prompt), steps)] = hf_greedy_sequence(holder[0], prompt, steps)
    out = tmp_path / name
    _export(holder, out, ExportOptions(progress=False, max_seq_len=max_seq_len), weights="random", source=None,
            tokenizer_dir=None, weight_format="fp16", calibration=None, percentile=100.0, validate=True)
    gc.collect()
    assert_valid_export(out)
    stub = SimpleNamespace(config=config)  # every reference is memoized: HF is not run again
    worst = check_parity(stub, out, prompt_lens=prompt_lens, steps=steps, seed=seed, reference=memo,
                         session=torch_session(out)).worst_ratio
    import shutil

    shutil.rmtree(out)  # gigabytes each: a slow run over every built-in would fill the disk
    return worst


def check_decomposed(case: FamilyCase, tmp_path: Path) -> float:
    """The fp16 export decomposed into standard ONNX ops, in stock onnxruntime CPU, vs HF (2e-2)."""
    import onnx

    from pagedkit.rewriters.decompose import decompose

    out = export_case(case, tmp_path / "fp16", "fp16")
    model, report = decompose(onnx.load(str(out / "model.onnx")))
    assert report.changed and not report.skipped, report
    assert not [n for n in model.graph.node if n.op_type == "PagedAttention"]
    return _parity(case, out, TOL, session=OrtSession(model)).worst_ratio


def check_teeth(case: FamilyCase, tmp_path: Path, monkeypatch, patch: Callable) -> None:
    """`patch(monkeypatch)` breaks one family feature: the fp16 export must then fail the parity check."""
    with monkeypatch.context() as m:
        patch(m)
        out = export_case(case, tmp_path / "broken", "fp16")
    with pytest.raises(AssertionError, match="max\\|diff\\||greedy argmax"):
        _parity(case, out, TOL)


class OrtSession:
    """A stock onnxruntime CPU session with the two methods PagedRunner uses (get_inputs, run_torch)."""

    def __init__(self, model):
        import onnxruntime as ort

        self.sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        self.names = [o.name for o in self.sess.get_outputs()]

    def get_inputs(self):
        return self.sess.get_inputs()

    def run_torch(self, feeds: dict) -> dict:
        wanted = {i.name for i in self.sess.get_inputs()}
        arrays = {k: v.numpy() if isinstance(v, torch.Tensor) else np.asarray(v) for k, v in feeds.items()
                  if k in wanted}
        return {n: torch.from_numpy(np.ascontiguousarray(v)) for n, v in zip(self.names, self.sess.run(None, arrays))}


# ---- HF eager with the attention node's float16 boundary ---------------------------------------------------

def _r16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16).to(t.dtype)


@contextlib.contextmanager
def fp16_node_boundary(hf, model_dir: Path):
    """HF eager with float16 rounding where an fp32 export's PagedAttention node has it: Q / K (and cos / sin)
    entering RoPE (the modeling module's apply_rotary_pos_emb), Q / K / V entering attention and its output
    (a registered attention function around the module's eager_attention_forward), and — when the export fuses
    QK-norm into the node — the q_norm / k_norm inputs and gains."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    mod = importlib.import_module(type(hf).__module__)

    def attention(module, query, key, value, attention_mask, **kw):
        out, w = mod.eager_attention_forward(module, _r16(query), _r16(key), _r16(value), attention_mask, **kw)
        return _r16(out), w

    AttentionInterface.register("pagedkit_fp16_boundary", attention)
    AttentionMaskInterface.register("pagedkit_fp16_boundary", eager_mask)
    saved, hooks = {}, []
    from export_utils import attention_attrs

    fused_qk = any("q_norm_weight" in a["inputs"] for a in attention_attrs(Path(model_dir) / "model.onnx"))
    # a QK-norm fused into the node normalizes the rounded Q / K (rounded by the q_norm / k_norm hooks below) and
    # rotates the result in float32: no rounding between the norm and RoPE
    qk_in = (lambda t: t) if fused_qk else _r16
    rope_fn = getattr(mod, "apply_rotary_pos_emb", None)
    if rope_fn is not None:
        def rope(q, k, cos, sin, *a, **kw):
            return rope_fn(qk_in(q), qk_in(k), _r16(cos), _r16(sin), *a, **kw)
        mod.apply_rotary_pos_emb = rope
    cis_fn = getattr(mod, "apply_rotary_emb", None)  # Llama 4: complex freqs_cis = cos + i sin
    if cis_fn is not None:
        def rope_cis(q, k, freqs_cis, *a, **kw):
            return cis_fn(_r16(q), _r16(k), torch.complex(_r16(freqs_cis.real), _r16(freqs_cis.imag)), *a, **kw)
        mod.apply_rotary_emb = rope_cis
    if fused_qk:
        for name, m in hf.named_modules():
            # a weightless norm (Llama 4's qk_norm, after RoPE) reads Q / K rounded before RoPE already
            if name.endswith(("q_norm", "k_norm")) and getattr(m, "weight", None) is not None:
                saved[name] = m.weight.detach().clone()
                with torch.no_grad():
                    m.weight.copy_(_r16(m.weight))
                hooks.append(m.register_forward_pre_hook(lambda m, args: (_r16(args[0]),) + tuple(args[1:])))
    previous = hf.config._attn_implementation
    hf.set_attn_implementation("pagedkit_fp16_boundary")
    try:
        yield
    finally:
        hf.set_attn_implementation(previous)
        if rope_fn is not None:
            mod.apply_rotary_pos_emb = rope_fn
        if cis_fn is not None:
            mod.apply_rotary_emb = cis_fn
        for h in hooks:
            h.remove()
        modules = dict(hf.named_modules())
        with torch.no_grad():
            for name, w in saved.items():
                modules[name].weight.copy_(w)
