"""GPU profile of one engine decode step of an exported paged model: where the step's time goes.

    python benchmarks/step_profile.py MODEL_DIR [--rows 1x1024 8x4096 32x4096] [--sweep dedup 64x4 @6 ...]
                                      [--out FILE.json] [--top 25] [--device cuda|cpu]

For each row BATCHxCONTEXT: B requests of CONTEXT - 64 random prompt tokens are prefilled by an Engine
(CUDA graphs on, overlap off) until all decode, then
- sweep: the decode graph of that batch captured afresh under each setting (the defaults first, then each
  --sweep entry: the cache write with dedup, a decode tile / split waves for float caches set in-process,
  kernels/triton/decode.py DECODE_TILE / DECODE_WAVES) and timed as 50 back-to-back replays (CUDA events);
  each capture's plan is aborted, so the requests do not advance;
- replay_ms: the same for the defaults, captured last;
- step_ms: engine.step() with a synchronize each (median of 16; host planning included);
- kernels: one eager padded decode step (the plan the graph replays) under torch.profiler, the CUDA kernels
  grouped by name (calls, total us), largest first, and their sum (the plan is aborted afterwards).
Prints a table per row; --out writes the JSON. --device cpu is a smoke run (padded plans, no replays).
`step_profile.py --pick FILE.json` prints the PAGEDKIT_DECODE_TILE / _WAVES assignments of the swept setting
that beats the defaults by >= 2% on average with no row > 1% slower (nothing when none does).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _row(text: str) -> tuple[int, int]:
    b, c = (int(v) for v in text.lower().split("x", 1))
    if b < 1 or c <= 64:
        raise argparse.ArgumentTypeError(f"row {text!r}: BATCHxCONTEXT with batch >= 1 and context > 64 (the prompts "
                                         "are context - 64 tokens)")
    return b, c


def _config(text: str) -> dict:
    """A --sweep entry: "default", "dedup" (the cache write with its duplicate-slot handling, as without the
    engine's distinct-slots promise), or "+"-joined settings: "BNxNW" (decode tile: block_n x num_warps), "@W"
    (split waves), "sN" (software-pipeline stages of the decode attention), "pdl" (programmatic dependent launch
    of the Triton kernels, kernels/triton/common.PDL; "pdlN": only launches of <= N programs,
    PDL_MAX_PROGRAMS; "late": released as programs exit, "nopdl": off), "lt" / "nored" (cuBLAS through the cublasLt heuristics / without
    reduced-precision split-K reductions), "pfSPEC" / "nopf" (L2 prefetch of the products' weights,
    runtime/prefetch.py, SPEC as PAGEDKIT_L2_PREFETCH: "pf16:late", "pf8:early:line:d2"), and with
    PAGEDKIT_DECODE_LINEAR=1 "nolin" (its products on F.linear), "lnpf0" (no weight-slab prefetch),
    "lnBNxBKxWxS" (its tiles); "noroute" (MoE models: routing by torch instead of kernels/triton/moe_route.py);
    "BNxNW@W" is also accepted."""
    if text in ("default", "dedup"):
        return {"name": text}
    out = {"name": text}
    for part in text.split("+"):
        if part in ("lt", "nored"):  # cuBLAS: the cublasLt heuristics / no reduced-precision split-K reductions
            out[part] = True
            continue
        if part == "noroute":  # MoE: torch routing instead of the routing kernel
            out["noroute"] = True
            continue
        if part in ("nolin", "lnpf0"):  # decode_linear's products on F.linear / without the slab's L2 prefetch
            out[part] = True
            continue
        if part.startswith("ln") and part[2:3].isdigit():  # decode_linear tiles: lnBNxBKxWARPSxSTAGES
            out["linear_tile"] = tuple(int(v) for v in part[2:].split("x"))
            continue
        if part.startswith("pf") or part == "nopf":  # L2 prefetch (runtime/prefetch.py): pfMB[:early|late][:line][:dN]
            from pagedkit import settings

            out["prefetch"] = None if part == "nopf" else settings.parse_prefetch(part[2:])
            continue
        if part == "nopdl":
            out["pdl"] = False
            continue
        if part == "late":  # PDL's dependent launch released as programs exit
            out["pdl_late"] = True
            continue
        if part.startswith("pdl") and (part == "pdl" or part[3:].isdigit()):  # "pdlN": launches of <= N programs
            out["pdl"] = True
            out["pdl_max"] = int(part[3:] or 0)
            continue
        if part[:1] == "s" and part[1:].isdigit():
            out["stages"] = int(part[1:])
            continue
        tile, _, waves = part.partition("@")
        if tile:
            from pagedkit.kernels.triton.decode import parse_tile

            out["tile"] = parse_tile(tile)
        if waves:
            out["waves"] = float(waves)
    return out


_KNOBS = {"tile": ("DECODE_TILE", "PAGEDKIT_DECODE_TILE"), "waves": ("DECODE_WAVES", "PAGEDKIT_DECODE_WAVES"),
          "stages": ("DECODE_STAGES", "PAGEDKIT_DECODE_STAGES")}


@contextlib.contextmanager
def _applied(cfg: dict):
    from pagedkit.kernels import scope
    from pagedkit.kernels.triton import common, decode
    from pagedkit.runtime import prefetch

    from pagedkit.runtime.ops import linear as ops_linear

    saved_prefetch = prefetch.CONFIG
    if "prefetch" in cfg:
        prefetch.CONFIG = cfg["prefetch"]
    saved_linear = ops_linear.TRITON
    ops_linear.TRITON = not cfg.get("nolin")
    from pagedkit.runtime.ops import moe as ops_moe

    saved_route = ops_moe.ROUTE_KERNEL
    ops_moe.ROUTE_KERNEL = saved_route and not cfg.get("noroute")
    klin = None
    if common.HAVE_TRITON:
        from pagedkit.kernels.triton import linear as klin
    saved_ktiles = (dict(klin.TILES), klin.PREFETCH) if klin is not None else None
    if klin is not None:
        if cfg.get("linear_tile"):
            klin.TILES = {k: cfg["linear_tile"] for k in klin.TILES}
        klin.PREFETCH = not cfg.get("lnpf0")

    saved = ({k: getattr(decode, attr) for k, (attr, _) in _KNOBS.items()}, common.PDL, scope.distinct_slots,
             common.PDL_MAX_PROGRAMS, common.PDL_EARLY_RELEASE)
    for k, (attr, _) in _KNOBS.items():
        setattr(decode, attr, cfg.get(k))
    common.PDL = bool(cfg.get("pdl", saved[1]))
    common.PDL_MAX_PROGRAMS = cfg.get("pdl_max", saved[3])
    common.PDL_EARLY_RELEASE = not cfg.get("pdl_late", not saved[4])
    if cfg["name"] == "dedup":
        scope.distinct_slots = lambda: False
    import torch

    blas = torch.backends.cuda.preferred_blas_library()
    reduced = torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
    if cfg.get("lt"):
        torch.backends.cuda.preferred_blas_library("cublaslt")
    if cfg.get("nored"):
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    try:
        yield
    finally:
        prefetch.CONFIG = saved_prefetch
        ops_linear.TRITON = saved_linear
        ops_moe.ROUTE_KERNEL = saved_route
        if klin is not None:
            klin.TILES, klin.PREFETCH = saved_ktiles
        torch.backends.cuda.preferred_blas_library(blas)
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = reduced
        for k, (attr, _) in _KNOBS.items():
            setattr(decode, attr, saved[0][k])
        common.PDL, scope.distinct_slots, common.PDL_MAX_PROGRAMS, common.PDL_EARLY_RELEASE = saved[1:]


def profile_row(model_dir: Path, batch: int, context: int, top: int, seed: int = 0, device: str = "cuda",
                sweep: list[dict] | None = None) -> dict:
    import torch

    from pagedkit.engine import Engine, SamplingParams

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rng = random.Random(seed)
    prompt_len = context - 64
    from pagedkit.apps.bench.cli import _block_size
    from pagedkit.runtime.generate import read_config

    bs = _block_size(Path(model_dir), read_config(Path(model_dir)))  # the pool: the row's blocks of the model's size
    engine = Engine(model_dir, device, max_batch_size=batch, max_num_tokens=8192,
                    num_blocks=batch * (-(-context // bs) + 1), enable_prefix_caching=False, overlap=False,
                    cuda_graphs=None if cuda else "padded")
    vocab = engine.vocab_size or 1000
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([rng.randrange(vocab) for _ in range(prompt_len)], params)
    for _ in range(500):
        if len(engine.running) == batch and all(r.decoding for r in engine.running):
            break
        engine.step()
    else:
        raise RuntimeError(f"batch {batch} context {context}: the requests did not all reach decoding")
    graphs = engine.model.graphs
    batch_ids = [(r.request_id, [r.tokens[-1]]) for r in engine.running]
    key = graphs.key([(rid, 1) for rid, _ in batch_ids])
    ids = [t for _, (t,) in batch_ids]

    def capture():
        """The decode graph of this batch captured afresh (the current kernel settings); the plan is aborted."""
        graphs.graphs.clear()
        plan = graphs.plan(batch_ids)
        graphs.run(plan, ids)
        engine.kv.abort(plan)
        got = graphs.graphs.get(key)  # None on the CPU (padded plans run eagerly)
        return got.graph if got is not None else None

    def replay_ms(g) -> float:
        for _ in range(5):
            g.replay()
        sync()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(50):
            g.replay()
        e1.record()
        sync()
        return e0.elapsed_time(e1) / 50

    swept = []
    for cfg in [{"name": "default"}] + [c for c in (sweep or []) if c["name"] != "default"]:
        with _applied(cfg):
            g = capture()
            swept.append({"config": cfg["name"], "replay_ms": round(replay_ms(g), 4) if cuda else None})
    g = capture()  # the defaults again
    base = replay_ms(g) if cuda else None
    steps = []
    for _ in range(16):
        s = time.perf_counter()
        engine.step()
        sync()
        steps.append((time.perf_counter() - s) * 1e3)
    # one eager padded step under the profiler (the plan the graph replays; aborted afterwards)
    batch_ids = [(r.request_id, [r.tokens[-1]]) for r in engine.running]
    plan = graphs.plan(batch_ids)
    feeds = engine.model.feeds(plan, [t for _, (t,) in batch_ids] + [0] * (key[0] - len(batch_ids)))
    engine.model.forward(feeds, plan.hint)
    sync()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        engine.model.forward(feeds, plan.hint)
        sync()
    graphs.abort(plan)
    engine.kv.abort(plan)
    kernels: dict[str, list[float]] = {}
    for row in prof.key_averages():
        us = getattr(row, "self_device_time_total", None)
        if us is None:
            us = getattr(row, "self_cuda_time_total", 0.0)
        if not cuda:
            us = row.self_cpu_time_total
        if us > 0:
            kernels[row.key] = [row.count, us]
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])
    total_us = sum(v[1] for v in kernels.values())
    for r in list(engine.running):
        engine.abort(r.request_id)
    while engine.has_unfinished():
        engine.step()
    engine = graphs = g = None  # drop the engine (its pool and graphs) before the next row
    if cuda:
        torch.cuda.empty_cache()
    return {"batch": batch, "context": context, "prompt_tokens": prompt_len, "graph_key": list(key),
            "replay_ms": base, "step_ms": statistics.median(steps), "kernel_us": total_us,
            "kernel_launches": sum(v[0] for v in kernels.values()), "sweep": swept,
            "kernels": [{"name": n[:160], "calls": v[0], "us": round(v[1], 2)} for n, v in ranked[:top]]}


def result_record(argv: list[str], device: str, rows: list[dict]) -> dict:
    """The JSON --out writes: provenance, then the rows. A profile has no peer arm and no floor of its own:
    paged-bench measures the same steps against onnxruntime-gpu and the bandwidth floor."""
    import datetime

    import torch

    from pagedkit.apps.bench import report

    return {"command": "python benchmarks/step_profile.py " + " ".join(argv), "device": device,
            "device_name": report.device_name(device),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "pagedkit_commit": report.pagedkit_commit(), "env": report.settings_env(), "torch": torch.__version__,
            "note": "a profile: graph replays of one decode step per setting, no peer arm or floor (paged-bench "
                    "has both for the same model)", "rows": rows}


def _rows_of(data) -> list[dict]:
    return data["rows"] if isinstance(data, dict) else data


def pick(records: list[dict], min_gain: float = 0.02, max_loss: float = 0.01) -> dict[str, str]:
    """The PAGEDKIT_DECODE_TILE / _WAVES environment of the swept tile / waves setting with the best mean replay
    time relative to the defaults over the rows: at least min_gain faster on average, no row more than max_loss
    slower; {} when none is (the defaults stay)."""
    best, best_gain = None, min_gain
    names = [sw["config"] for sw in records[0]["sweep"]] if records else []
    for name in names:
        cfg = _config(name)
        if not any(k in cfg for k in (*_KNOBS, "pdl")):
            continue
        ratios = []
        for rec in records:
            times = {sw["config"]: sw["replay_ms"] for sw in rec["sweep"]}
            if times.get(name) is None or not times.get("default"):
                break
            ratios.append(times[name] / times["default"])
        else:
            gain = 1 - sum(ratios) / len(ratios)
            if ratios and gain >= best_gain and max(ratios) <= 1 + max_loss:
                best, best_gain = cfg, gain
    env = {}
    if best is not None:
        for k, (_, var) in _KNOBS.items():
            if k in best:
                env[var] = "x".join(str(v) for v in best[k]) if k == "tile" else str(best[k])
        if best.get("pdl") is False:
            env["PAGEDKIT_PDL"] = "0"
        if best.get("pdl"):
            env["PAGEDKIT_PDL"] = "1"
            if best.get("pdl_late"):
                env["PAGEDKIT_PDL_LATE"] = "1"
            if best.get("pdl_max"):
                env["PAGEDKIT_PDL_MAX_PROGRAMS"] = str(best["pdl_max"])
    return env


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--pick"]:  # step_profile.py --pick FILE.json: the best swept knobs as shell assignments
        env = pick(_rows_of(json.loads(Path(argv[1]).read_text())))
        print(" ".join(f"{k}={v}" for k, v in env.items()))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--rows", nargs="+", type=_row, default=[(1, 1024), (8, 4096), (32, 4096)])
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--sweep", nargs="*", type=_config, default=[],
                    help="decode settings to time as graph replays besides the defaults: dedup, BNxNW, @WAVES, "
                         "BNxNW@WAVES (CUDA only)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run (no replay timing)")
    args = ap.parse_args(argv)
    argv = list(argv)
    out = []
    for b, c in args.rows:
        rec = profile_row(args.model_dir, b, c, args.top, device=args.device, sweep=args.sweep)
        out.append(rec)
        replay = "-" if rec["replay_ms"] is None else f"{rec['replay_ms']:.3f}"
        print(f"== batch {b} context {c}: replay {replay} ms, synced step {rec['step_ms']:.3f} ms, "
              f"{rec['kernel_launches']} kernels {rec['kernel_us'] / 1e3:.3f} ms")
        for sw in rec["sweep"]:
            print(f"  sweep {sw['config']:>14}: replay {sw['replay_ms']} ms")
        for k in rec["kernels"]:
            print(f"  {k['us']:9.1f} us {k['calls']:4d}x  {k['name'][:110]}")
    if args.out:
        args.out.write_text(json.dumps(result_record(argv, args.device, out), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
