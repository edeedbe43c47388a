"""Random weights drawn lazily (pagedkit/exporters/random_weights.py).

- The law: every parameter of a built-in model (shrunk) follows the init transformers gives it — the oracle is
  `from_config` itself (HF's own draws): constant parameters (norm gains, biases, Gemma's zero-centred gains)
  equal, all-zero rows (the embedding's padding row) at the same places, the spread of each drawn parameter
  within 5% of HF's and the pooled spread within 1.5% (a 2% wrong scale fails it).
- The values: fixed by the seed, equal whole / sliced / in any thread count / lazy or materialized, different
  across seeds and across parameters of one shape.
- End to end: `paged-export` of a config-only folder writes the lazy weights in row chunks across many
  blocks, and the export matches Hugging Face eager run on `load_model(stream=False)` (the same weights
  materialized) teacher-forced.
- A model whose init cannot be recorded falls back to from_config, and says so.
"""

from __future__ import annotations

import math
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from export_utils import check_parity, tiny_model

from pagedkit.exporters import random_weights as rw
from pagedkit.exporters.weights import _config_from_dict, builtin_config, shrink_config

# shrunk sizes, set where the built-in config has the key (its other sizes kept)
SMALL = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, shared_expert_intermediate_size=64,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512, kv_lora_rank=64,
             qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=256)
NAMES = ("llama-3.1-8b", "deepseek-v2-lite", "command-r7b", "starcoder2-3b", "nemotron-mini-4b", "gemma-2-9b",
         "qwen2.5-0.5b-instruct", "mixtral-8x7b", "olmoe-1b-7b")


def small_config(name: str):
    cfg = _config_from_dict(builtin_config(name), name)
    text = cfg if hasattr(cfg, "num_hidden_layers") else cfg.get_text_config()
    for k, v in SMALL.items():
        if getattr(text, k, None) is not None:
            setattr(text, k, v)
    experts = any(getattr(text, k, None) for k in ("num_local_experts", "n_routed_experts", "num_experts"))
    return shrink_config(cfg, 1, 4 if experts else None)


def _hf(config, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager").eval()


@pytest.mark.parametrize("name", NAMES)
def test_law_matches_transformers_init(name):
    cfg = small_config(name)
    hf = dict(_hf(cfg).named_parameters())
    ours = dict(rw.materialized_random_model(small_config(name), torch.float32, seed=5).named_parameters())
    assert ours.keys() == hf.keys()
    sq = {"hf": 0.0, "ours": 0.0}
    n = 0
    for key, ref in hf.items():
        got = ours[key].detach()
        ref = ref.detach()
        assert got.shape == ref.shape and got.dtype == ref.dtype, key
        if ref.numel() and bool((ref == ref.flatten()[0]).all()):  # a constant (gain, bias)
            assert torch.equal(got, ref), f"{key}: expected the constant {ref.flatten()[0].item()}"
            continue
        if ref.dim() == 2:  # all-zero rows (padding_idx) at the same places
            assert torch.equal((got == 0).all(1), (ref == 0).all(1)), key
        if ref.numel() >= 4096:
            ratio = got.float().std().item() / ref.float().std().item()
            assert abs(ratio - 1) < 0.05, f"{key}: spread {ratio:.3f} x transformers'"
        assert abs(got.float().mean().item()) < 4 * ref.float().std().item() / math.sqrt(ref.numel()) + 1e-6, key
        sq["hf"] += ref.double().square().sum().item()
        sq["ours"] += got.double().square().sum().item()
        n += ref.numel()
    assert n > 100_000
    ratio = math.sqrt(sq["ours"] / sq["hf"])
    assert abs(ratio - 1) < 0.015, f"pooled spread {ratio:.4f} x transformers'"


def test_values_fixed_by_seed_whole_sliced_any_threads(monkeypatch):
    from pagedkit.exporters import slicing

    monkeypatch.setattr(rw, "BLOCK_ELEMS", 1000)  # many blocks per tensor
    cfg = small_config("deepseek-v2-lite")
    lazy = dict(rw.lazy_random_model(cfg, torch.bfloat16, seed=3).named_parameters())
    mat = dict(rw.materialized_random_model(small_config("deepseek-v2-lite"), torch.bfloat16, seed=3)
               .named_parameters())
    monkeypatch.setattr(rw, "_POOL", ThreadPoolExecutor(1))
    again = dict(rw.lazy_random_model(small_config("deepseek-v2-lite"), torch.bfloat16, seed=3).named_parameters())
    other = dict(rw.lazy_random_model(small_config("deepseek-v2-lite"), torch.bfloat16, seed=4).named_parameters())
    multi = 0
    for key, t in lazy.items():
        whole = t.materialize()
        assert whole.dtype == torch.bfloat16 and torch.equal(whole, mat[key].detach()), key
        assert torch.equal(again[key].materialize(), whole), f"{key}: depends on the thread count"
        if whole.dim() and whole.shape[0] > 3:
            rows = rw.block_rows(tuple(whole.shape))
            multi += rows < whole.shape[0]
            for a, b in ((1, whole.shape[0] - 1), (rows - 1, rows + 1), (0, 1), (whole.shape[0] - 2, whole.shape[0])):
                if 0 <= a < b <= whole.shape[0]:
                    assert torch.equal(slicing.narrow(t, 0, a, b), whole[a:b]), (key, a, b)
                    slicing.end_chunk()
            slicing.clear()
        if whole.numel() > 1 and whole.float().std() > 0:
            assert not torch.equal(other[key].materialize(), whole), f"{key}: the seed is not used"
    assert multi >= 5
    gate, up = (lazy[k].materialize() for k in ("model.layers.0.mlp.gate_proj.weight",
                                                  "model.layers.0.mlp.up_proj.weight"))
    assert gate.shape == up.shape and not torch.equal(gate, up), "two parameters of one shape drew the same values"


def test_export_streams_random_weights_with_parity(tmp_path, monkeypatch, capsys):
    """A config-only folder: the CLI draws the weights while writing them, in 4 KB row chunks over
    256-element blocks; HF eager on the materialized model (load_model, stream=False) is the reference."""
    from pagedkit.exporters import external
    from pagedkit.exporters.cli import main
    from pagedkit.exporters.weights import load_model

    monkeypatch.setattr(rw, "BLOCK_ELEMS", 256)
    monkeypatch.setattr(external, "CHUNK_BYTES", 4096)
    src = tmp_path / "cfg"
    src.mkdir()
    tiny_model("LlamaConfig").config.to_json_file(src / "config.json")
    out = tmp_path / "out"
    assert main(["--model", str(src), "--output", str(out), "--quiet", "--seed", "7"]) == 0
    printed = capsys.readouterr()
    assert "random weights drawn tensor by tensor" in printed.out, printed.out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = load_model(src, seed=7, dtype=torch.float16).model.float()
        wrong = load_model(src, seed=8, dtype=torch.float16).model.float()
    rep = check_parity(hf, out, steps=4)
    assert rep.worst_ratio <= 2e-2
    with pytest.raises(AssertionError, match="max\\|diff\\|"):
        check_parity(wrong, out, steps=2)


def test_unrecordable_init_falls_back_to_from_config(tmp_path, monkeypatch):
    from transformers.models.llama import modeling_llama

    from pagedkit.exporters.weights import load_model

    src = tmp_path / "cfg"
    src.mkdir()
    tiny_model("LlamaConfig").config.to_json_file(src / "config.json")
    base = modeling_llama.LlamaPreTrainedModel._init_weights

    def skip_norms(self, module):  # an init that leaves the norm gains to __init__
        if "RMSNorm" not in type(module).__name__:
            base(self, module)

    monkeypatch.setattr(modeling_llama.LlamaPreTrainedModel, "_init_weights", skip_norms)
    with pytest.raises(rw.RandomInitUnsupported, match="input_layernorm.weight: no init touches it") as exc:
        rw.lazy_random_model(tiny_model("LlamaConfig").config, torch.float32, 0)
    assert str(exc.value).endswith(" ...")  # 5 norms untouched: 4 named, the rest elided
    with pytest.warns(UserWarning, match="drawn eagerly by from_config"):
        model = load_model(src, seed=2, stream=True).model
    assert all(p.device.type == "cpu" for p in model.parameters())
    from transformers import AutoModelForCausalLM

    torch.manual_seed(2)
    ref = AutoModelForCausalLM.from_config(model.config, attn_implementation="eager")
    for (k, a), (_, b) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(a, b), k


# The values of seed 0 for a tiny Llama (export_utils.tiny_model's config), pinned: the same seed gives the same
# random export on every machine and release; a change here changes every random model users have exported.
PINNED = {"model.embed_tokens.weight": ((1, slice(0, 3)), [0.004237995482981205, -0.03719547390937805, -0.0242439154535532]),
          "model.layers.1.mlp.down_proj.weight": ((0, slice(0, 3)),
                                                  [-0.012048696167767048, -0.01802697218954563, 0.016991324722766876]),
          "lm_head.weight": ((-1, slice(-2, None)), [0.017372552305459976, 0.006966425105929375])}


def test_values_of_a_seed_are_pinned():
    model = dict(rw.lazy_random_model(tiny_model("LlamaConfig").config, torch.float32, 0).named_parameters())
    embed = model["model.embed_tokens.weight"].materialize()
    assert torch.equal(embed[0], torch.zeros(64)), "the padding row (pad_token_id 0) is zero"
    assert embed[-1, -2:].tolist() == pytest.approx([0.009312796406447887, -0.01346495933830738], rel=1e-5)
    for name, (idx, want) in PINNED.items():
        got = model[name].materialize()[idx].tolist()
        assert got == pytest.approx(want, rel=1e-5), name


def test_rows_are_drawn_alone_not_through_the_whole_tensor(monkeypatch):
    """A weight's row chunk is drawn by its leaf's slicer (only the blocks the rows lie in), not by evaluating the
    whole tensor and cutting it: the streamed export's memory stays one chunk."""
    monkeypatch.setattr(rw, "BLOCK_ELEMS", 128)
    model = dict(rw.lazy_random_model(tiny_model("LlamaConfig").config, torch.float32, 3).named_parameters())
    w = model["model.layers.0.mlp.up_proj.weight"]
    whole = w.materialize()
    rows = w._slicer(0, 5, 9)
    assert rows is not None and torch.equal(rows, whole[5:9])
    assert w._slicer(1, 0, 4) is None  # columns: evaluated whole (slicing.py)
    calls = []
    monkeypatch.setattr(rw, "_draw_rows", lambda *a, _f=rw._draw_rows: calls.append(a[4:]) or _f(*a))
    w._slicer(0, 5, 9)
    assert calls == [(5, 9)]


def test_transformers_without_recordable_init_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers.initialization", None)  # transformers 4.x: no such module
    with pytest.raises(rw.RandomInitUnsupported, match="no transformers.initialization"):
        rw.lazy_random_model(tiny_model("LlamaConfig").config, torch.float32, 0)
