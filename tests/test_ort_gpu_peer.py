"""On the H200: onnxruntime-gpu (the peer, ORT's own CUDA PagedAttention) runs pagedkit's fp16 Llama and
Qwen3 exports, caches bound in place with IOBinding, and matches Hugging Face eager like pagedkit does:
the same prefill + decode parity harness (shuffled, non-contiguous block tables; poisoned caches) with
ORT-gpu in place of pagedkit's session, then with pagedkit's own session on CUDA.

Needs onnxruntime-gpu importable (see ../shared/tools/ort-gpu.md); skipped otherwise.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import export_utils
from export_utils import check_parity, export_tiny, tiny_model

pytestmark = pytest.mark.gpu

_NP = {torch.float16: np.float16, torch.float32: np.float32, torch.int32: np.int32, torch.int64: np.int64,
       torch.int8: np.int8, torch.uint8: np.uint8}
_TORCH = {"tensor(float16)": torch.float16, "tensor(float)": torch.float32, "tensor(bfloat16)": torch.bfloat16}


def _ort():
    ort = pytest.importorskip("onnxruntime")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime has no CUDAExecutionProvider (needs onnxruntime-gpu)")
    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    return ort


class OrtGpuSession:
    """run_torch-compatible adapter over onnxruntime-gpu: every input on the GPU except
    attention_metadata (a CPU input), each present.* output bound to its past_key_values.* buffer."""

    def __init__(self, model_dir: Path):
        ort = _ort()
        self.sess = ort.InferenceSession(str(Path(model_dir) / "model.onnx"), providers=["CUDAExecutionProvider"])
        assert self.sess.get_providers()[0] == "CUDAExecutionProvider"

    def get_inputs(self):
        return self.sess.get_inputs()

    def run_torch(self, feeds):
        binding = self.sess.io_binding()
        placed = {}
        for name, t in feeds.items():
            host = name == "attention_metadata"
            t = (t.cpu() if host else t.cuda()).contiguous()
            placed[name] = t
            binding.bind_input(name, "cpu" if host else "cuda", 0, _NP[t.dtype], list(t.shape), t.data_ptr())
        outs = {}
        for o in self.sess.get_outputs():
            if o.name.startswith("present."):
                t = placed[o.name.replace("present.", "past_key_values.")]
            else:  # logits [num_tokens, vocab]
                t = torch.full((feeds["input_ids"].shape[0], o.shape[-1]), float("nan"), dtype=_TORCH[o.type],
                               device="cuda")  # poisoned
            binding.bind_output(o.name, "cuda", 0, _NP[t.dtype], list(t.shape), t.data_ptr())
            outs[o.name] = t
        self.sess.run_with_iobinding(binding)
        torch.cuda.synchronize()
        return outs


class CudaPagedkitSession:
    """pagedkit's own InferenceSession on CUDA behind the same adapter (caches persistent on the GPU)."""

    def __init__(self, model_dir: Path):
        from pagedkit import InferenceSession

        self.sess = InferenceSession(str(Path(model_dir) / "model.onnx"), providers=["CUDAExecutionProvider"])

    def get_inputs(self):
        return self.sess.get_inputs()

    def run_torch(self, feeds):
        placed = {k: (v.cpu() if k == "attention_metadata" else v.cuda()) for k, v in feeds.items()}
        return self.sess.run_torch(placed)


MODELS = {"llama": ("LlamaConfig", {}), "qwen3": ("Qwen3Config", {"rms_norm_eps": 1e-5})}


@pytest.mark.parametrize("runner", ["onnxruntime-gpu", "pagedkit-cuda"])
@pytest.mark.parametrize("family", sorted(MODELS))
def test_peer_matches_hf(family, runner, tmp_path, monkeypatch):
    if runner == "onnxruntime-gpu":
        _ort()
    cls, overrides = MODELS[family]
    hf = tiny_model(cls, seed=7, **overrides)
    export_tiny(hf, tmp_path)
    monkeypatch.setattr(export_utils, "_session",
                        OrtGpuSession if runner == "onnxruntime-gpu" else CudaPagedkitSession)
    rep = check_parity(hf, tmp_path, steps=8)
    print(f"{family} via {runner}: worst max|diff|/max|ref| = {rep.worst_ratio:.3g}, "
          f"near-ties {rep.near_ties}, over {rep.steps} decode steps")
