"""`paged-bench`: end-to-end decode tokens/s and time to first token of a model folder, pagedkit's engine
against onnxruntime (CUDA EP, the same ONNX file) and against the bandwidth floor.

    paged-bench MODEL_DIR [--batches 1 8 32] [--contexts 1024 4096] [--decode-steps 32]
                          [--device cpu|cuda] [--arms pagedkit ort] [--out DIR] [--warmup 1] [--seed 0]

Each (batch B, context C) row: B random prompts of C - decode_steps tokens, prefilled together (TTFT),
then decode_steps greedy decode steps timed (ms per step, tokens/s); at the last one each sequence has C
cached tokens. The floor: (weight bytes + B x C x KV bytes per token) / bandwidth (default 4.4 TB/s).
Rows whose context exceeds the model's context_length are skipped with the reason; an arm that cannot
run (the ORT arm without CUDA, or a model ORT refuses) is skipped with a one-line reason. Writes
DIR/paged_bench.json and DIR/paged_bench.png. Exit status: 0 ok, 2 bad arguments or model (one line on
stderr, no traceback). See docs/bench.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import statistics
import sys
from pathlib import Path

from ...cli_errors import cli_main, folder_problem, one_line
from . import engine_arm, floor, genai_arm, ort_arm, report

PROG = "paged-bench"
ARMS = ("pagedkit", "ort", "genai")
DEFAULT_ARMS = ("pagedkit", "ort")
# default step budget cap: a 32 x 4096-token prefill in one step would need [131k, vocab] logits
DEFAULT_MAX_NUM_TOKENS = 16384


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", help="folder with model.onnx and genai_config.json (paged layout)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="batch sizes (default 1 8 32)")
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096],
                   help="cached tokens per sequence at the last decode step (default 1024 4096)")
    p.add_argument("--decode-steps", type=int, default=32, help="timed decode steps after the prefill (default 32)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda if available, else cpu")
    p.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS),
                   help="what to run: pagedkit, ort (onnxruntime, its CUDA EP), genai (onnxruntime-genai's Engine); "
                        "default pagedkit ort")
    p.add_argument("--out", default="paged_bench", help="output folder (default ./paged_bench)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs of each row before the timed one (default 1)")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs of each row per arm, the arms interleaved (pagedkit, ort, pagedkit, ...); the "
                        "row reports tokens / total time and the median step over all of them (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    p.add_argument("--max-num-tokens", type=int,
                   help="token budget of one step, both arms (default: the largest batch x prompt, at most "
                        f"{DEFAULT_MAX_NUM_TOKENS}; a larger prefill is chunked over steps)")
    p.add_argument("--bandwidth", type=float, default=floor.DEFAULT_BANDWIDTH / 1e12,
                   help="read bandwidth of the floor in TB/s (default 4.4)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--tp", type=int, metavar="N",
                   help="a tensor-parallel export (paged-export --tp N) on N ranks started here (pagedkit arm only: "
                        "onnxruntime has no collective kernels; the floor is rank 0's weights and KV cache)")
    p.add_argument("--no-ort-cuda-graph", action="store_true",
                   help="run onnxruntime without its CUDA graph (default: enable_cuda_graph=1 for decode steps, "
                        "plain runs where onnxruntime refuses it)")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="run the engine's decode steps eagerly (default on CUDA: CUDA-graph replays)")
    p.add_argument("--no-overlap", action="store_true",
                   help="the engine waits for each decode step's tokens before planning the next (default with "
                        "CUDA graphs: decode steps run one step ahead of the host)")
    return p


def _check_args(args) -> str | None:
    for name in ("batches", "contexts"):
        bad = [v for v in getattr(args, name) if v < 1]
        if bad:
            return f"--{name}: expected integers >= 1, got {bad[0]}"
    for name, low in (("decode_steps", 1), ("warmup", 0), ("repeats", 1), ("seed", 0), ("max_num_tokens", 1)):
        v = getattr(args, name)
        if v is not None and v < low:
            return f"--{name.replace('_', '-')}: expected an integer >= {low}, got {v}"
    bad = [a for a in args.arms if a not in ARMS]
    if bad:
        return f"--arms: expected some of {' '.join(ARMS)}, got {bad[0]!r}"
    if not args.bandwidth > 0:
        return f"--bandwidth: expected a number of TB/s > 0, got {args.bandwidth}"
    return None


def _device(choice: str | None) -> str:
    import torch

    if choice is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available on this machine (use --device cpu)")
    return choice


def _plan_rows(args, max_seq_len: int) -> tuple[list[engine_arm.Row], list[dict]]:
    """The rows to measure, and the skipped ones with their reason."""
    rows, skipped = [], []
    for ctx in args.contexts:
        for b in args.batches:
            why = None
            if ctx > max_seq_len:
                why = f"context {ctx} exceeds the model's context_length {max_seq_len}"
            elif ctx <= args.decode_steps:
                why = f"context {ctx} leaves no prompt token before {args.decode_steps} decode steps (--decode-steps)"
            if why:
                skipped.append({"batch": b, "context": ctx, "skipped": why})
            else:
                rows.append(engine_arm.Row(b, ctx, args.decode_steps))
    return rows, skipped


def _model_summary(model_dir: Path, cfg, model_path: Path, weights: int, layers, pm) -> dict:
    specs = [s for g in pm.groups.values() for s in g.layers]
    return {"name": model_dir.resolve().name, "path": str(model_dir), "file": str(model_path),
            "layers": cfg.num_layers, "heads": cfg.num_heads, "kv_heads": cfg.kv_num_heads,
            "head_size": cfg.head_size, "vocab_size": cfg.vocab_size, "context_length": cfg.context_length,
            "dtype": cfg.pagedkit.get("dtype"), "cache_dtypes": sorted({s.cache_dtype for s in specs}),
            "latent_layers": sum(1 for s in specs if s.latent), "windowed_layers": len(cfg.windowed_layers),
            "block_size": pm.block_size, "weight_bytes": weights,
            "kv_bytes_per_token": sum(c.bytes_per_token for c in layers)}


@cli_main(PROG)
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    model_dir = Path(args.model_dir)
    problem = _check_args(args) or folder_problem(model_dir, "model.onnx and genai_config.json")
    if problem:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 2
    from ...interface.paths import inside_folder
    from ...runtime.generate import read_config

    cfg = read_config(model_dir)
    model_path = Path(inside_folder(model_dir, cfg.filename, "model.decoder.filename",
                                    str(model_dir / "genai_config.json")))
    if not model_path.is_file():
        print(f"{PROG}: error: MODEL_DIR {model_dir}: no {cfg.filename} (expected a model folder with model.onnx "
              "and genai_config.json)", file=sys.stderr)
        return 2
    device = _device(args.device)
    rows, skipped = _plan_rows(args, cfg.context_length)
    arms = [a for a in ARMS if a in args.arms]
    result = _run(args, model_dir, cfg, model_path, device, rows, skipped, arms)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "paged_bench.json").write_text(json.dumps(result, indent=2) + "\n")
    for line in report.table(result):
        print(line)
    why = report.plot(result, out / "paged_bench.png")
    if why:
        print(f"{PROG}: {why}", file=sys.stderr)
    print(f"{PROG}: wrote {out / 'paged_bench.json'}" + ("" if why else f" and {out / 'paged_bench.png'}"))
    return 0


def _run(args, model_dir, cfg, model_path, device, rows, skipped, arms) -> dict:
    from ...engine import Engine

    from ...runtime.distributed import world_size_of

    budget = args.max_num_tokens or min(DEFAULT_MAX_NUM_TOKENS, max([r.batch * r.prompt_tokens for r in rows] or [1]))
    tp_set = (args.tp or world_size_of(model_dir)) > 1  # eager steps; onnxruntime has no collective kernels
    no_graphs = args.no_cuda_graphs or tp_set
    overlap = device == "cuda" and not no_graphs and not args.no_overlap  # needs the engine's graphs
    if tp_set:
        arms = [a for a in arms if a != "ort"]
    rows = [engine_arm.with_headroom(r, budget, lookahead=int(overlap)) for r in rows]
    bs = _block_size(model_dir, cfg)
    blocks = max([engine_arm.blocks_needed(r, budget, cfg.context_length, bs) for r in rows] or [1])
    engine = Engine(model_dir, device, max_batch_size=max([r.batch for r in rows] or [1]), max_num_tokens=budget,
                    num_blocks=blocks, enable_prefix_caching=False, cuda_graphs=False if no_graphs else None,
                    overlap=overlap, tp=args.tp)
    graphs = engine.model.graphs is not None and engine.model.graphs.capture
    pm = engine.model
    weights = floor.weight_bytes(model_path)
    experts = floor.expert_bytes(model_path)  # MoE: the floor counts the experts a step touches
    products = floor.product_weights(model_path)
    layers = floor.cache_layers(pm.groups.values())
    bandwidth = args.bandwidth * 1e12
    ort_reason, runner = None, None
    if "ort" in arms:
        ort_reason = ort_arm.unavailable(device)
        if ort_reason is None:
            graph_refused = None
            for graph in ([True, False] if not args.no_ort_cuda_graph else [False]):
                try:
                    runner = ort_arm.OrtRunner(str(model_path), ort_arm.host_input_names(pm), cuda_graph=graph)
                    ort_reason = None
                    break
                except Exception as exc:  # onnxruntime refuses the model (an op or input it lacks, ...)
                    why = f"{type(exc).__name__}: {one_line(str(exc))}"[:600]
                    ort_reason = f"onnxruntime refused the model: {why}"
                    graph_refused = graph_refused or (why if graph else None)
            if runner is not None and graph_refused:
                runner.graph_refused = f"at session creation: {graph_refused}"
        if ort_reason:
            print(f"{PROG}: ort arm skipped: {ort_reason}", file=sys.stderr)
    genai_reason, genai_runner = (None, None) if "genai" in arms else ("not asked (--arms)", None)
    if "genai" in arms:
        genai_reason = genai_arm.unavailable(device)
        if genai_reason is None:
            try:
                genai_runner = genai_arm.GenaiRunner(str(model_dir), device)
            except Exception as exc:  # onnxruntime-genai refuses the model (an op its providers lack, ...)
                genai_reason = f"onnxruntime-genai refused the model: {type(exc).__name__}: {one_line(str(exc))}"[:600]
        if genai_reason:
            print(f"{PROG}: genai arm skipped: {genai_reason}", file=sys.stderr)
    vocab = cfg.vocab_size or 3
    versions = report.versions()
    result = {
        "command": " ".join(shlex.quote(a) for a in [PROG, *args.argv]),
        "device": device, "device_name": report.device_name(device),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions, "pagedkit_commit": report.pagedkit_commit(),
        "env": report.settings_env(),
        "model": _model_summary(model_dir, cfg, model_path, weights, layers, pm),
        "settings": {"batches": args.batches, "contexts": args.contexts, "decode_steps": args.decode_steps,
                     "warmup": args.warmup, "repeats": args.repeats, "seed": args.seed, "arms": arms, "max_num_tokens": budget,
                     "num_blocks": blocks, "bandwidth_bytes_per_s": bandwidth,
                     "prompt_tokens": ("context - decode_steps - headroom (the steps of a chunked prefill, plus the engine's "
                                       "one step of lookahead with overlap)"), "cuda_graphs": graphs,
                     "overlap": overlap,
                     "prefix_caching": False},
        "arms": {"pagedkit": {"ran": "pagedkit" in arms, "cuda_graphs": graphs,
                              "note": ("decode steps are CUDA-graph replays, one graph per (batch bucket, KV bucket), "
                                       "captured at a key's first step (in the warm-up)") if graphs else
                              "the engine runs eagerly"},
                 "ort": {"ran": runner is not None, "skipped": ort_reason if "ort" in arms else "not asked (--arms)",
                         "cuda_graph": bool(runner is not None and runner.cuda_graph),
                         "version": runner.version if runner else versions["onnxruntime"]},
                 "genai": ({"ran": True, "version": genai_runner.version} if genai_runner is not None
                           else {"ran": False, "skipped": genai_reason})},
        "rows": [],
    }
    if runner is not None:
        result["arms"]["ort"].pop("skipped")
    progress = _progress(len(rows) * max(1, len(arms)) * args.repeats, args.no_progress)
    measured = {}
    for i, row in enumerate(rows):
        rec = {"batch": row.batch, "context": row.context, "prompt_tokens": row.prompt_tokens, "headroom": row.headroom,
               "decode_steps": row.decode_steps,
               "floor": floor.floor_row(weights, layers, row.batch, row.context, bandwidth),
               "prefill_floor": floor.prefill_floor(weights, products, layers, cfg.num_heads, cfg.head_size, row.batch,
                                                    row.prompt_tokens, bandwidth), "arms": {}}
        runs: dict[str, list[dict]] = {arm: [] for arm in arms}
        for k in range(args.repeats):  # the arms interleaved, so slow drifts of the device hit both alike
            for arm in arms:
                progress.set_description(f"{arm} batch {row.batch} context {row.context}")
                if not runs[arm] or "skipped" not in runs[arm][0]:
                    runs[arm].append(_arm(arm, engine, {"ort": (runner, ort_reason), "genai": (genai_runner, genai_reason)},
                                          row, vocab, args, device, warm=k == 0, routes=bool(experts) and k == 0))
                progress.update(1)
        for arm in arms:
            rec["arms"][arm] = _combine(runs[arm])
        if experts:
            _moe_floor(rec, weights, experts, layers, row, bandwidth)
        if "tokens" in rec["arms"].get("pagedkit", {}) and "tokens" in rec["arms"].get("ort", {}):
            rec["parity"] = ort_arm.parity(rec["arms"]["pagedkit"]["tokens"], rec["arms"]["ort"]["tokens"],
                                           row.decode_steps)
        if "tokens" in rec["arms"].get("pagedkit", {}) and "tokens" in rec["arms"].get("genai", {}):
            rec["parity_genai"] = ort_arm.parity(rec["arms"]["pagedkit"]["tokens"], rec["arms"]["genai"]["tokens"],
                                                 row.decode_steps)
        for a in rec["arms"].values():
            a.pop("tokens", None)
        measured[(row.batch, row.context)] = report.finish_row(rec)
    progress.close()
    order = {(b, c): None for c in args.contexts for b in args.batches}
    skipped_by = {(s["batch"], s["context"]): s for s in skipped}
    result["rows"] = [measured.get(k) or skipped_by[k] for k in order]
    return result


def _moe_floor(rec: dict, weights: int, experts: dict, layers, row, bandwidth: float) -> None:
    """A MoE model's decode floor from the experts the pagedkit arm's decode steps touched (floor.py); without
    that record (the arm skipped or no decode step logged) the floor keeps every expert, and says so."""
    touched = rec["arms"].get("pagedkit", {}).pop("experts_touched", None)
    if not touched:
        rec["floor"]["experts_touched"] = "not measured: every expert's bytes counted"
        return
    read = floor.weights_read(weights, experts, touched)
    rec["floor"] = floor.floor_row(read, layers, row.batch, row.context, bandwidth)
    rec["floor"]["weight_bytes_all"] = weights
    rec["floor"]["experts_touched"] = {
        "mean_per_node": sum(touched.values()) / len(touched), "num_experts": max(e for _, e in experts.values()),
        "nodes": len(touched), "expert_bytes_all": sum(b for b, _ in experts.values()),
        "note": "distinct experts the real rows of a decode step chose, mean over the eager decode steps of the "
                "warm-up (the first step of each graph key), per MoE node"}


def _combine(runs: list[dict]) -> dict:
    """One arm's record over its repeats: the first run's record, with tokens_per_s = all decode tokens / all
    timed time, ms_per_step and ttft_ms (ttft_first_ms, run_ms) = the medians over the runs, and each run's
    figures in `repeats`."""
    first = runs[0]
    if len(runs) == 1 or any("skipped" in r for r in runs):
        return next((r for r in runs if "skipped" in r), first)
    total_s = sum(r["decode_tokens"] / r["tokens_per_s"] for r in runs)
    out = dict(first)
    out["decode_tokens"] = sum(r["decode_tokens"] for r in runs)
    out["tokens_per_s"] = out["decode_tokens"] / total_s
    out["ms_per_step"] = statistics.median(r["ms_per_step"] for r in runs)
    out["ms_per_step_mean"] = statistics.mean(r["ms_per_step_mean"] for r in runs)
    for k in ("ttft_ms", "ttft_first_ms"):  # not the first run's alone: a one-time cost there is not the TTFT
        if k in first:
            out[k] = statistics.median(r[k] for r in runs)
    keys = ("ms_per_step", "tokens_per_s", "ttft_ms") + (("run_ms",) if "run_ms" in first else ())
    out["repeats"] = [{k: r[k] for k in keys} for r in runs]
    if "run_ms" in first:
        out["run_ms"] = statistics.median(r["run_ms"] for r in runs)
    return out


def _arm(arm, engine, peers: dict, row, vocab, args, device, warm: bool = True, routes: bool = False) -> dict:
    """One arm's record of one row (warm: after args.warmup untimed runs). peers: arm -> (runner, why not).
    routes (pagedkit, a MoE model): the experts its first run's eager decode steps chose are recorded
    (experts_touched, for the floor)."""
    from ...runtime.ops import moe

    runner, why = peers.get(arm, (None, None))
    if arm != "pagedkit" and runner is None:
        return {"skipped": why}
    touched = None
    for rep in range(args.warmup + 1 if warm else 1):
        prompts = engine_arm.prompts_for(row, vocab, args.seed * 1_000_003 + rep)
        try:
            if arm == "pagedkit" and routes and rep == 0:  # untimed when args.warmup >= 1
                moe.ROUTE_LOG = {}
                try:
                    rec = engine_arm.run_row(engine, row, prompts, device)
                finally:
                    log, moe.ROUTE_LOG = moe.ROUTE_LOG, None
                graphs = engine.model.graphs  # a decode step runs the batch's rows, or its padded bucket's
                sizes = {row.batch, graphs.batch_bucket(row.batch) if graphs is not None else None} - {None}
                touched = floor.touched_experts(log, row.batch, sizes)
            elif arm == "pagedkit":
                rec = engine_arm.run_row(engine, row, prompts, device)
            elif arm == "genai":
                rec = runner.run_row(row, prompts)
            else:
                rec = ort_arm.run_row(engine.model, runner, row, prompts, device)
        except Exception as exc:  # the arm fails on this row (e.g. ORT refuses an input at run time): say so
            if arm == "pagedkit" and not isinstance(exc, RuntimeError):
                raise
            return {"skipped": f"failed: {type(exc).__name__}: {one_line(str(exc))}"[:600]}
    rec["warmup_runs"] = args.warmup if warm else 0
    if touched:
        rec["experts_touched"] = touched
    return rec


def _block_size(model_dir, cfg) -> int:
    """The block size the engine will use (generate.resolve_block_size over the ONNX inputs, no session)."""
    import onnx

    from ...interface import names as N
    from ...runtime.generate import resolve_block_size

    model = onnx.load(str(model_dir / cfg.filename), load_external_data=False)
    key0 = cfg.name(N.past_names_key("key"), 0)
    dims = next(([d.dim_value if d.HasField("dim_value") else d.dim_param for d in i.type.tensor_type.shape.dim]
                 for i in model.graph.input if i.name == key0), [])
    return resolve_block_size(cfg, dims)


def _progress(total: int, off: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=PROG, unit="run", file=sys.stderr, disable=off)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
