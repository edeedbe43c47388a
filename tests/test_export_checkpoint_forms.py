"""Checkpoint forms through `paged-export`'s loader for the new families: sharded safetensors (an index and
several files) with tied and untied embeddings, exported (fp16: the loader reads the weights in float16) and
run against Hugging Face eager float32 over the same float16-rounded weights (the checkpoint the export
holds; against the float32 originals a MoE router's near-tie may flip an expert choice)."""

from __future__ import annotations

import pytest
import torch

from export_utils import check_parity, save_tiny_checkpoint, tiny_model

FORMS = {  # name -> (config class, overrides, tied)
    "qwen2-tied": ("Qwen2Config", dict(tie_word_embeddings=True), True),
    "olmo2-untied": ("Olmo2Config", dict(tie_word_embeddings=False), False),
    "mixtral-experts": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2), False),
}


@pytest.mark.parametrize("name", sorted(FORMS))
def test_sharded_checkpoint_exports_with_parity(name, tmp_path):
    import onnx

    from pagedkit.exporters.export import export

    cls, kw, tied = FORMS[name]
    hf = tiny_model(cls, seed=9, **kw)
    routers = [m for n, m in hf.named_modules() if n.endswith("mlp.gate")]
    assert bool(routers) == name.startswith("mixtral")
    with torch.no_grad():  # a sharper router: its top-2 choices stay clear of fp16 activation noise (near-ties)
        for r in routers:
            r.weight.mul_(6.0)
    ckpt = tmp_path / "ckpt"
    save_tiny_checkpoint(hf, ckpt)
    hf.save_pretrained(ckpt, max_shard_size="40KB")  # several shards + index (transformers' per-expert layout)
    assert (ckpt / "model.safetensors.index.json").exists() and len(list(ckpt.glob("*.safetensors"))) > 2
    res = export(str(ckpt), tmp_path / "out")
    assert res.weights == "safetensors"
    names = {t.name for t in onnx.load(str(res.model_path), load_external_data=False).graph.initializer}
    assert ("lm_head.MatMul.weight" not in names) == tied
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float16,
                                                            attn_implementation="eager").float().eval()
    check_parity(ref, tmp_path / "out", steps=6)
