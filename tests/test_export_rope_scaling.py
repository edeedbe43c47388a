"""paged-export, RoPE scalings on real configuration shapes (tiny Llamas; tests/family_harness.py): "linear",
"dynamic" (NTK), "yarn" (its attention factor folded into cos / sin), "llama3" — each at fp16 parity with HF
eager over positions where the scaling changes the table (prompts 11 / 37 + 6 steps: positions 0..42; linear
divides every position by its factor, llama3 (original 16, so wavelengths past 16 / 4 positions) and YaRN change
the low frequencies, YaRN also scales cos / sin by its attention factor), with teeth: the unscaled table
substituted fails parity (YaRN also: its attention factor dropped).

"dynamic" is exactly the unscaled table up to max_position_embeddings (Hugging Face rescales only once a
sequence passes it), so its exported table cannot differ from the unscaled one there; its teeth is the refusal
of a longer --max-seq-len (one line naming the field), and a model exported past it anyway (the check patched
out) fails parity once the prompts pass max_position_embeddings. LongRoPE: tests/test_export_phi3.py."""

from __future__ import annotations

import copy

import pytest

from export_utils import TOL
from family_harness import FamilyCase, _parity, check_export, check_teeth, export_case

THETA = 10000.0
CASES = {
    "linear": FamilyCase("LlamaConfig", seed=7, overrides=dict(
        rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": THETA})),
    "dynamic": FamilyCase("LlamaConfig", seed=7, overrides=dict(
        rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": THETA})),
    # attention_factor left to Hugging Face's default, 0.1 ln(factor) + 1 = 1.139, folded into cos / sin
    "yarn": FamilyCase("LlamaConfig", seed=7, overrides=dict(
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "rope_theta": THETA})),
    "llama3": FamilyCase("LlamaConfig", seed=7, overrides=dict(
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16, "rope_theta": THETA})),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_rope_scaling_parity(tmp_path, kind):
    print(kind, check_export(CASES[kind], tmp_path, "fp16"))


def _unscaled(m):
    """The plain rope_theta table (rope_type "default") instead of the scaled one."""
    from pagedkit.exporters.families.llama import LlamaFamily
    from pagedkit.exporters.graph import rotary_tables

    def tables(self, model, n):
        rot = model.model.rotary_emb
        cfg = copy.deepcopy(rot.config)
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": THETA}
        return {"cos_cache": rotary_tables(type(rot)(config=cfg), n)}
    m.setattr(LlamaFamily, "rope_tables", tables)


def _no_attention_factor(m):
    """YaRN's frequencies with its attention factor (mscale on cos / sin) dropped."""
    from pagedkit.exporters.families.llama import LlamaFamily

    real = LlamaFamily.rope_tables

    def tables(self, model, n):
        s = model.model.rotary_emb.attention_scaling
        assert s > 1.1
        return {k: (cos / s, sin / s) for k, (cos, sin) in real(self, model, n).items()}
    m.setattr(LlamaFamily, "rope_tables", tables)


@pytest.mark.parametrize("kind, patch", [("linear", _unscaled), ("yarn", _unscaled), ("yarn", _no_attention_factor),
                                         ("llama3", _unscaled)],
                         ids=["linear-unscaled", "yarn-unscaled", "yarn-attention_factor", "llama3-unscaled"])
def test_rope_scaling_has_teeth(tmp_path, monkeypatch, kind, patch):
    check_teeth(CASES[kind], tmp_path, monkeypatch, patch)


def test_dynamic_refuses_longer_context(tmp_path):
    with pytest.raises(ValueError) as err:
        export_case(CASES["dynamic"], tmp_path, "fp16", max_seq_len=512)
    msg = str(err.value)
    assert "\n" not in msg and "--max-seq-len 512" in msg and "'dynamic'" in msg and "max_position_embeddings 256" in msg


# max_position_embeddings 32 < prompts 37 / 45: Hugging Face rescales the frequencies for these lengths
DYNAMIC_SHORT = FamilyCase("LlamaConfig", seed=7, prompt_lens=(37, 45), overrides=dict(
    max_position_embeddings=32, rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": THETA}))


def test_dynamic_refusal_has_teeth(tmp_path, monkeypatch):
    """Exported past max_position_embeddings anyway (the check patched out, a 64-position table), the model
    fails parity: the refusal guards a real difference."""
    from pagedkit.exporters.families import base

    with pytest.raises(ValueError):
        export_case(DYNAMIC_SHORT, tmp_path / "refused", "fp16", max_seq_len=64)

    with monkeypatch.context() as m:
        m.setattr(base, "check_context", lambda config, context: None)
        out = export_case(DYNAMIC_SHORT, tmp_path / "broken", "fp16", max_seq_len=64)
    with pytest.raises(AssertionError, match="max\\|diff\\||greedy argmax"):
        _parity(DYNAMIC_SHORT, out, TOL)
