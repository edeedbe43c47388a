"""Synthetic checkpoints for the streaming-export tests, written tensor by tensor (never a whole model in memory),
and the peak-RSS probe of an export run in a subprocess.

`synthetic_checkpoint(folder, config)` writes config.json, sharded safetensors (`shard_bytes` per file) and
model.safetensors.index.json for the model transformers builds from `config`, in the layout Hugging Face
checkpoints ship: MoE experts one tensor per expert (`mlp.experts.{e}.gate_proj.weight`, ...), values random
bfloat16 (norm gains around 1). `fp8=True` stores the projection matrices as DeepSeek-V3's release does:
float8_e4m3fn with a float32 `weight_scale_inv` per 128 x 128 block, and returns nothing more: the
dequantized value the export must hold is computed by the test (`fp8_dequant`), independently of pagedkit.
The code here shares nothing with pagedkit's loader (its own key layout, its own dequantization).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

FP8_BLOCK = 128


def random_bf16(shape, gen: torch.Generator) -> torch.Tensor:
    """Random bfloat16 of magnitude 2^-7 .. 2 with both signs, from random bits (fast: no float math)."""
    n = math.prod(shape)
    r = torch.randint(0, 1 << 16, (n,), generator=gen, dtype=torch.int32)
    bits = (r & 0x807F) | ((((r >> 7) & 0x7) + 0x78) << 7)
    return bits.to(torch.int16).view(torch.bfloat16).reshape(shape)


def random_fp8(shape, gen: torch.Generator) -> torch.Tensor:
    """Random float8_e4m3fn codes, NaN codes (0x7F / 0xFF) excluded."""
    r = torch.randint(0, 256, tuple(shape), generator=gen, dtype=torch.int16)
    r = torch.where((r & 0x7F) == 0x7F, r - 1, r)
    return r.to(torch.uint8).view(torch.float8_e4m3fn)


def fp8_dequant(w: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The reference dequantization (DeepSeek-V3's `weight_dequant`): w.float() * s of its 128 x 128 block."""
    out = torch.empty(w.shape, dtype=torch.float32)
    rows, cols = w.shape
    for i in range(0, rows, FP8_BLOCK):
        for j in range(0, cols, FP8_BLOCK):
            blk = w[i:i + FP8_BLOCK, j:j + FP8_BLOCK].to(torch.float32)
            out[i:i + FP8_BLOCK, j:j + FP8_BLOCK] = blk * scale_inv[i // FP8_BLOCK, j // FP8_BLOCK]
    return out.to(dtype)


def checkpoint_tensors(config: dict, num_layers: int | None = None, num_experts: int | None = None):
    """(key, shape, kind) of every tensor a Hugging Face checkpoint of `config` holds, in the published layout
    (per-expert MoE tensors), limited to the first `num_layers` layers and `num_experts` experts."""
    import transformers

    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "transformers_version"})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    out = []
    seen = set()
    state = model.state_dict()
    for name, t in state.items():
        if id(t) in seen and name == "lm_head.weight":
            continue
        parts = name.split(".")
        if num_layers is not None and len(parts) > 2 and parts[1] == "layers" and int(parts[2]) >= num_layers:
            continue
        if name.endswith("mlp.experts.gate_up_proj"):
            e, two_i, h = t.shape
            for j in range(min(e, num_experts or e)):
                for proj in ("gate_proj", "up_proj"):
                    out.append((name.replace("gate_up_proj", f"{j}.{proj}.weight"), (two_i // 2, h), "linear"))
        elif name.endswith("mlp.experts.down_proj"):
            e, h, i = t.shape
            for j in range(min(e, num_experts or e)):
                out.append((name.replace("down_proj", f"{j}.down_proj.weight"), (h, i), "linear"))
        else:
            kind = "norm" if t.dim() == 1 and "norm" in name else "vector" if t.dim() == 1 else \
                "linear" if name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight") else "matrix"
            out.append((name, tuple(t.shape), kind))
        seen.add(id(t))
    if config.get("tie_word_embeddings"):
        out = [x for x in out if x[0] != "lm_head.weight"]
    return out


def synthetic_checkpoint(folder: Path, config: dict, *, shard_bytes: int = 512 << 20, seed: int = 0,
                         fp8: bool = False, num_layers: int | None = None, num_experts: int | None = None) -> dict:
    """Write the checkpoint (see the module doc); returns {"bytes": total tensor bytes, "largest": the largest
    tensor's bytes, "keys": number of tensors}."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(config)
    if fp8:
        cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                      "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = torch.Generator().manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    size = total = largest = files = 0
    weight_map = {}

    def flush():
        nonlocal shard, size, files
        if shard:
            files += 1
            name = f"model-{files:05d}.safetensors"
            save_file(shard, str(folder / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            shard, size = {}, 0

    for key, shape, kind in checkpoint_tensors(config, num_layers, num_experts):
        if kind == "norm":
            t = (1.0 + 0.1 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
        elif key.endswith("e_score_correction_bias"):
            t = 0.01 * torch.randn(shape, generator=gen)  # float32, as DeepSeek-V3 ships it
        elif kind == "vector":
            t = (0.1 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
        else:
            t = random_bf16(shape, gen)
        tensors = {key: t}
        if fp8 and kind == "linear" and len(shape) == 2:
            blocks = (-(-shape[0] // FP8_BLOCK), -(-shape[1] // FP8_BLOCK))
            tensors = {key: random_fp8(shape, gen),
                       key + "_scale_inv": (2.0 ** torch.randint(-12, -6, blocks, generator=gen)).float()
                       * (1 + torch.rand(blocks, generator=gen))}
        for k, v in tensors.items():
            nbytes = v.numel() * v.element_size()
            if size and size + nbytes > shard_bytes:
                flush()
            shard[k] = v
            size += nbytes
            total += nbytes
            largest = max(largest, nbytes)
        del t, tensors
    flush()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return {"bytes": total, "largest": largest, "keys": len(weight_map)}


def peak_rss_of(argv: list[str], env: dict | None = None, timeout: float = 3600) -> tuple[int, str]:
    """Run` / a command in a child process; returns (its peak resident set size in bytes, its
    stderr + stdout). ru_maxrss of RUSAGE_CHILDREN, read in a fresh intermediate process so that only this
    child counts."""
    probe = ("import resource, subprocess, sys, json\n"
             "p = subprocess.run(json.loads(sys.argv[1]), capture_output=True, text=True)\n"
             "r = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n"
             "sys.stdout.write(json.dumps([p.returncode, r * 1024, p.stderr[-4000:] + p.stdout[-4000:]]))\n")
    res = subprocess.run([sys.executable, "-c", probe, json.dumps(argv)], capture_output=True, text=True,
                         env=env if env is not None else os.environ.copy(), timeout=timeout)
    rc, rss, out = json.loads(res.stdout)
    if rc != 0:
        raise RuntimeError(f"{argv} exited {rc}:\n{out}")
    return rss, out


