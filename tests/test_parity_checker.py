"""pagedkit.runtime.parity's pieces one by one: the step numbers (rel, agree, the bound at its edge), the report's
text, the shape check, which paths count as GGUF, how load_hf calls transformers (offline, no remote code,
eager float32, the first N layers), and recorded_source. The oracle is arithmetic done here by hand."""

from __future__ import annotations

import pytest
import torch

from pagedkit.runtime import parity as P
from pagedkit.runtime.generate import History, StepResult

TOL = 1e-2


def _step(diff: float, max_ref: float, ours: int = 0, ref: int = 0, near_tie: bool = False, gap: float = 1.0):
    return P.ParityStep(0, 5, diff, max_ref, ours, ref, near_tie, gap)


# ---- ParityStep / ParityReport arithmetic -----------------------------------------------------------------


@pytest.mark.parametrize("diff,max_ref", [(0.3, 12.0), (2.5, 4.0), (7.0, 0.5)])
def test_rel_is_the_difference_over_the_largest_magnitude(diff, max_ref):
    assert _step(diff, max_ref).rel == pytest.approx(diff / max_ref, rel=1e-12)


def test_rel_of_an_all_zero_reference_is_huge_not_negative():
    s = _step(1e-3, 0.0)
    assert s.rel == pytest.approx(1e-3 / 1e-30, rel=1e-9)
    assert _step(0.0, 0.0).rel == 0.0


@pytest.mark.parametrize("ours,ref,agree", [(3, 3, True), (2, 3, False), (4, 3, False)])
def test_agree_only_on_the_same_token(ours, ref, agree):
    assert _step(0.0, 1.0, ours, ref).agree is agree


def test_an_empty_report_has_max_rel_zero():
    rep = P.ParityReport([], TOL)
    assert rep.max_rel == 0.0 and rep.ok


@pytest.mark.parametrize("rel,ok", [(TOL, True), (TOL * 0.5, True), (TOL * 1.0001, False)])
def test_the_bound_holds_at_its_edge(rel, ok):
    rep = P.ParityReport([_step(rel * 8.0, 8.0)], TOL)
    assert rep.ok is ok
    flagged = rep.lines()[1].endswith("> tol")
    assert flagged is (not ok)


def test_max_rel_is_the_largest_step():
    rep = P.ParityReport([_step(0.01, 1.0), _step(0.5, 10.0), _step(0.02, 1.0)], TOL)
    assert rep.max_rel == pytest.approx(0.05)


def test_the_report_prints_the_tolerance_in_logits():
    # tol * max_ref = 0.01 * 8 = 0.08 logits, printed in both flip messages
    tie = _step(0.01, 8.0, ours=1, ref=2, near_tie=True, gap=0.05)
    real = _step(0.01, 8.0, ours=1, ref=2, near_tie=False, gap=0.5)
    lines = P.ParityReport([tie, real], TOL).lines()
    assert "differ (near-tie: HF top-2 gap 0.05 < tol 0.08)" in lines[1]
    assert "DIFFER (HF top-2 gap 0.5 >= tol 0.08)" in lines[2]
    assert "parity FAIL" in lines[-1] and "1 real disagreements" in lines[-1] and "1 flips at near-ties" in lines[-1]
    assert "0/2 greedy tokens agree" in lines[-1]


def test_the_report_prints_rel_and_diff():
    line = P.ParityReport([_step(0.25, 10.0)], 0.5).lines()[1]
    assert "2.500e-01" in line and "2.500e-02" in line and "agree" in line


# ---- parity(): the shape check ---------------------------------------------------------------------------


def _history(rows):
    hist = History(prompt=[0])
    for k, row in enumerate(rows):
        hist.steps.append(StepResult(token=0, logits=torch.tensor(row), position=k, seconds=0.0))
    return hist


@pytest.mark.parametrize("ours_v", [3, 5])
def test_a_vocabulary_mismatch_is_refused_naming_both_shapes(ours_v):
    hist = _history([[1.0] * ours_v])
    with pytest.raises(ValueError, match=rf"step 0: our logits have shape \({ours_v},\), the reference's \(4,\)"):
        P.parity(hist, torch.zeros(1, 4), TOL)


def test_parity_reads_the_reference_at_each_step_position():
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(6, 9, generator=g)
    hist = History(prompt=[0])
    for pos in (2, 5):
        ours = ref[pos] + 0.001 * torch.randn(9, generator=g)
        hist.steps.append(StepResult(token=0, logits=ours, position=pos, seconds=0.0))
    rep = P.parity(hist, ref, TOL)
    for s, pos in zip(rep.steps, (2, 5)):
        r, o = ref[pos].double(), hist.steps[s.step].logits.double()
        assert s.position == pos
        assert s.max_ref == pytest.approx(float(r.abs().max()))
        assert s.max_abs_diff == pytest.approx(float((o - r).abs().max()), rel=1e-5)
        top = sorted(r.tolist(), reverse=True)
        assert s.gap == pytest.approx(top[0] - top[1], rel=1e-5)
        assert s.ref == int(r.argmax()) and s.ours == int(o.argmax())


# ---- which paths are GGUF ---------------------------------------------------------------------------------


def test_is_gguf(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert P._is_gguf(f)
    for name in ("m.bin", "m.safetensors", "m.zzz", "m.a"):  # suffixes ordered below and above ".gguf"
        other = tmp_path / name
        other.write_bytes(b"x")
        assert not P._is_gguf(other), name
    one = tmp_path / "one"
    one.mkdir()
    (one / "a.gguf").write_bytes(b"GGUF")
    assert P._is_gguf(one)
    hf = tmp_path / "hf"  # a checkpoint folder that also holds a .gguf: read as HF
    hf.mkdir()
    (hf / "a.gguf").write_bytes(b"GGUF")
    (hf / "config.json").write_text("{}")
    assert not P._is_gguf(hf)
    two = tmp_path / "two"
    two.mkdir()
    (two / "a.gguf").write_bytes(b"GGUF")
    (two / "b.gguf").write_bytes(b"GGUF")
    assert not P._is_gguf(two)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert not P._is_gguf(empty)
    assert not P._is_gguf(tmp_path / "missing.gguf")


# ---- load_hf: how it calls transformers ------------------------------------------------------------------


class _Spy:
    """Records transformers' from_pretrained calls; returns a stand-in model / the real config object."""

    def __init__(self, monkeypatch, config=None):
        import transformers

        self.calls = []
        spy = self

        class _Model:
            def eval(self):
                return self

        def model_from_pretrained(path, *args, **kwargs):
            spy.calls.append(("model", path, kwargs))
            return _Model()

        def config_from_pretrained(path, *args, **kwargs):
            spy.calls.append(("config", path, kwargs))
            return config

        monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", model_from_pretrained)
        monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", config_from_pretrained)


def test_load_hf_stays_offline_eager_float32_without_remote_code(tmp_path, monkeypatch):
    spy = _Spy(monkeypatch)
    P.load_hf(tmp_path)
    ((kind, path, kw),) = spy.calls
    assert kind == "model" and path == str(tmp_path)
    assert kw["local_files_only"] is True and kw["trust_remote_code"] is False
    assert kw["dtype"] == torch.float32 and kw["attn_implementation"] == "eager"
    assert "gguf_file" not in kw and "config" not in kw


def test_load_hf_refuses_a_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint folder not found"):
        P.load_hf(tmp_path / "nope")


@pytest.mark.parametrize("as_folder", [False, True])
def test_load_hf_reads_a_gguf_file_or_its_folder(tmp_path, monkeypatch, as_folder):
    folder = tmp_path / "g"
    folder.mkdir()
    (folder / "model-q4.gguf").write_bytes(b"GGUF")
    spy = _Spy(monkeypatch)
    P.load_hf(folder if as_folder else folder / "model-q4.gguf")
    ((_, path, kw),) = spy.calls
    assert path == str(folder) and kw["gguf_file"] == "model-q4.gguf"


def _config(layers: int, layer_types: bool):
    from transformers import Qwen2Config

    cfg = Qwen2Config(num_hidden_layers=layers, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=64)
    if layer_types:
        cfg.layer_types = [("sliding_attention" if i % 2 else "full_attention") for i in range(layers)]
    else:
        cfg.layer_types = None
    return cfg


@pytest.mark.parametrize("layer_types", [False, True])
@pytest.mark.parametrize("num_layers,expect", [(2, 2), (3, 3), (5, 3)])
def test_load_hf_keeps_the_first_num_layers(tmp_path, monkeypatch, num_layers, expect, layer_types):
    cfg = _config(3, layer_types)
    spy = _Spy(monkeypatch, config=cfg)
    P.load_hf(tmp_path, num_layers=num_layers)
    (ckind, cpath, ckw), (mkind, mpath, mkw) = spy.calls
    assert (ckind, mkind) == ("config", "model") and cpath == mpath == str(tmp_path)
    assert ckw["local_files_only"] is True and ckw["trust_remote_code"] is False
    assert mkw["config"] is cfg and cfg.num_hidden_layers == expect
    if layer_types:
        full = ["full_attention", "sliding_attention", "full_attention"]
        assert cfg.layer_types == full[:expect]
    else:
        assert cfg.layer_types is None


def test_load_hf_runs_a_real_checkpoint_truncated(tmp_path):
    """The real transformers path: a 3-layer tiny Llama saved here, loaded with num_layers=2, runs 2 layers."""
    import transformers

    cfg = transformers.LlamaConfig(num_hidden_layers=3, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=40, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    model = P.load_hf(tmp_path, num_layers=2)
    assert len(model.model.layers) == 2 and not model.training
    assert next(model.parameters()).dtype == torch.float32
    logits = P.hf_logits(model, [1, 2, 3, 4])
    assert logits.shape == (4, 40) and logits.dtype == torch.float32


# ---- recorded_source ----------------------------------------------------------------------------------------


def test_recorded_source_names_why_there_is_none(tmp_path):
    with pytest.raises(ValueError, match=r"no source checkpoint recorded \(it was exported from random weights\)"):
        P.recorded_source({"source": {"weights": "random"}}, tmp_path)
    with pytest.raises(ValueError, match=r"\(no pagedkit.source.checkpoint in its genai_config.json\)"):
        P.recorded_source({"source": {"weights": "hf"}}, tmp_path)
    with pytest.raises(ValueError, match="pass --parity HF_CHECKPOINT_DIR"):
        P.recorded_source({}, tmp_path)


@pytest.mark.parametrize("layers,expect", [(None, None), (0, None), (4, 4), ("6", 6)])
def test_recorded_source_reads_the_checkpoint_and_layers(tmp_path, layers, expect):
    (tmp_path / "hf").mkdir()
    src = {"checkpoint": "hf"} | ({"num_hidden_layers": layers} if layers is not None else {})
    path, n = P.recorded_source({"source": src}, tmp_path)
    assert path == tmp_path / "hf" and n == expect
