"""Regenerate tests/cases (index.json + one .npz per case): `python tests/cases/generate.py`.

Deterministic: every case has a fixed seed. Inputs come from the test builders (GQA: tests/paged_gqa.py
with the onnxruntime-checked configurations of tests/test_gqa_vs_ort.py plus the features ORT's CPU
kernel lacks; PagedAttention: tests/nodes.make_paged_case at small sizes, with paging edits below).
Expected outputs come from pagedkit's reference kernels; tests/test_gqa_oracle.py re-checks the GQA ones
labelled "onnxruntime CPU" on onnxruntime and every GQA one against an independent float64 oracle. Rows a kernel must never read hold a large
finite sentinel (300) rather than NaN, so tiled kernels that load and then mask them stay finite.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))

from cases import DTYPE_NAMES, INDEX, to_numpy  # noqa: E402
from nodes import make_paged_case  # noqa: E402
from paged_gqa import GqaSpec, make_gqa_inputs  # noqa: E402
from test_gqa_vs_ort import CONFIGS as ORT_CHECKED  # noqa: E402

from pagedkit.kernels.paged.reference import paged_attention  # noqa: E402
from pagedkit.kernels.gqa.reference import group_query_attention  # noqa: E402

SENTINEL = 300.0
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}

# GroupQueryAttention: onnxruntime-checked configurations ...
GQA_FROM_ORT_MATRIX = [
    "prompt_padded_batch", "prompt_without_past_inputs", "decode_ragged", "decode_shared_buffer",
    "subsequent_prompt", "chunked_query_seqlens", "chunked_query_seqlens_decode_idle", "shared_kv_multi_query",
    "mqa_decode",
    "packed_chunked_interleaved", "rotary_partial_half", "position_ids_decode", "position_ids_first_prompt",
    "window_decode", "softcap_window_sink_decode", "smooth_softmax_prompt", "head_sink_with_smooth_softmax",
    "custom_scale", "bias_per_batch_chunked", "qk_scores_softcap_bias", "qk_probs_window_sink",
    "bidirectional_with_past_qk", "window_cache_evicting", "window_cache_step_longer_than_capacity",
    "window_cache_chunked_ragged", "int8_per_channel_decode_rotary", "int4_per_tensor_decode",
    "int4_per_channel_prompt_interleaved", "int8_per_channel_window_cache", "fp16_decode_features",
    "fp16_window_cache",
]
# ... and what ORT's CPU kernel rejects (QK-norm, fp8 caches, bf16), checked against the independent float64
# oracle (tests/paged_oracle.gqa_oracle) by tests/test_gqa_oracle.py, which re-runs the ORT-labelled ones on ORT.
GQA_EXTRA = {
    "qk_norm_rotary_eps_override": dict(past=(4, 9), seq=1, qk_norm=True, rotary="half", dtype=torch.float16,
                                        attrs={"q_norm_epsilon": 1e-4, "k_norm_epsilon": 1e-3}),
    "qk_norm_chunked_int8": dict(past=(0, 6), seq=3, q=(3, 2), capacity=9, query_seqlens=True, qk_norm=True,
                                 rotary="interleaved", cache="int8", k_quant="PER_CHANNEL", v_quant="PER_TENSOR",
                                 attrs={"qk_norm_epsilon": 1e-4}),
    "fp8_per_tensor_decode": dict(past=(5, 2), seq=1, cache="fp8", k_quant="PER_TENSOR", v_quant="PER_TENSOR",
                                  rotary="half"),
    "fp8_per_channel_chunked": dict(past=(2, 7), seq=2, q=(2, 1), capacity=9, query_seqlens=True, cache="fp8",
                                    k_quant="PER_CHANNEL", v_quant="PER_CHANNEL", head_sink=True),
    "bf16_prompt_window_bias": dict(past=(0,), seq=5, dtype=torch.bfloat16, rotary="half", bias=(1, 4),
                                    attrs={"local_window_size": 3, "qk_output": 2}),
}

SMALL = dict(num_heads=4, kv_num_heads=2, head_size=16, past=(0, 5, 20), q_lens=(3, 1, 2))
MLA = dict(latent=True, num_heads=4, kv_num_heads=1, head_size=40, v_head_size=32, rotary_offset=32, rotary_dim=8,
           scale=0.15)
PAGED = {
    "llama_fp16_rotary": dict(),
    "bf16_rotary_interleaved": dict(dtype=torch.bfloat16, attrs={"rotary_interleaved": 1}),
    "packed_qkv": dict(packed=True),
    "partial_rotary": dict(head_size=32, rotary_dim=16),
    "no_rotary_decode": dict(rotary=False, past=(17, 3, 40), q_lens=(1, 1, 1)),
    "mla_latent": dict(MLA),
    "mla_int8_per_tensor": dict(MLA, cache="int8", quant="PER_TENSOR"),
    "int8_per_tensor": dict(cache="int8", quant="PER_TENSOR"),
    "int8_per_channel_bf16": dict(cache="int8", quant="PER_CHANNEL", dtype=torch.bfloat16),
    "fp8_per_tensor": dict(cache="fp8", quant="PER_TENSOR"),
    "fp8_per_channel": dict(cache="fp8", quant="PER_CHANNEL", cache_dtype_attr="float8e4m3fn"),
    "int4_per_tensor": dict(cache="int4", quant="PER_TENSOR"),
    "int4_per_channel": dict(cache="int4", quant="PER_CHANNEL"),
    "int4_per_token_rotation": dict(cache="int4", quant="PER_TOKEN", rotation=True),
    "int8_per_token_f32_scales": dict(cache="int8", quant="PER_TOKEN", scale_cache_dtype=torch.float32),
    "fp8_per_token": dict(cache="fp8", quant="PER_TOKEN"),
    "rotation_float_cache": dict(rotation=True),
    "slot_mapping_explicit": dict(slot_mapping=True),
    "slot_mapping_skips": dict(slot_mapping=True, edit="skip_slots"),
    "unmapped_block": dict(past=(0, 5, 40), edit="unmap_block"),
    "zero_token_sequence": dict(q_lens=(3, 0, 2)),
    "token_count_zero": dict(q_lens=(0, 0, 0)),
    "sink_window_softcap": dict(head_sink=True, attrs={"local_window_size": 4, "softcap": 2.0}),
    "qk_norm": dict(qk_norm=True, attrs={"qk_norm_epsilon": 1e-5}),
    "bidirectional_window": dict(attrs={"is_causal": 0, "local_window_size": 3}),
    "query_positions_shifted": dict(query_positions=True, edit="shift_positions"),
    "bias_scores": dict(bias=True, qk_output=1),
    "bias_probs_sink": dict(bias=True, qk_output=2, head_sink=True),
    "metadata_custom_scale": dict(metadata=True, scale=0.2),
    "all_features_bf16": dict(dtype=torch.bfloat16, slot_mapping=True, head_sink=True, qk_norm=True, metadata=True,
                              query_positions=True, bias=True, qk_output=2),
}


def _seed(name: str) -> int:
    return sum((i + 1) * ord(c) for i, c in enumerate(name)) % 100_003


def _desensitize(x: dict) -> dict:
    """NaN poison -> a finite sentinel (floats and fp8)."""
    out = {}
    for k, t in x.items():
        if t.is_floating_point() and t.isnan().any():
            t = torch.where(t.float().isnan(), torch.tensor(SENTINEL), t.float()).to(t.dtype)
        out[k] = t
    return out


def gqa_case(name: str, kw: dict) -> tuple:
    spec = GqaSpec(**kw)
    inputs, attrs, meta = make_gqa_inputs(spec, _seed(name))
    inputs = _desensitize(inputs)
    expected = group_query_attention({k: v.clone() for k, v in inputs.items()}, **attrs)
    defined = {}
    for out, t in expected.items():
        mask = torch.zeros(t.shape, dtype=torch.bool)
        for b, (n, rows) in enumerate(zip(meta["q_len"], meta["rows"])):
            if out == "output":
                mask[b, :n] = True
            elif out == "output_qk":
                mask[b, :, :n] = True
            else:
                mask[b, :, :rows] = True
        defined[out] = mask
    return inputs, attrs, expected, defined, TOL[spec.dtype]


def paged_case(name: str, kw: dict) -> tuple:
    kw = {**SMALL, **kw}
    extra, edit = kw.pop("attrs", {}), kw.pop("edit", None)
    case = make_paged_case(seed=_seed(name), name=name, **kw)
    inputs, attrs = dict(case.inputs), {**case.attrs, **extra}
    if edit == "skip_slots":  # sequence 1's token and sequence 0's middle token are not written
        sm = inputs["slot_mapping"].clone()
        sm[1] = -1
        sm[3] = -1
        inputs["slot_mapping"] = sm
    elif edit == "unmap_block":  # sequence 2 loses its first block: positions 0..15 are masked
        bt = inputs["block_table"].clone()
        bt[2, 0] = -1
        inputs["block_table"] = bt
    elif edit == "shift_positions":
        inputs["query_positions"] = inputs["query_positions"] + 2
    expected = paged_attention({k: v.clone() for k, v in inputs.items()}, outputs=case.outputs, **attrs)
    return inputs, attrs, expected, {}, TOL[inputs["query"].dtype]


def _tensors(d: dict) -> list[dict]:
    return [{"name": k, "shape": list(t.shape), "dtype": DTYPE_NAMES[t.dtype]} for k, t in d.items()]


def _jsonable(v):
    return float(v) if isinstance(v, float) else v


def main() -> None:
    for old in HERE.glob("*.npz"):
        old.unlink()
    entries = []
    jobs = [("GroupQueryAttention", n, ORT_CHECKED[n], "onnxruntime CPU + reference") for n in GQA_FROM_ORT_MATRIX]
    jobs += [("GroupQueryAttention", n, kw, "reference + float64 oracle (tests/test_gqa_oracle.py)") for n, kw in GQA_EXTRA.items()]
    jobs += [("PagedAttention", n, kw, "reference") for n, kw in PAGED.items()]
    for op, name, kw, checked in jobs:
        make = gqa_case if op == "GroupQueryAttention" else paged_case
        inputs, attrs, expected, defined, tol = make(name, kw)
        prefix = "gqa" if op == "GroupQueryAttention" else "paged"
        file = f"{prefix}_{name}.npz"
        arrays = {f"input.{k}": to_numpy(t) for k, t in inputs.items()}
        arrays.update({f"expected.{k}": to_numpy(t) for k, t in expected.items()})
        arrays.update({f"defined.{k}": m.numpy() for k, m in defined.items() if not m.all()})
        np.savez_compressed(HERE / file, **arrays)
        entries.append({
            "name": f"{prefix}_{name}", "op": op, "domain": "com.microsoft", "file": file,
            "attributes": {k: _jsonable(v) for k, v in attrs.items()},
            "inputs": _tensors(inputs), "outputs": _tensors(expected),
            "tolerance": {"float": tol, "code_steps": 1},
            "expected_from": checked,
            "builder": {k: (DTYPE_NAMES[v] if isinstance(v, torch.dtype) else v) for k, v in kw.items()},
        })
    INDEX.write_text(json.dumps({"version": 1, "note": (
        "Inputs/expected outputs per case in the named .npz (keys input.<name>, expected.<name>, "
        "defined.<name> = mask of entries the operator specifies; bfloat16 / float8e4m3fn stored as raw "
        "uint16 / uint8). Load with tests/cases/__init__.py: load_cases(), compare_case()."),
        "cases": entries}, indent=1) + "\n")
    size = sum(p.stat().st_size for p in HERE.iterdir() if p.is_file())
    print(f"{len(entries)} cases, {size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
