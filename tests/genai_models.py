"""Build onnxruntime-genai's own models from tiny random Hugging Face checkpoints (for the tests).

`build_genai_model(family, layout, root)` writes a random checkpoint with `save_pretrained` (config
from `FAMILIES`, plus a tiny local word-level tokenizer: the builder loads one with AutoTokenizer),
then runs `python -m onnxruntime_genai.models.builder` on it, offline:
- layout "paged": `-p fp16 -e cuda --extra_options use_paged_attention=true` (PagedAttention nodes,
  caches `past_key_values.{i}.key/value [num_blocks, block_size, kv_heads, head_size]`);
- layout "gqa": `-p fp32 -e cpu` (GroupQueryAttention nodes, BNSH caches);
- layout "int4": `-p int4 -e cpu` (the same with MatMulNBits weights, accuracy_level 4; tied embeddings
  become GatherBlockQuantized over the lm_head's weights, GPT-OSS experts QMoE);
- layout "int4-asym-b64": `-p int4 -e cpu` with asymmetric blocks of 64 (zero points, K = 96 not a multiple of
  the block) and the embedding quantized too (GatherBlockQuantized over uint4 data with zero points).
All run on a CPU-only machine. Results are cached under `root` (one pytest session's temp dir), so
each checkpoint and each model is built once. A builder failure raises `BuilderFailed` with the tail
of its output; the tests turn that into a skip that states the reason.

Run as a script to build one model by hand:  python tests/genai_models.py llama paged /tmp/out
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# Tiny configurations: head_size 16 (a multiple of 8), 2 layers, vocab 128.
# intermediate_size must differ from vocab_size: the builder takes any Linear whose out_features equals
# the vocabulary for the LM head.
_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
               bos_token_id=1, eos_token_id=2, pad_token_id=2)
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "qwen3": ("Qwen3Config", {}),  # QK-norm -> q/k_norm_weight
    "gemma2": ("Gemma2Config", dict(sliding_window=32, query_pre_attn_scalar=16,
                                    layer_types=["sliding_attention", "full_attention"])),
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=32,
                                     layer_types=["sliding_attention", "full_attention"])),
}
LAYOUTS = {
    "paged": ["-p", "fp16", "-e", "cuda", "--extra_options", "use_paged_attention=true"],
    "gqa": ["-p", "fp32", "-e", "cpu"],
    "int4": ["-p", "int4", "-e", "cpu"],
    "int4-asym-b64": ["-p", "int4", "-e", "cpu", "--extra_options", "is_symmetric=false", "block_size=64",
                      "op_types_to_quantize=MatMul/Gather"],
}
_OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


class BuilderFailed(RuntimeError):
    """The onnxruntime-genai builder (or the checkpoint writer) failed; the message says why."""


def _save_tokenizer(out: Path, vocab_size: int) -> None:
    """A word-level tokenizer over tokens t3..t{vocab-1} plus <unk>/<s>/</s>, built locally (no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            pad_token="</s>").save_pretrained(out)


def save_checkpoint(family: str, out: Path, seed: int = 0) -> Path:
    """Write a random tiny checkpoint of `family` (config + safetensors + tokenizer) to `out`."""
    import torch
    import transformers

    cls_name, extra = FAMILIES[family]
    config = getattr(transformers, cls_name)(**(_COMMON | extra))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    _save_tokenizer(out, config.vocab_size)
    return out


def run_builder(hf_dir: Path, out: Path, layout: str, cache_dir: Path, timeout: float = 600) -> Path:
    """Run onnxruntime-genai's builder on a local checkpoint; returns the output folder."""
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(out),
           "-c", str(cache_dir), *LAYOUTS[layout]]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=os.environ | _OFFLINE_ENV)
    except subprocess.TimeoutExpired as exc:
        raise BuilderFailed(f"builder timed out after {timeout:.0f} s: {' '.join(cmd)}") from exc
    if proc.returncode != 0 or not (out / "model.onnx").exists():
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-8:]
        raise BuilderFailed(f"builder exited {proc.returncode} ({' '.join(cmd)}):\n" + "\n".join(tail))
    return out


# One builder process for several models: the builder's own command line (its module run as __main__ by runpy), once
# per model, in one interpreter. A build is ~0.05 s on these tiny checkpoints; a process importing the builder
# (torch, transformers, onnx) is ~5 s, which one-process-per-model paid for every model.
_BATCH = """
import json, runpy, sys, traceback
for argv in json.loads(sys.argv[1]):
    sys.argv = ["builder", *argv]
    try:
        runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__", alter_sys=True)
    except BaseException:
        traceback.print_exc()
        print("BATCH-FAILED", argv[3], flush=True)
"""


def run_builders(jobs: list[tuple[Path, Path, str]], cache_dir: Path, timeout: float = 900) -> list[Path]:
    """run_builder over jobs [(hf_dir, out, layout)] in one builder process; returns the output folders.
    BuilderFailed names the builds that did not produce a model.onnx, with the tail of the output."""
    import json

    argvs = [["-i", str(hf), "-o", str(out), "-c", str(cache_dir), *LAYOUTS[layout]] for hf, out, layout in jobs]
    try:
        proc = subprocess.run([sys.executable, "-c", _BATCH, json.dumps(argvs)], capture_output=True, text=True,
                              timeout=timeout, env=os.environ | _OFFLINE_ENV)
    except subprocess.TimeoutExpired as exc:
        raise BuilderFailed(f"{len(jobs)} builds timed out after {timeout:.0f} s") from exc
    missing = [str(out) for _, out, _ in jobs if not (Path(out) / "model.onnx").exists()]
    if proc.returncode != 0 or missing:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-12:]
        raise BuilderFailed(f"builder batch exited {proc.returncode}, no model.onnx in {missing}:\n" + "\n".join(tail))
    return [Path(out) for _, out, _ in jobs]


def prebuild(jobs, cache_dir: Path) -> list[str]:
    """Every job [(hf_dir, write, out, layout)] whose `out` holds no model.onnx yet, built in one builder process
    (run_builders), write(hf_dir) first writing a missing checkpoint. Returns the reasons of what could not be
    built (each test's own build then builds it or reports why)."""
    todo, why = [], []
    for hf, write, out, layout in jobs:
        if (Path(out) / "model.onnx").exists():
            continue
        if not (Path(hf) / "config.json").exists():
            try:
                write(Path(hf))
            except Exception as exc:  # transformers too old / new for this family, etc.
                why.append(f"{hf}: {type(exc).__name__}: {exc}")
                continue
        todo.append((Path(hf), Path(out), layout))
    if todo:
        try:
            run_builders(todo, cache_dir)
        except BuilderFailed as exc:
            why.append(str(exc))
    return why


def build_genai_model(family: str, layout: str, root: Path) -> Path:
    """The builder's model folder (model.onnx, model.onnx.data, genai_config.json) for family/layout,
    built once under root."""
    root = Path(root)
    out = root / f"{family}-{layout}"
    if (out / "model.onnx").exists():
        return out
    hf_dir = root / f"hf-{family}"
    if not (hf_dir / "config.json").exists():
        try:
            save_checkpoint(family, hf_dir)
        except Exception as exc:  # transformers too old/new for this family, etc.
            raise BuilderFailed(f"could not write a {family} checkpoint: {type(exc).__name__}: {exc}") from exc
    return run_builder(hf_dir, out, layout, root / "cache")


if __name__ == "__main__":  # python tests/genai_models.py FAMILY LAYOUT OUT_ROOT
    print(build_genai_model(sys.argv[1], sys.argv[2], Path(sys.argv[3])))
