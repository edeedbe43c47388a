"""paged-export, Gemma 2: sandwich norms with (1 + w) gains, embedding scale, attention softcap (node),
final-logit softcap (graph), query_pre_attn_scalar scale, alternating sliding / full layers; the sliding
layers read block_table_windowed (a ring whose block ids repeat), as onnxruntime-genai; chunked prefill
(as the ring requires) over prompts long enough to wrap the ring.

The query projections are scaled by Q_GAIN so that HF's attention scores reach the softcap's tanh regime
(asserted: max |scaled score| > attn_logit_softcapping); with the plain tiny weights they stay below 10
and removing the softcap moved the logits by 0.016 x max|ref|, inside the 2e-2 bound. The teeth: the
softcap removed, the window one position shorter or longer, or a 5% wrong scale must fail the parity check.
"""

from __future__ import annotations

import json

import pytest
import torch

from export_utils import (assert_valid_export, attention_attrs, check_parity, export_tiny, io_signature,
                          mutated_export, tiny_model)

SOFTCAP = 20.0
Q_GAIN = 3.0  # q_proj x 3: max |score| about 1.5 x SOFTCAP on the test sequences
KW = dict(prompt_lens=(11, 37), chunk=16)  # 37 + 16 > 3 ring blocks: the ring wraps


def tiny_gemma2():
    """The tiny Gemma 2 of these tests (window 8, softcaps, Q scaled so scores exceed the softcap)."""
    hf = tiny_model("Gemma2Config", seed=6, num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=24,
                    attn_logit_softcapping=SOFTCAP, final_logit_softcapping=10.0)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.q_proj.weight.mul_(Q_GAIN)
    return hf


@pytest.fixture(scope="module")
def gemma2():
    return tiny_gemma2()


@pytest.fixture(scope="module")
def gemma2_dir(gemma2, tmp_path_factory):
    out = tmp_path_factory.mktemp("gemma2")
    export_tiny(gemma2, out)
    return out


class score_range:
    """Context manager: the largest |scaled score| (before the softcap) HF's eager attention computes over
    the admitted keys, and the fraction of admitted scores beyond the softcap."""

    def __init__(self):
        import transformers.models.gemma2.modeling_gemma2 as gm

        self.gm, self.largest, self.beyond = gm, 0.0, []

    def __enter__(self):
        gm, orig = self.gm, self.gm.eager_attention_forward
        self.orig = orig

        def recording(module, query, key, value, attention_mask, *args, scaling=None, softcap=None, **kw):
            k = gm.repeat_kv(key, module.num_key_value_groups)
            s = (torch.matmul(query, k.transpose(2, 3)) * scaling).abs()
            admitted = torch.ones_like(s, dtype=torch.bool) if attention_mask is None else (attention_mask == 0)
            s = torch.where(admitted, s, 0.0)
            self.largest = max(self.largest, float(s.max()))
            self.beyond.append(float((s > softcap).sum() / admitted.expand_as(s).sum()))
            return orig(module, query, key, value, attention_mask, *args, scaling=scaling, softcap=softcap, **kw)

        gm.eager_attention_forward = recording
        return self

    def __exit__(self, *exc):
        self.gm.eager_attention_forward = self.orig
        return False


def test_gemma2_parity_fp16(gemma2, gemma2_dir):
    assert_valid_export(gemma2_dir)
    attrs = attention_attrs(gemma2_dir / "model.onnx")
    assert [a.get("local_window_size", -1) for a in attrs] == [8, -1, 8]
    assert [a["inputs"]["block_table"] for a in attrs] == ["block_table_windowed", "block_table",
                                                           "block_table_windowed"]
    for a in attrs:
        assert a["softcap"] == pytest.approx(SOFTCAP)
        assert a["scale"] == pytest.approx(24 ** -0.5)
    sig = io_signature(gemma2_dir / "model.onnx")
    assert sig["block_table_windowed"][2] == 2
    cfg = json.loads((gemma2_dir / "genai_config.json").read_text())
    sw = cfg["model"]["decoder"]["sliding_window"]
    assert sw["window_size"] == 8 and sw["layers"] == [0, 2]
    assert cfg["search"]["chunk_size"] == 16 and cfg["engine"]["dynamic_batching"]["prefix_caching"] is False
    with score_range() as sr:
        rep = check_parity(gemma2, gemma2_dir, **KW)
    print(f"gemma2: worst {rep.worst_ratio:.4g}, near-ties {rep.near_ties}; HF max |score| {sr.largest:.1f} "
          f"(softcap {SOFTCAP}), {100 * max(sr.beyond):.2g}% of a call's scores beyond it")
    assert sr.largest > SOFTCAP, f"HF's scores (max {sr.largest:.3g}) never reach the softcap: it is untested"


@pytest.mark.parametrize("change", [dict(softcap=0.0), dict(window=7), dict(window=9), dict(scale=1.05 * 24 ** -0.5)],
                         ids=["softcap-removed", "window-7", "window-9", "scale+5%"])
def test_gemma2_parity_has_teeth(gemma2, gemma2_dir, tmp_path, change):
    bad = mutated_export(gemma2_dir, tmp_path / "bad", **change)
    with pytest.raises(AssertionError, match="max\\|diff\\|") as exc:
        check_parity(gemma2, bad, steps=4, **KW)  # fails at the first step beyond the bound
    print(f"gemma2 teeth {change}: {exc.value}")
