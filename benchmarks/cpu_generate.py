"""CPU generation benchmark: SmolLM2-135M-Instruct (real weights) through Hugging Face eager, onnxruntime-genai,
llama.cpp and pagedkit, one table from one run on one machine. Writes benchmarks/results/cpu_generate.json and .png.

    python benchmarks/cpu_generate.py                                  # every row: 128 tokens, 3 reps, 2 threads
    python benchmarks/cpu_generate.py --threads 1 2 --reps 2 --rounds 3   # the selection at 1 and at 2 threads
    python benchmarks/cpu_generate.py --rows genai-fp32 pagedkit-fp32 --reps 5 --threads 4
    python benchmarks/cpu_generate.py --max-new-tokens 8 --reps 1 --rows hf-fp32 genai-fp32 pagedkit-fp16  # smoke
    python benchmarks/cpu_generate.py --list                           # the rows and what each runs

Workload: a 61-token prompt (the first tokens of tests/data/ppl_text.txt), --max-new-tokens greedy tokens (128;
EOS never stops a run), batch 1; the batch rows run --batch (8) distinct 61-token prompts (consecutive windows of
the same text) in lockstep. Columns per row:
- ttft_ms: from the prompt ids in hand to the first generated token (prefill + argmax; request setup included);
- decode_tok_s: (tokens after the first, times the batch) / their wall time;
- peak_rss_mb: the row's process peak resident memory (/proc/self/status VmHWM: loading included; not
  getrusage's ru_maxrss, which Linux carries over exec from the orchestrating parent);
- import_s / load_s: the engine's imports, then the model's loading (sessions built; pagedkit: external data
  mapped by onnxruntime, not copied). The pagedkit rows run the default CPU path: runtime/lite's LiteGenerator (a
  process without torch) over the model's CPU plan, made once per folder and thread count by a child process
  (whose time the first load includes and whose memory the row's peak RSS does not) and reused; a model it
  refuses runs on Generator (`runner`, `lite_refused`). The generator rows run Generator in a torch process;
- host_ms_per_step / host_fraction (pagedkit, a model that is one onnxruntime segment): a decode step's time
  outside onnxruntime's run (planning, binding, sampling);
- floor_tok_s: the memory-bandwidth bound, DRAM read bandwidth (measured in this run, same threads) / bytes one
  decode step reads (every MatMul / Gemm / MatMulNBits weight in its stored dtype, lm_head included, plus one
  embedding row, plus the K/V cache at the mean decode context; llama.cpp: the GGUF file's size), times the batch;
  floor_fraction = decode / floor.
Each number is the median over --reps runs after one warm-up run (--warmup-tokens new tokens, not counted).
--rounds R runs the whole selection R times, row after row in each round (a host whose speed drifts, as a
shared 2-core machine's does by 30% within minutes, then slows every row of a round alike): a row's numbers
are the medians over all its rounds' runs, a pair's ratio the median of its per-round ratios (the two rows
of a round ran minutes apart at most), and each round's figures are kept in the row (`rounds`).
--threads T1 T2 ...: the selection at each thread count (in each round); rows and pairs carry `threads`.

Every row runs in its own process (`--row NAME`, this script re-invoked), so its peak RSS is its own and the thread
count (torch.set_num_threads, onnxruntime-genai's session intra_op_num_threads, pagedkit's SessionOptions,
llama.cpp's n_threads; OMP_NUM_THREADS in the environment) is set before the engine starts.

Models (built once into $PAGEDKIT_CACHE/bench, default ~/.cache/pagedkit/bench; --rebuild rebuilds): the GGUF of
`paged-fetch smollm2-135m` (Q4_1: the llama.cpp row runs it as it is) dequantized to float32 by transformers
(pagedkit.runtime.parity.load_hf) and written with save_pretrained (hf-fp32/: the HF rows load it, onnxruntime-
genai's builder reads it); the builder's `-p fp32 -e cpu` and `-p int4 -e cpu` models; `paged-export --model
smollm2-135m` fp16 (the README's default; on the CPU it runs widened to float32 outside attention), --dtype fp32,
--weights int4, --dtype fp32 --weights int4. A row whose model cannot be built is skipped with the reason; a row
whose engine fails records the error; neither stops the run. The must-hold ratios (PAIRS: pagedkit against
onnxruntime-genai, against llama.cpp, and the README's default path against pagedkit's best float row) are
printed with pass / fail at the end.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import inspect
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPO / "benchmarks" / "results" / "cpu_generate.json"
PROMPT_TEXT = REPO / "tests" / "data" / "ppl_text.txt"
PROMPT_TOKENS = 61
MODEL_NAME = "smollm2-135m"  # paged-fetch / paged-export name
SCHEMA_VERSION = 1
_OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false"}


# ---- models and rows --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSpec:
    key: str
    kind: str  # "hf" (save_pretrained folder), "genai" (onnxruntime-genai builder), "export" (paged-export),
    # "gguf" (the fetched GGUF file itself)
    folder: str  # under the cache folder
    flags: tuple[str, ...] = ()
    note: str = ""


MODELS = {m.key: m for m in (
    ModelSpec("hf-fp32", "hf", "hf-fp32", note="GGUF dequantized to float32 (load_hf), save_pretrained"),
    ModelSpec("genai-fp32", "genai", "genai-fp32", ("-p", "fp32", "-e", "cpu"), "builder: GroupQueryAttention, fp32"),
    ModelSpec("genai-int4", "genai", "genai-int4", ("-p", "int4", "-e", "cpu"),
              "builder: GroupQueryAttention, MatMulNBits int4 weights, fp32 activations"),
    ModelSpec("export-fp16", "export", "pagedkit-fp16", (), "paged-export defaults: fp16"),
    ModelSpec("export-fp32", "export", "pagedkit-fp32", ("--dtype", "fp32")),
    ModelSpec("export-int4", "export", "pagedkit-int4", ("--weights", "int4"), "fp16 activations, int4 weights"),
    ModelSpec("export-fp32-int4", "export", "pagedkit-fp32-int4", ("--dtype", "fp32", "--weights", "int4"),
              "fp32 activations, int4 weights"),
    ModelSpec("gguf-q4", "gguf", "", note="the GGUF paged-fetch unpacks (Q4_1), as it is: what llama.cpp runs"),
)}


@dataclass(frozen=True)
class Row:
    name: str
    engine: str  # "hf" | "genai" | "pagedkit" (the default CPU path: runtime/lite, else Generator) | "generator"
    # (Generator, a torch process) | "llamacpp"
    model: str  # a MODELS key
    batched: bool = False  # runs --batch sequences in lockstep
    note: str = ""


ROWS = {r.name: r for r in (
    Row("hf-fp32", "hf", "hf-fp32", note="transformers eager float32, forward loop with KV cache"),
    Row("genai-fp32", "genai", "genai-fp32"),
    Row("genai-int4", "genai", "genai-int4"),
    Row("pagedkit-fp16", "pagedkit", "export-fp16", note="the default CPU path on paged-export's fp16 model"),
    Row("pagedkit-fp32", "pagedkit", "export-fp32", note="the default CPU path on paged-export --dtype fp32"),
    Row("pagedkit-int4", "pagedkit", "export-int4", note="the default CPU path on --weights int4 (fp16)"),
    Row("pagedkit-fp32-int4", "pagedkit", "export-fp32-int4", note="the default CPU path on --dtype fp32 --weights int4"),
    Row("pagedkit-on-genai-fp32", "pagedkit", "genai-fp32", note="the default CPU path on the builder's fp32 GQA model "
        "(lite refuses the GQA layout: Generator)"),
    Row("pagedkit-on-genai-int4", "pagedkit", "genai-int4", note="the default CPU path on the builder's int4 GQA model"),
    Row("generator-fp32", "generator", "export-fp32", note="Generator (a torch process) on paged-export --dtype fp32"),
    Row("generator-fp32-int4", "generator", "export-fp32-int4", note="Generator on --dtype fp32 --weights int4"),
    Row("llamacpp-q4", "llamacpp", "gguf-q4", note="llama-cpp-python (llama.cpp) on the GGUF: eval + argmax"),
    Row("genai-fp32-batch", "genai", "genai-fp32", True, "GeneratorParams batch_size"),
    Row("genai-int4-batch", "genai", "genai-int4", True, "GeneratorParams batch_size"),
    Row("pagedkit-fp16-batch", "pagedkit", "export-fp16", True, "the default CPU path, all sequences per step"
        " (the LM head for each sequence's last token)"),
    Row("pagedkit-fp32-batch", "pagedkit", "export-fp32", True, "the default CPU path, all sequences per step"
        " (the LM head for each sequence's last token)"),
    Row("pagedkit-fp32-int4-batch", "pagedkit", "export-fp32-int4", True,
        "the default CPU path, all sequences per step (the LM head for each sequence's last token)"),
    Row("generator-fp32-int4-batch", "generator", "export-fp32-int4", True,
        "KVCacheManager + run_torch in a torch process, all sequences per step"),
)}


@dataclass(frozen=True)
class Pair:
    """pagedkit row vs a peer row (onnxruntime-genai, llama.cpp, or pagedkit's own best row): decode ratio >=
    min_decode, TTFT ratio <= max_ttft, peak RSS ratio <= max_rss (None: no check; must_hold False: reported for
    information). The peer's row name is `genai` (the first peer this benchmark had)."""

    pagedkit: str
    genai: str
    min_decode: float | None = None
    max_ttft: float | None = None
    must_hold: bool = True
    max_rss: float | None = None


PAIRS = (
    Pair("pagedkit-fp32", "genai-fp32", min_decode=1.0, max_ttft=1.0, max_rss=1.1),
    Pair("pagedkit-fp32-int4", "genai-int4", min_decode=1.0, max_ttft=1.0, max_rss=1.1),  # fp32 activations both
    Pair("pagedkit-int4", "genai-int4", must_hold=False),  # pagedkit's default int4 export (fp16 activations)
    Pair("pagedkit-fp32-batch", "genai-fp32-batch", min_decode=1.0, max_ttft=1.0),
    Pair("pagedkit-fp32-int4-batch", "genai-int4-batch", min_decode=1.0, max_ttft=1.0),
    Pair("pagedkit-fp32-int4", "llamacpp-q4", min_decode=1.2),  # int4 of the same GGUF against llama.cpp's Q4_1
    Pair("pagedkit-fp16", "pagedkit-fp32", min_decode=0.9),  # the README's default path vs the best float row
    Pair("pagedkit-on-genai-fp32", "genai-fp32", must_hold=False),  # the same model file: the runtimes alone
)


# ---- bytes per decode step and the floor (pure; tests/test_bench_cpu_generate.py) -------------------------------
MATMUL_OPS = ("MatMul", "Gemm", "MatMulNBits", "MatMulInteger", "QLinearMatMul", "FusedMatMul", "GemmFastGelu")
GATHER_OPS = ("Gather", "GatherBlockQuantized")
# ops an initializer may pass through on its way to a MatMul / Gather (constant-folded by the engines)
_PASS_THROUGH = ("Transpose", "Cast", "Reshape", "Identity", "DequantizeLinear", "Squeeze", "Unsqueeze", "Flatten")


def _tensor_bytes(t) -> int:
    """Stored bytes of an onnx TensorProto from its dims and element type (external data is never read)."""
    import onnx

    n = math.prod(t.dims)
    if t.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4) or t.data_type == getattr(
            onnx.TensorProto, "FLOAT4E2M1", -1):
        return (n + 1) // 2
    if t.data_type == onnx.TensorProto.STRING:
        return sum(len(s) for s in t.string_data)
    return n * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize


def onnx_weight_bytes(model, vocab_size: int | None = None) -> dict:
    """Bytes of the weights one decode token reads, from an ONNX model's initializers (main graph).

    model: an onnx.ModelProto or a path (loaded without its external data). Every initializer (or Constant)
    reaching an input of a MatMul-family node (MATMUL_OPS, through Transpose / Cast / Reshape ... chains) counts
    whole, in its stored dtype: weights, scales, zero points, biases, lm_head. One reaching the data input of a
    Gather / GatherBlockQuantized (the embedding; its scales too) counts one row: its bytes / vocab_size (the
    gathered dimension; default: the initializer's largest dimension). A tied table counts both (whole as lm_head,
    plus a row). Everything else (norm weights, rotary tables, ...) is not counted.
    Returns {"matmul": bytes, "embedding_row": bytes, "total": bytes, "matmul_initializers": count}."""
    import onnx

    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(str(model), load_external_data=False)
    g = model.graph
    consts = {t.name: t for t in g.initializer}
    for n in g.node:
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value" and a.type == onnx.AttributeProto.TENSOR:
                    consts[n.output[0]] = a.t
    producer = {o: n for n in g.node for o in n.output if o}

    def sources(name: str, seen: set) -> set[str]:
        """The constants a value is computed from through pass-through ops only."""
        if not name or name in seen:
            return set()
        seen.add(name)
        if name in consts:
            return {name}
        node = producer.get(name)
        if node is None or node.op_type not in _PASS_THROUGH or not node.input:
            return set()
        # the data input only (Reshape's shape, Squeeze's axes are not weights); DequantizeLinear: all three
        inputs = node.input if node.op_type == "DequantizeLinear" else node.input[:1]
        return set().union(*(sources(i, seen) for i in inputs))

    matmul, gathered = set(), set()
    for n in g.node:
        if n.op_type in MATMUL_OPS:
            for i in n.input:
                matmul |= sources(i, set())
        elif n.op_type in GATHER_OPS and n.input:
            data = [n.input[0]] + ([n.input[2]] if n.op_type == "GatherBlockQuantized" and len(n.input) > 2 else [])
            data += [n.input[3]] if n.op_type == "GatherBlockQuantized" and len(n.input) > 3 else []
            for i in data:
                gathered |= sources(i, set())
    mm = sum(_tensor_bytes(consts[c]) for c in matmul)
    row = 0
    for c in gathered:
        t = consts[c]
        if not t.dims:
            continue
        rows = vocab_size if vocab_size and vocab_size in t.dims else max(t.dims)
        row += _tensor_bytes(t) // max(rows, 1)
    return {"matmul": mm, "embedding_row": row, "total": mm + row, "matmul_initializers": len(matmul)}


def torch_weight_bytes(model) -> dict:
    """Bytes of the weights one decode token reads in a torch module, counted as onnx_weight_bytes counts an ONNX
    model: every nn.Linear's parameters in full (a tied lm_head included: it reads the whole table) plus one row of
    each nn.Embedding. The other parameters (norms) are reported apart, not in the total."""
    import torch

    matmul = row = other = 0
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            if isinstance(mod, torch.nn.Linear):
                matmul += p.numel() * p.element_size()
            elif isinstance(mod, torch.nn.Embedding):
                row += p[0].numel() * p.element_size()
            else:
                other += p.numel() * p.element_size()
    return {"matmul": matmul, "embedding_row": row, "total": matmul + row, "other_parameters": other}


def kv_bytes_per_token(num_layers: int, kv_heads: int, head_size: int, itemsize: float, caches: int = 2) -> float:
    """Bytes of K and V (caches=2) of one cached token over every layer."""
    return num_layers * caches * kv_heads * head_size * itemsize


def mean_decode_context(prompt_len: int, new_tokens: int) -> float:
    """Mean number of positions a decode step attends to: steps k = 1..new_tokens-1 attend to prompt_len + k."""
    return prompt_len + new_tokens / 2


def decode_step_bytes(weight_bytes: float, kv_per_token: float, context: float, batch: int = 1) -> float:
    """Bytes one decode step reads: the weights once, every sequence's K/V over its context."""
    return weight_bytes + batch * kv_per_token * context


def floor_tok_s(bandwidth_gb_s: float, weight_bytes: float, kv_per_token: float, context: float,
                batch: int = 1) -> float:
    """Memory-bandwidth bound on decode tokens/s (aggregate over the batch)."""
    return batch * bandwidth_gb_s * 1e9 / decode_step_bytes(weight_bytes, kv_per_token, context, batch)


def onnx_model_bytes(folder: Path) -> dict:
    """Weight bytes (onnx_weight_bytes) and K/V bytes per cached token of a model folder (genai_config.json's
    layers / kv heads / head size, the cache inputs' element type)."""
    import onnx

    cfg = json.loads((folder / "genai_config.json").read_text())
    dec = cfg["model"]["decoder"]
    model = onnx.load(str(folder / dec.get("filename", "model.onnx")), load_external_data=False)
    weights = onnx_weight_bytes(model, cfg["model"].get("vocab_size"))
    past = dec.get("inputs", {}).get("past_key_names", "past_key_values.%d.key").replace("%d", "0")
    arg = next((i for i in model.graph.input if i.name == past), None)
    elem = arg.type.tensor_type.elem_type if arg is not None else onnx.TensorProto.FLOAT
    itemsize = onnx.helper.tensor_dtype_to_np_dtype(elem).itemsize
    kv = kv_bytes_per_token(dec["num_hidden_layers"], dec["num_key_value_heads"], dec["head_size"], itemsize)
    return {"weights": weights, "kv_bytes_per_token": kv,
            "kv_dtype": onnx.helper.tensor_dtype_to_np_dtype(elem).name}


def gguf_model_bytes(path: Path, num_layers: int = 30, kv_heads: int = 3, head_size: int = 64) -> dict:
    """Bytes a llama.cpp decode step reads: the GGUF file's size (its tensors, a tied embedding read whole as the
    output layer, plus a few MB of vocabulary: an upper bound) and a float16 K/V cache (llama.cpp's default)."""
    size = Path(path).stat().st_size
    return {"weights": {"matmul": size, "embedding_row": 0, "total": size, "note": "GGUF file size"},
            "kv_bytes_per_token": kv_bytes_per_token(num_layers, kv_heads, head_size, 2), "kv_dtype": "float16"}


# ---- assembling the results (pure) --------------------------------------------------------------------------------
ROW_KEYS = ("name", "engine", "model", "batch", "status", "ttft_ms", "decode_tok_s", "peak_rss_mb", "floor_tok_s",
            "floor_fraction")
STATUSES = ("ok", "failed", "skipped")


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def matching_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two generations share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def round_ratios(a: dict, b: dict) -> dict[str, list[float]]:
    """pagedkit / genai decode and ttft ratios of every round both rows ran ok (rows without rounds: none)."""
    out = {"decode": [], "ttft": []}
    for ra, rb in zip(a.get("rounds") or [], b.get("rounds") or []):
        if ra.get("status") == "ok" and rb.get("status") == "ok":
            d, t = _ratio(ra.get("decode_tok_s"), rb.get("decode_tok_s")), _ratio(ra.get("ttft_ms"), rb.get("ttft_ms"))
            if d is not None and t is not None:
                out["decode"].append(d)
                out["ttft"].append(t)
    return out


def merge_rounds(raws: list[dict]) -> dict:
    """One row from its rounds' raw results: medians over every run of every ok round (ttft, decode, load),
    the largest peak memory, the first ok round's tokens; each round's own figures under `rounds`."""
    ok = [r for r in raws if r.get("status") == "ok"]
    if len(raws) == 1 or not ok:
        return raws[0] if len(raws) == 1 else raws[-1] | {"rounds": [_round_view(r) for r in raws]}
    row = dict(ok[0])
    runs = [x for r in ok for x in (r.get("reps") or [])]
    row["reps"] = runs
    row["ttft_ms"] = statistics.median(x["ttft_ms"] for x in runs)
    dec = [x["decode_tok_s"] for x in runs if x.get("decode_tok_s") is not None]
    row["decode_tok_s"] = statistics.median(dec) if dec else None
    for k in ("load_s", "import_s", "rss_after_load_mb", "warmup_s", "host_ms_per_step", "host_fraction"):
        vals = [r[k] for r in ok if isinstance(r.get(k), (int, float))]
        row[k] = statistics.median(vals) if vals else None
    row["peak_rss_mb"] = max(r["peak_rss_mb"] for r in ok)
    row["wall_s"] = sum(r.get("wall_s") or 0 for r in raws)
    row["rounds"] = [_round_view(r) for r in raws]
    return row


def _round_view(r: dict) -> dict:
    return {k: r.get(k) for k in ("status", "ttft_ms", "decode_tok_s", "peak_rss_mb", "reason") if k in r}


def pair_results(rows: dict[str, dict], pairs: Sequence[Pair] = PAIRS) -> list[dict]:
    """The pagedkit / genai ratios; pass None where a row of the pair did not run."""
    out = []
    for p in pairs:
        a, b = rows.get(p.pagedkit), rows.get(p.genai)
        res = {"pagedkit": p.pagedkit, "genai": p.genai, "must_hold": p.must_hold, "decode_ratio": None,
               "ttft_ratio": None, "checks": {}, "pass": None, "reason": None}
        bad = [f"{name}: {'not selected' if r is None else r.get('status')}"
               for r, name in ((a, p.pagedkit), (b, p.genai)) if r is None or r.get("status") != "ok"]
        if bad:
            res["reason"] = "; ".join(bad)
            out.append(res)
            continue
        seqs_a, seqs_b = (r.get("batch_tokens") or ([r["tokens"]] if r.get("tokens") else []) for r in (a, b))
        if seqs_a and seqs_b:  # greedy agreement, the shortest over the sequences
            res["matching_prefix_tokens"] = min(matching_prefix(x, y) for x, y in zip(seqs_a, seqs_b))
        res["decode_ratio"] = _ratio(a["decode_tok_s"], b["decode_tok_s"])
        res["ttft_ratio"] = _ratio(a["ttft_ms"], b["ttft_ms"])
        per = round_ratios(a, b)
        if per["decode"]:  # rounds: the median of the per-round ratios (drift of the host cancels within a round)
            res["ratio_of_medians"] = {"decode": res["decode_ratio"], "ttft": res["ttft_ratio"]}
            res["round_ratios"] = per
            res["decode_ratio"] = statistics.median(per["decode"])
            res["ttft_ratio"] = statistics.median(per["ttft"])
        if p.min_decode is not None:
            res["checks"][f"decode >= {p.min_decode:g}x"] = (res["decode_ratio"] is not None
                                                              and res["decode_ratio"] >= p.min_decode)
        if p.max_ttft is not None:
            res["checks"][f"ttft <= {p.max_ttft:g}x"] = (res["ttft_ratio"] is not None
                                                          and res["ttft_ratio"] <= p.max_ttft)
        res["rss_ratio"] = _ratio(a.get("peak_rss_mb"), b.get("peak_rss_mb"))
        if p.max_rss is not None:
            res["checks"][f"peak RSS <= {p.max_rss:g}x"] = (res["rss_ratio"] is not None
                                                             and res["rss_ratio"] <= p.max_rss)
        res["pass"] = all(res["checks"].values()) if res["checks"] else None
        out.append(res)
    return out


def finish_row(raw: dict, model_bytes: dict | None, bandwidth_gb_s: float | None, prompt_len: int,
               new_tokens: int) -> dict:
    """A row of the table from a child's raw result: the floor (bytes from the ONNX files, or the child's own
    torch parameter count for HF) and the fraction of it reached."""
    row = dict(raw)
    for k in ROW_KEYS:
        row.setdefault(k, None)
    mb = model_bytes or raw.get("model_bytes")
    if mb:
        ctx = mean_decode_context(prompt_len, new_tokens)
        batch = row["batch"] or 1
        row["bytes_per_decode_step"] = decode_step_bytes(mb["weights"]["total"], mb["kv_bytes_per_token"], ctx, batch)
        row["mean_decode_context"] = ctx
        if bandwidth_gb_s:
            row["floor_tok_s"] = floor_tok_s(bandwidth_gb_s, mb["weights"]["total"], mb["kv_bytes_per_token"], ctx,
                                             batch)
        row["model_bytes"] = mb
    row["floor_fraction"] = _ratio(row.get("decode_tok_s"), row.get("floor_tok_s"))
    return row


def build_rows(raw_rows: list[dict], model_bytes: dict[str, dict], bandwidth_gb_s: float | None, prompt_len: int,
               new_tokens: int, reference: str = "hf-fp32") -> list[dict]:
    """The table's rows (finish_row each) plus, per row, how many leading tokens of its first sequence agree with
    the reference row's greedy tokens (tokens_matching_hf)."""
    rows = [finish_row(r, model_bytes.get(r.get("model")), bandwidth_gb_s, prompt_len, new_tokens) for r in raw_rows]
    ref = next((r.get("tokens") for r in rows if r["name"] == reference and r["status"] == "ok"), None)
    for r in rows:
        if ref and r.get("tokens"):
            r["tokens_matching_hf"] = matching_prefix(r["tokens"], ref)
    return rows


def validate_results(doc: dict) -> list[str]:
    """Schema problems of a results document (empty: valid)."""
    errs = []
    for k in ("schema", "benchmark", "command", "date", "machine", "threads", "reps", "max_new_tokens",
              "prompt_tokens", "batch", "versions", "bandwidth", "rows", "pairs"):
        if k not in doc:
            errs.append(f"missing top-level key {k!r}")
    machine = doc.get("machine", {})
    for k in ("platform", "cpu_model", "cores"):
        if k not in machine:
            errs.append(f"machine lacks {k!r}")
    bw = doc.get("bandwidth", {})
    if not isinstance(bw, dict) or "gb_s" not in bw:
        errs.append("bandwidth lacks 'gb_s'")
    num = (int, float)
    for r in doc.get("rows", []):
        name = r.get("name", "?")
        for k in ROW_KEYS:
            if k not in r:
                errs.append(f"row {name}: missing {k!r}")
        if r.get("status") not in STATUSES:
            errs.append(f"row {name}: status {r.get('status')!r} not in {STATUSES}")
        if r.get("status") == "ok":
            for k in ("ttft_ms", "decode_tok_s", "peak_rss_mb"):
                if k == "decode_tok_s" and r.get(k) is None and doc.get("max_new_tokens") == 1:
                    continue  # one new token: no decode step
                if not isinstance(r.get(k), num) or r[k] < 0:
                    errs.append(f"row {name}: {k} should be a number >= 0, got {r.get(k)!r}")
        elif not r.get("reason"):
            errs.append(f"row {name}: status {r.get('status')} without a reason")
        for k in ("floor_tok_s", "floor_fraction"):
            if r.get(k) is not None and not isinstance(r[k], num):
                errs.append(f"row {name}: {k} should be a number or null")
    for p in doc.get("pairs", []):
        for k in ("pagedkit", "genai", "decode_ratio", "ttft_ratio", "checks", "pass", "must_hold"):
            if k not in p:
                errs.append(f"pair {p.get('pagedkit')}/{p.get('genai')}: missing {k!r}")
    return errs


def pair_lines(pairs: list[dict]) -> list[str]:
    lines = []
    for p in pairs:
        head = f"{p['pagedkit']} vs {p['genai']}" + ("" if p["must_hold"] else " (info)")
        if p["decode_ratio"] is None and p["ttft_ratio"] is None:
            lines.append(f"  {head}: n/a ({p['reason']})")
            continue
        parts = [f"decode {p['decode_ratio']:.2f}x" if p["decode_ratio"] is not None else "decode n/a",
                 f"ttft {p['ttft_ratio']:.2f}x" if p["ttft_ratio"] is not None else "ttft n/a"]
        if p.get("rss_ratio") is not None:
            parts.append(f"peak RSS {p['rss_ratio']:.2f}x")
        if p.get("round_ratios"):
            parts[0] += " (median of rounds " + " ".join(f"{r:.2f}" for r in p["round_ratios"]["decode"]) + ")"
        checks = ", ".join(f"{k} {'PASS' if v else 'FAIL'}" for k, v in p["checks"].items())
        lines.append(f"  {head}: {', '.join(parts)}" + (f"  [{checks}]" if checks else ""))
    return lines


def table_lines(rows: list[dict]) -> list[str]:
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    out = [f"{'row':<26} {'batch':>5} {'ttft ms':>9} {'decode tok/s':>12} {'peak MB':>8} {'load s':>6} "
           f"{'host':>5} {'floor tok/s':>11} {'of floor':>8}"]
    for r in rows:
        if r["status"] != "ok":
            out.append(f"{r['name']:<26} {r['batch'] or '-':>5} {r['status'].upper()}: {str(r.get('reason'))[:110]}")
            continue
        frac = "-" if r["floor_fraction"] is None else f"{100 * r['floor_fraction']:.0f}%"
        host = "-" if r.get("host_fraction") is None else f"{100 * r['host_fraction']:.0f}%"
        out.append(f"{r['name']:<26} {r['batch']:>5} {f(r['ttft_ms'], '9.1f')} {f(r['decode_tok_s'], '12.2f')} "
                   f"{f(r['peak_rss_mb'], '8.0f')} {f(r.get('load_s'), '6.2f')} {host:>5} "
                   f"{f(r['floor_tok_s'], '11.1f')} {frac:>8}")
    return out


# ---- the child: one row ---------------------------------------------------------------------------------------
def _rss_mb() -> float:
    """This process's peak resident memory: VmHWM, the high-water mark of its own address space. Not getrusage's
    ru_maxrss: Linux carries that over exec from the forked parent, so every row would read at least the
    orchestrating process's size (342 MB here, the same for every row that stayed below it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _current_rss_mb() -> float | None:
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    except ImportError:
        return None


class _Timer:
    """Collects, per run, the time of the first token and of the last."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.first = self.last = None

    def token(self):
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        self.last = now

    def result(self, new_tokens: int, batch: int) -> dict:
        ttft = self.first - self.t0
        decode = self.last - self.first
        return {"ttft_ms": 1000 * ttft, "decode_s": decode,
                "decode_tok_s": (new_tokens - 1) * batch / decode if new_tokens > 1 and decode > 0 else None}


def _engine_hf(folder: Path, prompts: list[list[int]], new_tokens: int, threads: int):
    import torch

    torch.set_num_threads(threads)
    sys.path.insert(0, str(REPO))
    from pagedkit.runtime.parity import load_hf

    model = load_hf(folder)
    cfg = model.config
    info = {"model_bytes": {"weights": torch_weight_bytes(model),
                            "kv_bytes_per_token": kv_bytes_per_token(
                                cfg.num_hidden_layers, cfg.num_key_value_heads,
                                getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                                torch.finfo(torch.float32).bits // 8),
                            "kv_dtype": "float32"},
            "torch_threads": torch.get_num_threads()}

    # the KV cache argument / output: `cache` in recent transformers, `past_key_values` before
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def run(n: int) -> tuple[dict, list[list[int]]]:
        with torch.inference_mode():
            timer = _Timer()
            out = model(input_ids=torch.tensor(prompts), use_cache=True, logits_to_keep=1)
            tok = out.logits[:, -1].argmax(-1)
            timer.token()
            toks = [tok.tolist()]
            past = getattr(out, cache_arg)
            for _ in range(n - 1):
                out = model(input_ids=tok[:, None], use_cache=True, logits_to_keep=1, **{cache_arg: past})
                past = getattr(out, cache_arg)
                tok = out.logits[:, -1].argmax(-1)
                timer.token()
                toks.append(tok.tolist())
        return timer.result(n, len(prompts)), [list(s) for s in zip(*toks)]

    return run, info


def _engine_genai(folder: Path, prompts: list[list[int]], new_tokens: int, threads: int):
    import numpy as np
    import onnxruntime_genai as og

    config = og.Config(str(folder))
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
    model = og.Model(config)
    ids = np.array(prompts, dtype=np.int32)
    info = {"genai_session_options": {"intra_op_num_threads": threads, "inter_op_num_threads": 1}}

    def run(n: int) -> tuple[dict, list[list[int]]]:
        total = ids.shape[1] + n
        timer = _Timer()
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=total, min_length=total, do_sample=False, batch_size=len(prompts))
        gen = og.Generator(model, params)
        gen.append_tokens(ids)
        for _ in range(n):
            gen.generate_next_token()  # the first: the prefill's logits; then one decode step each
            timer.token()
        seqs = [[int(t) for t in gen.get_sequence(i)][ids.shape[1]:] for i in range(len(prompts))]
        if any(len(s) != n for s in seqs):
            raise RuntimeError(f"onnxruntime-genai produced {[len(s) for s in seqs]} tokens, expected {n}")
        return timer.result(n, len(prompts)), seqs

    return run, info


def _engine_pagedkit(folder: Path, prompts: list[list[int]], new_tokens: int, threads: int):
    """pagedkit's default CPU path: the torch-free runner (pagedkit.runtime.lite) where it serves the model, else
    Generator (the reason is recorded as `lite_refused`)."""
    sys.path.insert(0, str(REPO))
    from pagedkit.runtime.lite import LiteGenerator, LiteUnavailable

    max_len = len(prompts[0]) + new_tokens
    try:
        gen = LiteGenerator(folder, threads=threads, max_seq_len=max_len, max_batch_size=len(prompts))
    except LiteUnavailable as exc:
        run, info = _engine_generator(folder, prompts, new_tokens, threads)
        return run, info | {"runner": "generator", "lite_refused": str(exc)}
    info = {"runner": "lite", "layout": "paged", "delegated": gen.plan["delegation"],
            "cpu_plan": str(gen.plan_dir)}
    ort_s = _timed_runs(gen.session)

    def run(n: int) -> tuple[dict, list[list[int]]]:
        ort_s.clear()
        timer = _Timer()
        toks = []
        for step in gen.generate(prompts, n, stop_at_eos=False):
            timer.token()
            toks.append(step)
        return _with_host(timer.result(n, len(prompts)), ort_s, n), [list(s) for s in zip(*toks)]

    return run, info


def _engine_generator(folder: Path, prompts: list[list[int]], new_tokens: int, threads: int):
    """pagedkit's torch-process path: Generator (batch rows: one KVCacheManager over its session)."""
    import torch

    sys.path.insert(0, str(REPO))
    from pagedkit.runtime.generate import Generator

    max_len = len(prompts[0]) + new_tokens
    gen = Generator(folder, threads=threads, max_seq_len=max_len)
    d = gen.session.delegated
    info = {"runner": "generator", "torch_threads": torch.get_num_threads(),
            "layout": "paged" if gen.config.paged else "gqa",
            "attention_variants": sorted(set(gen.session.attention_variants.values())),
            "cpu_backend": gen.session.cpu_backend,
            "delegated": {k: (len(v) if isinstance(v, (list, dict)) else v) for k, v in d.items()} if d else None}
    ort_s = _time_onnxruntime(gen.session)  # the wall time of each onnxruntime run (None: not one segment)
    if len(prompts) == 1:
        def run(n: int) -> tuple[dict, list[list[int]]]:
            if ort_s is not None:
                ort_s.clear()
            timer = _Timer()
            toks = []
            for step in gen.run(prompts[0], n, stop_at_eos=False):
                timer.token()
                toks.append(step.token)
            return _with_host(timer.result(n, 1), ort_s, n), [toks]

        return run, info
    batch = _pagedkit_batch(gen, prompts, max_len)

    def run_batch(n: int):
        if ort_s is not None:
            ort_s.clear()
        res, toks = batch(n)
        return _with_host(res, ort_s, n), toks

    return run_batch, info


def _time_onnxruntime(sess) -> list[float] | None:
    """Wall time of each run of the session's onnxruntime segment, when the model is one (host time = a step's time
    minus its run's)."""
    one = sess.single_segment() if hasattr(sess, "single_segment") else None
    if one is None:
        return None
    return _timed_runs(one[0].session)


def _timed_runs(ort_sess) -> list[float]:
    """The wall time of each run_with_iobinding of an onnxruntime session from now on (the list it appends to)."""
    times, real = [], ort_sess.run_with_iobinding

    def timed(binding, *args, **kwargs):
        t = time.perf_counter()
        try:
            return real(binding, *args, **kwargs)
        finally:
            times.append(time.perf_counter() - t)

    ort_sess.run_with_iobinding = timed
    return times


def _with_host(res: dict, ort_s: list[float] | None, n: int) -> dict:
    """res + the decode steps' host time: (their wall time - their onnxruntime runs') / steps (the first run is the
    prefill's: one run, no windowed chunks in SmolLM2)."""
    if ort_s is None or n < 2 or len(ort_s) != n or not res.get("decode_s"):
        return res
    host = (res["decode_s"] - sum(ort_s[1:])) / (n - 1)
    return res | {"host_ms_per_step": 1000 * host, "host_fraction": host * (n - 1) / res["decode_s"]}


def _pagedkit_batch(gen, prompts: list[list[int]], max_len: int):
    """Several sequences per step over one KVCacheManager (Generator is single-sequence): its session and config,
    a manager sized for the batch; feeds made as pagedkit.runtime.generate._PagedState does."""
    import dataclasses

    import torch
    from pagedkit.engine.sampling import greedy_rows
    from pagedkit.interface import names as N
    from pagedkit.runtime.kv.cache import KVCacheManager

    if not gen.config.paged:
        raise NotImplementedError("the batch loop serves paged models (block_table input) only")
    base = gen.state.mgr.config  # the single-sequence manager's layers and names
    if any(g.windowed for g in base.groups):
        raise NotImplementedError("the batch loop does not chunk prefills for windowed layers")
    b = len(prompts)
    groups = tuple(dataclasses.replace(g, num_blocks=b * math.ceil(max_len / g.block_size) + 2) for g in base.groups)
    mgr = KVCacheManager(dataclasses.replace(base, groups=groups, max_batch_size=b,
                                             max_num_tokens=sum(len(p) for p in prompts), max_seq_len=max_len))
    gen.state.mgr = None  # the single-sequence caches are not used
    sess, cfg = gen.session, gen.config
    renames = {k: cfg.input(k) for k in N.STEP_INPUTS}
    inputs = {a.name for a in sess.get_inputs()}
    ids_name, logits_name = cfg.input(N.INPUT_IDS), gen.logits_name
    # the LM head for each sequence's last token only, where the session offers it (the onnxruntime CPU path)
    rows_name = next((a.name for a in getattr(sess, "get_overridable_initializers", list)()
                      if a.name == "pagedkit.logit_rows"), None)

    def step(batch: list[tuple[int, list[int]]]) -> torch.Tensor:
        plan = mgr.plan(batch)
        feeds = {renames.get(k, k): v for k, v in plan.feeds(query_positions=True).items()}
        feeds = {k: v for k, v in feeds.items() if k in inputs} | mgr.cache_feeds()
        feeds[ids_name] = torch.tensor([t for _, ids in batch for t in ids], dtype=torch.int64, device=sess.device)
        last = torch.tensor(plan.query_lens).cumsum(0) - 1
        if rows_name is not None:
            feeds[rows_name] = last
        try:
            logits = sess.run_torch(feeds, [logits_name])[logits_name]
        except BaseException:
            mgr.abort(plan)
            raise
        mgr.commit(plan)
        if rows_name is not None:
            return greedy_rows(logits.reshape(len(batch), -1))  # the engine's argmax (numpy's on the CPU)
        logits = logits.reshape(plan.num_tokens, -1)
        return greedy_rows(logits[last])

    def run(n: int) -> tuple[dict, list[list[int]]]:
        seqs = list(range(1, b + 1))
        timer = _Timer()
        for s, p in zip(seqs, prompts):
            mgr.add_sequence(s, p)
        try:
            tok = step([(s, p) for s, p in zip(seqs, prompts)])
            timer.token()
            toks = [tok.tolist()]
            for _ in range(n - 1):
                tok = step([(s, [t]) for s, t in zip(seqs, toks[-1])])
                timer.token()
                toks.append(tok.tolist())
        finally:
            for s in seqs:
                mgr.free(s)
        return timer.result(n, b), [list(s) for s in zip(*toks)]

    return run


def _engine_llamacpp(gguf: Path, prompts: list[list[int]], new_tokens: int, threads: int):
    """llama-cpp-python on the GGUF file: the prompt in one eval, then one eval per token, greedy (argmax of the
    last position's logits); the same token ids as the other rows (the GGUF carries the same tokenizer). Built from
    source without AMX where the kernel does not grant AMX tile state to every thread (this host: ldtilecfg faults
    in ggml_backend_amx_mul_mat; CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON ... -DGGML_AMX_INT8=OFF")."""
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    if len(prompts) != 1:
        raise NotImplementedError("the llama.cpp row runs one sequence (llama-cpp-python's Llama has one)")
    prompt = prompts[0]
    llm = Llama(model_path=str(gguf), n_ctx=len(prompt) + new_tokens + 8, n_threads=threads,
                n_threads_batch=threads, n_batch=512, verbose=False)
    info = {"llama_cpp": {"n_threads": threads, "n_batch": 512, "gguf": gguf.name}}

    vocab = llm.n_vocab()

    def run(n: int) -> tuple[dict, list[list[int]]]:
        llm.reset()
        timer = _Timer()
        llm.eval(prompt)
        toks = []
        for k in range(n):  # the last position's logits (llama.cpp's own buffer: Llama.scores is not filled then)
            toks.append(int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1),
                                                            shape=(vocab,)))))
            timer.token()
            if k + 1 < n:
                llm.eval([toks[-1]])
        return timer.result(n, 1), [toks]

    return run, info


ENGINES = {"hf": _engine_hf, "genai": _engine_genai, "pagedkit": _engine_pagedkit, "generator": _engine_generator,
           "llamacpp": _engine_llamacpp}
# what each engine imports before it loads a model (timed apart: import_s, then load_s)
IMPORTS = {"hf": ("torch", "transformers"), "genai": ("numpy", "onnxruntime_genai"),
           "pagedkit": ("numpy", "onnxruntime", "pagedkit.runtime.lite"),
           "generator": ("torch", "pagedkit.runtime.generate"), "llamacpp": ("numpy", "llama_cpp")}


def run_row(args) -> int:
    """Child: run one row, write its raw result (or its error) to --result."""
    row = ROWS[args.row]
    spec = json.loads(Path(args.spec).read_text())
    prompts = spec["prompts"]
    out = {"name": row.name, "engine": row.engine, "model": row.model, "batch": len(prompts),
           "threads": args.threads, "pid": os.getpid()}
    try:
        import importlib

        t = time.perf_counter()
        sys.path.insert(0, str(REPO))
        for mod in IMPORTS[row.engine]:
            importlib.import_module(mod)
        out["import_s"] = time.perf_counter() - t
        t = time.perf_counter()
        run, info = ENGINES[row.engine](Path(spec["folder"]), prompts, args.max_new_tokens, args.threads)
        out |= info
        out["load_s"] = time.perf_counter() - t  # the model's session(s), after the imports
        out["rss_after_load_mb"] = _current_rss_mb()
        t = time.perf_counter()
        run(max(1, min(args.warmup_tokens, args.max_new_tokens)))  # warm-up, not counted
        out["warmup_s"] = time.perf_counter() - t
        reps, tokens = [], None
        for _ in range(args.reps):
            res, tokens = run(args.max_new_tokens)
            reps.append(res)
        out["reps"] = reps
        hosts = [r["host_ms_per_step"] for r in reps if r.get("host_ms_per_step") is not None]
        if hosts:  # pagedkit: the decode steps' time outside onnxruntime's run (planning, binding, sampling)
            out["host_ms_per_step"] = statistics.median(hosts)
            out["host_fraction"] = statistics.median(r["host_fraction"] for r in reps if r.get("host_fraction"))
        out["ttft_ms"] = statistics.median(r["ttft_ms"] for r in reps)
        dec = [r["decode_tok_s"] for r in reps if r["decode_tok_s"] is not None]
        out["decode_tok_s"] = statistics.median(dec) if dec else None
        out["tokens"] = tokens[0]  # the first sequence's generated tokens (last rep)
        if len(tokens) > 1:
            out["batch_tokens"] = tokens  # every sequence's
        out["status"] = "ok"
    except Exception as exc:  # recorded in the row; the run goes on
        import traceback

        out["status"], out["reason"] = "failed", f"{type(exc).__name__}: {exc}"[:2000]
        out["traceback"] = traceback.format_exc()[-4000:]
    out["peak_rss_mb"] = _rss_mb()
    Path(args.result).write_text(json.dumps(out))
    return 0 if out["status"] == "ok" else 1


def run_bandwidth(args) -> int:
    """Child: DRAM read bandwidth, torch.sum over a --bandwidth-mb array written first, args.threads threads."""
    import torch

    torch.set_num_threads(args.threads)
    n = args.bandwidth_mb * 2**20 // 4
    x = torch.empty(n, dtype=torch.float32)
    x.copy_(torch.arange(n, dtype=torch.float32).remainder_(251.0))  # every page written (no zero pages)
    float(x.sum())  # warm-up
    runs = []
    for _ in range(args.bandwidth_reps):
        t = time.perf_counter()
        float(x.sum())
        runs.append(x.numel() * 4 / (time.perf_counter() - t) / 1e9)
    Path(args.result).write_text(json.dumps({"runs_gb_s": runs, "array_bytes": n * 4,
                                             "torch_threads": torch.get_num_threads()}))
    return 0


# ---- the parent: models, prompts, children, results ---------------------------------------------------------------
def cache_dir() -> Path:
    sys.path.insert(0, str(REPO))
    from pagedkit.exporters.fetch import cache_root

    return cache_root() / "bench"


def _tool(name: str, module: str) -> list[str]:
    exe = shutil.which(name)
    return [exe] if exe else [sys.executable, "-m", module]


def _sources_hash(*dirs: str) -> str:
    h = hashlib.sha256()
    for d in dirs:
        for p in sorted((REPO / d).rglob("*.py")):
            h.update(str(p.relative_to(REPO)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


class Unavailable(Exception):
    """A model cannot be built (its row is skipped with this reason)."""


def export_flag_problem(flags: Sequence[str], help_text: str) -> str | None:
    """Why paged-export cannot take these flags, from its --help (None: it can)."""
    for i, f in enumerate(flags):
        if not f.startswith("--"):
            continue
        m = re.search(re.escape(f) + r" \{([^}]*)\}", help_text)
        if f not in help_text:
            return f"paged-export has no {f} option yet"
        if m and i + 1 < len(flags) and flags[i + 1] not in m.group(1).split(","):
            return f"paged-export {f} takes {{{m.group(1)}}}: no {flags[i + 1]} yet"
    return None


class Models:
    """Builds (once) and locates the models of the selected rows under the cache folder."""

    def __init__(self, root: Path, rebuild: bool = False, quiet: bool = False):
        self.root, self.rebuild, self.quiet = root, rebuild, quiet
        self.logs = root / "logs"
        self.built: dict[str, dict] = {}  # key -> {"folder", "build"} or {"error"}
        self._fetched = None
        self._export_help = None

    def fetched(self):
        if self._fetched is None:
            sys.path.insert(0, str(REPO))
            from pagedkit.exporters.fetch import fetch

            self._fetched = fetch(MODEL_NAME)  # the cache: no network when already fetched
        return self._fetched

    def _stamp(self, spec: ModelSpec) -> dict:
        f = self.fetched()
        base = {"gguf": f.gguf.name, "transformers": _version("transformers")}
        if spec.kind == "hf":
            return base
        if spec.kind == "genai":
            return base | {"onnxruntime-genai": _version("onnxruntime-genai"), "flags": list(spec.flags)}
        return {"gguf": f.gguf.name, "flags": list(spec.flags),
                "pagedkit_sources": _sources_hash("pagedkit/exporters", "pagedkit/interface")}

    def _run(self, cmd: list[str], key: str, timeout: float = 3600) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        log = self.logs / f"build-{key}.log"
        with open(log, "w") as fh:
            fh.write(" ".join(cmd) + "\n")
            fh.flush()
            proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=os.environ | _OFFLINE,
                                  timeout=timeout, cwd=REPO)
        if proc.returncode:
            tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-4:])
            raise Unavailable(f"build of {key} failed (exit {proc.returncode}; {log}): {tail}"[:1500])

    def get(self, key: str) -> Path:
        if key in self.built:
            if "error" in self.built[key]:
                raise Unavailable(self.built[key]["error"])
            return Path(self.built[key]["folder"])
        try:
            folder = self._get(MODELS[key])
        except Unavailable as exc:
            self.built[key] = {"error": str(exc)}
            raise
        except Exception as exc:
            self.built[key] = {"error": f"{type(exc).__name__}: {exc}"[:1500]}
            raise Unavailable(self.built[key]["error"]) from exc
        return folder

    def _get(self, spec: ModelSpec) -> Path:
        if spec.kind == "gguf":  # the fetched file itself: nothing to build
            gguf = Path(self.fetched().gguf)
            if not gguf.is_file():
                raise Unavailable(f"no GGUF at {gguf}")
            self.built[spec.key] = {"folder": str(gguf), "note": spec.note,
                                    "build": {"stamp": {"gguf": gguf.name}, "bytes": gguf.stat().st_size}}
            return gguf
        folder = self.root / spec.folder
        stamp = self._stamp(spec)
        marker = folder / "bench_build.json"
        done = marker.is_file() and json.loads(marker.read_text()).get("stamp") == stamp
        if spec.kind == "export":
            if self._export_help is None:
                self._export_help = subprocess.run(_tool("paged-export", "pagedkit.exporters.cli") + ["--help"],
                                                   capture_output=True, text=True, cwd=REPO).stdout
            problem = export_flag_problem(spec.flags, self._export_help)
            if problem:
                raise Unavailable(problem)
        if not done or self.rebuild:
            tmp = folder.with_name(folder.name + ".building")
            shutil.rmtree(tmp, ignore_errors=True)
            t = time.perf_counter()
            cmd = self._build(spec, tmp)
            if folder.exists():
                shutil.rmtree(folder)
            tmp.rename(folder)
            marker.write_text(json.dumps({"stamp": stamp, "command": cmd, "built": _now(),
                                          "seconds": time.perf_counter() - t}, indent=1))
        build = json.loads(marker.read_text())
        self.built[spec.key] = {"folder": str(folder), "note": spec.note, "build": build}
        return folder

    def _build(self, spec: ModelSpec, out: Path) -> list[str]:
        if spec.kind == "hf":
            cmd = [sys.executable, str(Path(__file__).resolve()), "--write-hf", str(out)]
            self._run(cmd, spec.key)
            return cmd
        if spec.kind == "genai":
            hf = self.get("hf-fp32")
            cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out),
                   "-c", str(self.root / "builder-cache"), *spec.flags]
        else:
            cmd = _tool("paged-export", "pagedkit.exporters.cli") + [
                "--model", MODEL_NAME, "--output", str(out), "--quiet", *spec.flags]
        self._run(cmd, spec.key)
        if not (out / "model.onnx").is_file() or not (out / "genai_config.json").is_file():
            raise Unavailable(f"{' '.join(cmd)} wrote no model.onnx + genai_config.json in {out}")
        return cmd


def write_hf(out: Path) -> None:
    """The fetched GGUF dequantized to float32 (load_hf), written with save_pretrained plus the tokenizer files."""
    sys.path.insert(0, str(REPO))
    from pagedkit.exporters.fetch import fetch
    from pagedkit.runtime.parity import load_hf

    f = fetch(MODEL_NAME)
    model = load_hf(f.model_dir)
    # the weights are plain float32 tensors now; the GGUF quantizer marker only blocks save_pretrained
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    f.tokenizer().save_pretrained(out)
    for name in ("chat_template.jinja",):
        if (f.model_dir / name).is_file() and not (out / name).exists():
            shutil.copy(f.model_dir / name, out / name)


def make_prompts(tokenizer, text: str, batch: int, length: int = PROMPT_TOKENS) -> list[list[int]]:
    """`batch` distinct prompts of `length` tokens: consecutive windows of the text's tokens."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < batch * length:
        raise ValueError(f"the prompt text has {len(ids)} tokens; {batch} prompts of {length} need {batch * length}")
    return [ids[i * length:(i + 1) * length] for i in range(batch)]


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def machine_info() -> dict:
    cpu = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        cpu = next((l.split(":", 1)[1].strip() for l in cpuinfo.read_text().splitlines()
                    if l.startswith("model name")), "")
    info = {"platform": platform.platform(), "machine": platform.machine(), "cpu_model": cpu or platform.processor(),
            "cores": os.cpu_count(), "python": platform.python_version()}
    try:
        info["usable_cores"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    try:
        import psutil

        info["physical_cores"] = psutil.cpu_count(logical=False)
        info["memory_gb"] = round(psutil.virtual_memory().total / 1e9, 1)
    except ImportError:
        pass
    return info


def versions() -> dict:
    out = {d: _version(d) for d in ("torch", "onnx", "onnxruntime", "onnxruntime-genai", "transformers", "numpy",
                                    "pagedkit")}
    try:
        out["pagedkit_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                                cwd=REPO).stdout.strip() or None
        dirty = subprocess.run(["git", "status", "--porcelain", "pagedkit"], capture_output=True, text=True,
                               cwd=REPO).stdout.strip()
        out["pagedkit_tree_dirty"] = bool(dirty)
    except OSError:
        pass
    return out


def _child(argv: list[str], threads: int, timeout: float, log: Path) -> tuple[int, str]:
    env = os.environ | _OFFLINE | {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    with open(log, "w") as fh:
        try:
            rc = subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv], stdout=fh,
                                stderr=subprocess.STDOUT, env=env, timeout=timeout, cwd=REPO).returncode
        except subprocess.TimeoutExpired:
            rc = -9
    tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
    return rc, tail


def measure_bandwidth(args, work: Path, threads: int) -> dict:
    result = work / "bandwidth.json"
    result.unlink(missing_ok=True)
    rc, tail = _child(["--bandwidth", "--threads", str(threads), "--result", str(result),
                       "--bandwidth-mb", str(args.bandwidth_mb), "--bandwidth-reps", str(args.bandwidth_reps)],
                      threads, 600, work / "bandwidth.log")
    if rc or not result.is_file():
        return {"error": f"bandwidth child exited {rc}: {tail}"}
    return json.loads(result.read_text())


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    several = isinstance(doc.get("threads"), list)
    names = [(f"{r['name']} (b{r['batch']})" if (r["batch"] or 1) > 1 else r["name"])
             + (f" {r.get('threads')}T" if several else "") for r in rows]
    y = list(range(len(rows)))[::-1]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 0.45 * len(rows) + 2.2), sharey=True)
    colors = {"hf": "tab:gray", "genai": "tab:blue", "pagedkit": "tab:orange", "generator": "tab:brown",
              "llamacpp": "tab:purple"}
    for yi, r in zip(y, rows):
        c = colors.get(r["engine"], "tab:green")
        if r["status"] != "ok":
            ax1.text(0.01, yi, f"  {r['status']}: {str(r.get('reason'))[:70]}", va="center", fontsize=7,
                     color="tab:red", transform=ax1.get_yaxis_transform())
            continue
        ax1.barh(yi, r["decode_tok_s"] or 0, color=c, alpha=0.85)
        ax1.text(r["decode_tok_s"] or 0, yi, f" {r['decode_tok_s'] or 0:.1f}", va="center", fontsize=7)
        if r.get("floor_tok_s"):
            ax1.plot([r["floor_tok_s"]] * 2, [yi - 0.4, yi + 0.4], color="black", lw=2)
        ax2.barh(yi, r["ttft_ms"], color=c, alpha=0.85)
        ax2.text(r["ttft_ms"], yi, f" {r['ttft_ms']:.0f}", va="center", fontsize=7)
    from matplotlib.patches import Patch

    engines = sorted({r["engine"] for r in rows}, key=list(colors).index)
    fig.legend([Patch(color=colors[e], alpha=0.85) for e in engines], engines, fontsize=7, loc="upper left",
               ncol=len(engines), frameon=False)
    ax1.set_yticks(y, names, fontsize=8)
    ax1.set_xlabel("decode tokens/s, aggregate over the batch (log scale); black tick: bandwidth floor")
    ax1.set_xscale("log")
    ax2.set_xlabel("time to first token, ms (log scale)")
    ax2.set_xscale("log")
    bw = doc["bandwidth"].get("gb_s")
    fig.suptitle(f"SmolLM2-135M-Instruct, {doc['prompt_tokens']}-token prompt, {doc['max_new_tokens']} greedy tokens, "
                 f"{doc['threads']} thread(s), median of {doc['reps']} x {doc.get('rounds', 1)} round(s); "
                 f"{doc['machine'].get('cpu_model', '')}"
                 + (f", {bw:.1f} GB/s read" if bw else ""), fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", metavar="ROW", help=f"rows to run (default: all): {', '.join(ROWS)}")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3, help="measured runs per row (the median is reported)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the whole selection this many times, interleaved (pairs: median per-round ratio)")
    p.add_argument("--threads", type=int, nargs="+", default=[2],
                   help="thread counts: the whole selection runs at each (rows and pairs carry `threads`)")
    p.add_argument("--note", help="a note recorded in the results (e.g. that the machine was shared)")
    p.add_argument("--batch", type=int, default=8, help="sequences of the *-batch rows")
    p.add_argument("--warmup-tokens", type=int, default=8, help="new tokens of the warm-up run (not counted)")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON path; the plot goes beside it (.png)")
    p.add_argument("--cache", type=Path, default=None, help="model cache folder (default: $PAGEDKIT_CACHE/bench)")
    p.add_argument("--rebuild", action="store_true", help="rebuild the cached models")
    p.add_argument("--row-timeout", type=float, default=3600, help="seconds one row may take")
    p.add_argument("--bandwidth-mb", type=int, default=1024)
    p.add_argument("--bandwidth-reps", type=int, default=10)
    p.add_argument("--list", action="store_true", help="list the rows and exit")
    # internal: the children
    p.add_argument("--row", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--bandwidth", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--write-hf", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.row or args.bandwidth:  # the children take one thread count
        args.threads = args.threads[0]

    if args.write_hf:
        write_hf(args.write_hf)
        return 0
    if args.bandwidth:
        return run_bandwidth(args)
    if args.row:
        return run_row(args)
    if args.list:
        for r in ROWS.values():
            m = MODELS[r.model]
            print(f"{r.name:<26} {r.engine:<9} {m.folder:<20} {'batch ' if r.batched else ''}"
                  f"{r.note or m.note}")
        return 0
    for name in args.rows or []:
        if name not in ROWS:
            p.error(f"unknown row {name!r}; rows: {', '.join(ROWS)}")
    if args.max_new_tokens < 1 or args.reps < 1 or min(args.threads) < 1 or args.batch < 1 or args.rounds < 1:
        p.error("--max-new-tokens, --reps, --rounds, --threads and --batch must be >= 1")
    return run_all(args)


def run_all(args) -> int:
    from tqdm import tqdm

    selected = [ROWS[n] for n in (args.rows or list(ROWS))]
    threads = list(dict.fromkeys(args.threads))
    root = args.cache or cache_dir()
    models = Models(root, rebuild=args.rebuild)
    work = root / "runs"
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    doc = {"schema": SCHEMA_VERSION, "benchmark": "cpu_generate",
           "command": " ".join([Path(sys.executable).name, *[a if " " not in a else repr(a) for a in sys.argv]]),
           "date": _now(), "machine": machine_info(), "threads": threads[0] if len(threads) == 1 else threads,
           "reps": args.reps, "rounds": args.rounds,
           "warmup_tokens": args.warmup_tokens, "max_new_tokens": args.max_new_tokens,
           "prompt_tokens": PROMPT_TOKENS, "batch": args.batch, "versions": versions(),
           "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}
    if args.note:
        doc["notes"] = args.note
    print(f"models in {root}; rows: {', '.join(r.name for r in selected)}; threads {threads}", flush=True)

    tokenizer = models.fetched().tokenizer()
    text = PROMPT_TEXT.read_text(encoding="utf-8")
    prompts = {1: make_prompts(tokenizer, text, 1), args.batch: make_prompts(tokenizer, text, args.batch)}
    doc["prompt_text"] = str(PROMPT_TEXT.relative_to(REPO))
    doc["prompt_ids"] = prompts[1][0]

    bw = {th: measure_bandwidth(args, work, th) for th in threads}
    by_row: dict[tuple[str, int], list[dict]] = {(r.name, th): [] for r in selected for th in threads}
    model_bytes = {}
    bar = tqdm([(k, th, r) for k in range(args.rounds) for th in threads for r in selected], desc="rows", unit="row")
    for rnd, th, row in bar:
        label = row.name if len(threads) == 1 else f"{row.name} {th}T"
        bar.set_postfix_str(label if args.rounds == 1 else f"{label} (round {rnd + 1}/{args.rounds})")
        raw_rows = by_row[(row.name, th)]
        batch = args.batch if row.batched else 1
        base = {"name": row.name, "engine": row.engine, "model": row.model, "batch": batch, "note": row.note,
                "threads": th}
        try:
            folder = models.get(row.model)
        except Unavailable as exc:
            raw_rows.append(base | {"status": "skipped", "reason": str(exc)})
            tqdm.write(f"{label}: skipped: {exc}")
            continue
        if row.model not in model_bytes and MODELS[row.model].kind == "gguf":
            model_bytes[row.model] = gguf_model_bytes(folder)
        elif row.model not in model_bytes and MODELS[row.model].kind != "hf":
            model_bytes[row.model] = onnx_model_bytes(folder)
        spec = work / f"{row.name}.spec.json"
        spec.write_text(json.dumps({"folder": str(folder), "prompts": prompts[batch]}))
        result = work / f"{row.name}.t{th}.r{rnd}.result.json"
        result.unlink(missing_ok=True)
        t = time.perf_counter()
        rc, tail = _child(["--row", row.name, "--spec", str(spec), "--result", str(result), "--threads",
                           str(th), "--reps", str(args.reps), "--max-new-tokens", str(args.max_new_tokens),
                           "--warmup-tokens", str(args.warmup_tokens)], th, args.row_timeout,
                          work / f"{row.name}.t{th}.r{rnd}.log")
        if result.is_file():
            raw = base | json.loads(result.read_text())
        else:
            raw = base | {"status": "failed", "reason": f"the row's process exited {rc} without a result"
                          f" ({'timed out' if rc == -9 else tail})"}
        raw["wall_s"] = time.perf_counter() - t
        raw_rows.append(raw)
        msg = (f"ttft {raw['ttft_ms']:.0f} ms, decode {raw['decode_tok_s'] or 0:.2f} tok/s, "
               f"peak {raw['peak_rss_mb']:.0f} MB" if raw["status"] == "ok" else f"FAILED: {raw['reason'][:200]}")
        tqdm.write(f"{label}: {msg}" if args.rounds == 1 else f"{label} (round {rnd + 1}): {msg}")

    bw_end = {th: measure_bandwidth(args, work, th) for th in threads}
    doc["models"] = {k: v | ({"bytes": model_bytes[k]} if k in model_bytes else {}) for k, v in models.built.items()}
    doc["floor_method"] = ("floor_tok_s = batch * bandwidth / (weight bytes + batch * kv_bytes_per_token * "
                           "mean_decode_context); weight bytes: every MatMul/Gemm/MatMulNBits initializer (stored "
                           "dtype, lm_head included) + one embedding row, from the ONNX files (HF: its parameters, "
                           "float32; llama.cpp: the GGUF file's size); mean_decode_context = prompt + "
                           "max_new_tokens / 2")
    doc["rows"], doc["pairs"], doc["bandwidth_by_threads"] = [], [], {}
    for th in threads:
        runs = bw[th].get("runs_gb_s", []) + bw_end[th].get("runs_gb_s", [])
        band = {"gb_s": max(runs) if runs else None, "median_gb_s": statistics.median(runs) if runs else None,
                "start": bw[th], "end": bw_end[th], "method": "torch.sum over a float32 array written first; "
                "gb_s = the best run (start and end of the run), used for the floor"}
        doc["bandwidth_by_threads"][str(th)] = band
        rows = build_rows([merge_rounds(by_row[(r.name, th)]) for r in selected], model_bytes, band["gb_s"],
                          PROMPT_TOKENS, args.max_new_tokens)
        pairs = pair_results({r["name"]: r for r in rows})
        for x in rows + pairs:
            x["threads"] = th
        doc["rows"] += rows
        doc["pairs"] += pairs
    doc["bandwidth"] = doc["bandwidth_by_threads"][str(threads[0])]
    doc["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    doc["wall_s"] = time.time() - started
    problems = validate_results(doc)
    if problems:
        print("results schema problems:\n  " + "\n  ".join(problems), file=sys.stderr)

    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(doc, indent=1) + "\n")
    png = args.output.with_suffix(".png")
    try:
        plot(doc, png)
    except Exception as exc:  # the JSON is the result; a plotting problem is reported, not fatal
        print(f"plot failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    for th in threads:
        band = doc["bandwidth_by_threads"][str(th)]["gb_s"]
        rows = [r for r in doc["rows"] if r["threads"] == th]
        pairs = [p for p in doc["pairs"] if p["threads"] == th]
        print(f"\n{th} thread(s): read bandwidth {f'{band:.1f} GB/s' if band else 'unmeasured'}")
        print("\n".join(table_lines(rows)))
        print("must-hold pairs (pagedkit / peer):")
        print("\n".join(pair_lines([p for p in pairs if p["must_hold"]])))
        info = [p for p in pairs if not p["must_hold"]]
        if info:
            print("other ratios:")
            print("\n".join(pair_lines(info)))
    print(f"\n{len(doc['rows'])} rows in {doc['wall_s']:.0f} s; wrote {args.output} and {png}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
