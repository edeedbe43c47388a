"""GPU parity check: pagedkit's engine model vs onnxruntime-gpu on the same ONNX file, and CUDA-graph replay
vs eager execution of the same kernels. Writes benchmarks/results/engine_ort_parity.json.

    python benchmarks/engine_ort_parity.py MODEL_DIR [--make-model CONFIG_DIR] [--batch 8] [--prompt-len 128]
        [--steps 64] [--tol 2e-2] [--seed 0] [--out benchmarks/results/engine_ort_parity.json]

MODEL_DIR: an exported paged model folder (model.onnx + genai_config.json). With --make-model CONFIG_DIR and
no MODEL_DIR/model.onnx, a Llama-3.2-1B-shaped config.json (random weights, ~1.24 B parameters) is written
to CONFIG_DIR and exported to MODEL_DIR by `python -m pagedkit.exporters.cli` (fp16, block size 256).

Teacher forcing: B seeded random prompts of --prompt-len tokens are prefilled, then every arm is fed the
SAME seeded random token stream forced[s] ([B] ids, step s = 0 .. steps-1), one token per sequence a step,
so no arm's choices steer another's inputs. Arms (each its own KVCacheManager and caches, run one after
the other over identical manager operations, so the block tables are identical):
  graph: Engine(cuda_graphs=True).model: decode steps planned by PagedModel.plan (padded to the batch
         bucket, replay-wide attention_metadata bounds); the first step of a graph key runs eagerly and
         captures, later steps replay.
  eager: Engine(cuda_graphs="padded").model: the same padded plans (same bounds), run eagerly; where that
         is refused, cuda_graphs=False plain plans (then the JSON says the eager inputs differ from the graph's).
  ort:   onnxruntime's CUDAExecutionProvider (bench.ort_arm.OrtRunner, IOBinding) fed ort_arm.step_feeds over
         KVCacheManager(graph model's config): plain plans.
Logits of a step: [B, V] in the model's logits dtype on the GPU (prefill: the last prompt position of each
sequence; decode step s: the prediction after forced[s]).
Checks: per step max|graph - ort| <= tol x max|ort| (prefill included); argmax(graph) == argmax(ort) per
row except at near-ties (ORT's top-1 - top-2 gap < tol x max|ort row|, reported); graph logits
bit-identical (torch.equal) to eager at every decode step, with at least one replayed step. Exit 0: all
pass; 1: a check failed (one line says which); 2: no CUDA / onnxruntime-gpu, or no model.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import random
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "engine_ort_parity.json"
EXPORT_BLOCK_SIZE = 256
# Llama-3.2-1B's architecture (its config.json), context cut to 4096 (rotary table rows)
LLAMA_1B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
            "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 64, "vocab_size": 128256, "rope_theta": 500000.0, "tie_word_embeddings": True,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "hidden_act": "silu", "attention_bias": False,
            "mlp_bias": False, "bos_token_id": 128000, "eos_token_id": 128001,
            "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}}


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", type=Path, metavar="MODEL_DIR", help="exported paged model folder")
    ap.add_argument("--make-model", type=Path, metavar="CONFIG_DIR", default=None,
                    help="without MODEL_DIR/model.onnx: write a Llama-3.2-1B-shaped config.json to CONFIG_DIR and "
                         "export it (random weights, fp16) to MODEL_DIR")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64, help="teacher-forced decode steps")
    ap.add_argument("--tol", type=float, default=2e-2, help="max|diff| <= tol x max|ref|; near-tie: gap < tol x max|ref|")
    ap.add_argument("--seed", type=int, default=0, help="prompts, forced tokens and random weights")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return ap.parse_args(argv)


def unavailable() -> str | None:
    """Why this machine cannot run the check (None: CUDA and onnxruntime's CUDAExecutionProvider are here)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    from pagedkit.apps.bench import ort_arm

    return ort_arm.unavailable("cuda")


def make_model(config_dir: Path, model_dir: Path, seed: int, **overrides) -> None:
    """Write LLAMA_1B (| overrides) to config_dir/config.json and export it with random weights to model_dir."""
    config_dir.mkdir(parents=True, exist_ok=True)
    cfg = LLAMA_1B | overrides
    (config_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    subprocess.run([sys.executable, "-m", "pagedkit.exporters.cli", "--model", str(config_dir), "--output",
                    str(model_dir), "--block-size", str(EXPORT_BLOCK_SIZE), "--max-seq-len",
                    str(cfg["max_position_embeddings"]), "--seed", str(seed), "--quiet"], check=True, cwd=REPO)


# ---- arms -------------------------------------------------------------------------------------------------

def load_models(model_dir: Path, device: str, batch: int, prompt_len: int, steps: int):
    """(graph model, eager model, eager mode): two PagedModels with identical pools."""
    from pagedkit.engine import Engine
    from pagedkit.runtime.generate import read_config

    bs = read_config(model_dir).block_size or 16
    kw = dict(max_batch_size=batch, max_num_tokens=batch * prompt_len, enable_prefix_caching=False,
              num_blocks=batch * math.ceil((prompt_len + steps) / bs) + 1)
    graph = Engine(model_dir, device, cuda_graphs=True, **kw).model
    try:  # cuda_graphs="padded": the same padded plans and replay-wide bounds, run eagerly (no capture)
        eager = Engine(model_dir, device, cuda_graphs="padded", **kw).model
        mode = "cuda_graphs='padded': the graph's padded plans and replay-wide bounds, run eagerly"
    except ValueError as exc:
        eager = Engine(model_dir, device, cuda_graphs=False, **kw).model
        mode = (f"cuda_graphs=False plain plans (exact bounds, no padding; the graph's inputs differ): "
                f"cuda_graphs='padded' refused ({exc})")
    return graph, eager, mode


def teacher_forced(mgr, plan_fn, run_fn, prompts, forced, on_decode=None):
    """Prefill `prompts` (chunked to the manager's token budget), then feed forced[s] ([B] ids) for every
    step s. Returns (prefill logits [B, V], [decode logits [B, V] per step], decode plan facts of step 0);
    logits are clones (a graph's output buffer is rewritten by its next replay)."""
    import torch

    sids = [f"parity-{i}" for i in range(len(prompts))]
    last = [None] * len(prompts)
    try:
        for s, p in zip(sids, prompts):
            mgr.add_sequence(s, p)
        done = [0] * len(prompts)
        while any(d < len(p) for d, p in zip(done, prompts)):
            batch, rows, ready, left, flat = [], [], [], mgr.config.max_num_tokens, 0
            for i, (s, p) in enumerate(zip(sids, prompts)):
                if done[i] < len(p) and left > 0:
                    n = min(left, len(p) - done[i], mgr.max_step_tokens(s))
                    batch.append((s, p[done[i]:done[i] + n]))
                    left, flat, done[i] = left - n, flat + n, done[i] + n
                    if done[i] == len(p):
                        rows.append(flat - 1)
                        ready.append(i)
            plan = plan_fn(batch)
            out = run_fn(plan, [t for _, ids in batch for t in ids], rows)  # [len(rows), V]
            mgr.commit(plan)
            for k, i in enumerate(ready):
                last[i] = out[k].clone()
        decode, facts = [], None
        for step_ids in forced:
            plan = plan_fn([(s, [t]) for s, t in zip(sids, step_ids)])
            if facts is None:
                facts = {"pad_rows": getattr(plan, "pad_rows", 0),
                         "attention_metadata": [int(x) for x in plan.attention_metadata.tolist()]}
            decode.append(run_fn(plan, list(step_ids), list(range(len(sids)))).clone())
            mgr.commit(plan)
            if on_decode is not None:
                on_decode()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    finally:
        for s in sids:
            if s in mgr.seqs:
                mgr.free(s)
    return torch.stack(last), decode, facts


def ort_arm_run(pm, model_dir: Path, prompts, forced):
    """The ORT arm over its own KVCacheManager (a copy of pm that shares its names, not its caches)."""
    from pagedkit.apps.bench import ort_arm
    from pagedkit.runtime.kv.cache import KVCacheManager

    side = copy.copy(pm)
    side.mgr, side.graphs = KVCacheManager(pm.mgr.config), None
    runner = ort_arm.OrtRunner(str(model_dir / pm.config.filename), ort_arm.host_input_names(pm))
    theirs = {t.data_ptr() for t in pm.mgr.cache_feeds().values()}

    def run(plan, ids, rows):
        try:
            feeds, outputs = ort_arm.step_feeds(side, runner, plan, ids)
            shared = [k for k, v in feeds.items() if v.data_ptr() in theirs]
            if shared:
                raise RuntimeError(f"the ORT arm's feeds {shared} are the pagedkit arm's caches")
            runner.run(feeds, outputs)
        except BaseException:
            side.mgr.abort(plan)
            raise
        return outputs[pm.logits_name].reshape(len(ids), -1)[rows]

    prefill, decode, facts = teacher_forced(side.mgr, side.mgr.plan, run, prompts, forced)
    return prefill, decode, facts, runner.version


# ---- comparison -------------------------------------------------------------------------------------------

def compare(got, ref, tol: float, step) -> tuple[float, int, list, list]:
    """got, ref [B, V] (ref = ORT): (max|diff| / max|ref|, argmax agreements, near-ties, failures)."""
    g, r = got.float(), ref.float()
    rel = float((g - r).abs().max() / r.abs().max().clamp_min(1e-30))
    ga, ra = g.argmax(-1).tolist(), r.argmax(-1).tolist()
    ties, bad, agree = [], [], 0
    for row, (a, b) in enumerate(zip(ga, ra)):
        if a == b:
            agree += 1
            continue
        top = r[row].topk(2).values
        gap = float(top[0] - top[1]) / float(r[row].abs().max())
        rec = {"step": step, "row": row, "pagedkit": a, "ort": b, "ort_gap_rel": gap}
        (ties if gap < tol else bad).append(rec)
    return rel, agree, ties, bad


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    why = unavailable()
    if why:
        print(f"engine_ort_parity: needs CUDA + onnxruntime-gpu (CUDAExecutionProvider): {why}")
        return 2
    model_dir, made = args.model_dir, False
    if not (model_dir / "model.onnx").is_file():
        if args.make_model is None:
            print(f"engine_ort_parity: {model_dir} has no model.onnx (pass --make-model CONFIG_DIR to export one)")
            return 2
        make_model(args.make_model, model_dir, args.seed)
        made = True

    import torch

    graph, eager, eager_mode = load_models(model_dir, "cuda", args.batch, args.prompt_len, args.steps)
    cfg = graph.config
    if args.prompt_len + args.steps > graph.max_seq_len:
        print(f"engine_ort_parity: --prompt-len + --steps exceeds the model's context {graph.max_seq_len}")
        return 2
    rng = random.Random(args.seed)
    vocab = cfg.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    forced = [[rng.randrange(3, vocab) for _ in range(args.batch)] for _ in range(args.steps)]

    gstats = getattr(graph.graphs, "stats", None)
    replayed: list[bool] = []
    seen = [getattr(gstats, "replays", 0)]

    def note_replay():  # did this decode step replay a captured graph?
        now = getattr(gstats, "replays", 0)
        replayed.append(now > seen[0])
        seen[0] = now

    g_pre, g_dec, g_facts = teacher_forced(graph.mgr, graph.plan, graph.run, prompts, forced, note_replay)
    e_pre, e_dec, e_facts = teacher_forced(eager.mgr, eager.plan, eager.run, prompts, forced)
    o_pre, o_dec, o_facts, ort_version = ort_arm_run(graph, model_dir, prompts, forced)

    pre_rel, pre_agree, ties, bad = compare(g_pre, o_pre, args.tol, "prefill")
    rels, agree = [], pre_agree
    for s, (g, o) in enumerate(zip(g_dec, o_dec)):
        rel, ok, t, b = compare(g, o, args.tol, s)
        rels.append(rel)
        agree += ok
        ties += t
        bad += b
    equal = [bool(torch.equal(g, e)) for g, e in zip(g_dec, e_dec)]
    diffs = [float((g.float() - e.float()).abs().max()) for g, e in zip(g_dec, e_dec)]
    max_rel = max([pre_rel] + rels)
    checks = {"logits_within_tol": max_rel <= args.tol, "greedy_same_except_near_ties": not bad,
              "graph_equals_eager": all(equal), "graph_replayed": any(replayed)}

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/_provenance.py
    from _provenance import versions

    ver = versions(("onnxruntime", "onnx", "triton", "pagedkit"))
    files = [p for p in model_dir.iterdir() if p.name.startswith(Path(cfg.filename).stem)]
    result = {
        "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
        "device_name": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": ver.get("pagedkit_commit"), "onnxruntime": ort_version, "versions": ver,
        "model": {"dir": str(model_dir), "num_layers": cfg.num_layers, "num_heads": cfg.num_heads,
                  "kv_num_heads": cfg.kv_num_heads, "head_size": cfg.head_size, "vocab_size": vocab,
                  "context_length": cfg.context_length, "block_size": graph.block_size,
                  "logits_dtype": str(g_pre.dtype), "weight_file_bytes": sum(p.stat().st_size for p in files),
                  "exported_from": str(args.make_model / "config.json") if made else None},
        "settings": {"batch": args.batch, "prompt_len": args.prompt_len, "steps": args.steps, "tol": args.tol,
                     "seed": args.seed, "teacher_forcing": "seeded random token stream, the same for every arm",
                     "reference": "onnxruntime CUDAExecutionProvider (its own KVCacheManager)"},
        "prefill_max_rel_diff": pre_rel,
        "per_step_max_rel_diff": rels, "max_rel_diff": max_rel,
        "greedy": {"agree": agree, "total": args.batch * (args.steps + 1), "near_ties": ties, "failures": bad},
        "graph": {"eager_mode": eager_mode, "stats": vars(gstats).copy() if gstats is not None else None,
                  "replayed_steps": [i for i, r in enumerate(replayed) if r],
                  "step0_plans": {"graph": g_facts, "eager": e_facts, "ort": o_facts},
                  "eager_inputs_equal_graph": g_facts == e_facts,
                  "equal_per_step": equal, "max_abs_diff_per_step": diffs},
        "graph_equals_eager": all(equal), "checks": checks, "passed": all(checks.values()),
    }
    if result["graph"]["stats"] is not None:
        result["graph"]["stats"]["keys"] = [list(k) for k in gstats.keys]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    failed = [k for k, v in checks.items() if not v]
    if failed:
        reasons = {"logits_within_tol": f"max rel diff {max_rel:.3g} > tol {args.tol}",
                   "greedy_same_except_near_ties": f"{len(bad)} argmax differences that are not near-ties",
                   "graph_equals_eager": f"graph != eager at decode steps {[i for i, e in enumerate(equal) if not e]}",
                   "graph_replayed": "no decode step was replayed as a CUDA graph"}
        print(f"engine_ort_parity: FAILED: {'; '.join(reasons[k] for k in failed)} (wrote {args.out})")
        return 1
    print(f"engine_ort_parity: passed: max rel diff {max_rel:.3g} <= {args.tol}, greedy {agree}/"
          f"{args.batch * (args.steps + 1)} ({len(ties)} near-ties), graph == eager on {len(equal)} steps "
          f"({sum(replayed)} replayed); wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
