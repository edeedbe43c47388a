"""Where an overlapped engine decode step's time goes (H200 probe for issue 14).

    python benchmarks/engine_timeline.py MODEL_DIR [--rows 1x1024 8x1024 ...] [--steps 32] [--out FILE.json]
                                         [--trace DIR]

For each row BATCHxCONTEXT, one Engine (CUDA graphs, overlap on, as paged-bench runs it) prefills B random
prompts, then times `--steps` overlapped engine.step() calls, splitting each into host work and the time the
host waits for the in-flight step's tokens (Inflight.tokens); then times the decode graph alone (50 replays,
CUDA events). With --trace, 8 more steps run under torch.profiler: the GPU work per step (kernels, copies,
memsets, inside and outside the graph), the device's idle time between them, and the chrome trace.

A wait near zero means the host bounds the step; step - replay is the work outside the graph plus idle time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pagedkit.apps.bench import engine_arm  # noqa: E402
from pagedkit.engine import Engine, SamplingParams  # noqa: E402
from pagedkit.engine import overlap as ov  # noqa: E402

WAITS: list[float] = []
_tokens = ov.Inflight.tokens


def _timed_tokens(self):
    t = time.perf_counter()
    out = _tokens(self)
    WAITS.append(time.perf_counter() - t)
    return out


ov.Inflight.tokens = _timed_tokens


def _row(text: str) -> tuple[int, int]:
    b, c = (int(v) for v in text.lower().split("x", 1))
    return b, c


def gpu_summary(prof, steps: int) -> dict:
    """GPU events of the profiled window: busy union, span, and the work per step grouped by name."""
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in evs)
    if not spans:
        return {}
    busy, cur_s, cur_e = 0.0, spans[0][0], spans[0][1]
    for s, e, _ in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = spans[-1][1] - spans[0][0]
    names: dict[str, list] = {}
    for s, e, n in spans:
        names.setdefault(n[:90], []).append(e - s)
    top = sorted(((sum(v), len(v), k) for k, v in names.items()), reverse=True)
    return {"span_us_per_step": span / steps, "busy_us_per_step": busy / steps, "events_per_step": len(spans) / steps,
            "by_name": [{"name": k, "calls_per_step": c / steps, "us_per_step": t / steps} for t, c, k in top[:40]]}


def run_row(model_dir: Path, b: int, ctx: int, steps: int, trace: Path | None) -> dict:
    budget = min(16384, b * (ctx - steps))
    row = engine_arm.with_headroom(engine_arm.Row(b, ctx, steps + 8 + 8), budget, lookahead=1)
    blocks = engine_arm.blocks_needed(row, budget, 131072, 256)
    eng = Engine(model_dir, "cuda", max_batch_size=b, max_num_tokens=budget, num_blocks=blocks + b,
                 enable_prefix_caching=False, overlap=True)
    prompts = engine_arm.prompts_for(row, 1000, 0)
    params = SamplingParams(max_new_tokens=row.decode_steps + 40, ignore_eos=True)
    for p in prompts:
        eng.add_request(p, params)
    n = 0
    while eng.model.graphs.stats.replays < 3:  # prefill, then a few decode steps (capture)
        eng.step()
        n += 1
        if n > 200:
            raise RuntimeError("no decode replays")
    torch.cuda.synchronize()
    WAITS.clear()
    walls = []
    for _ in range(steps):
        s = time.perf_counter()
        eng.step()
        walls.append(time.perf_counter() - s)
    waits = list(WAITS)
    rec = {"batch": b, "context": ctx, "steps": steps, "overlapped": eng.stats.overlapped_steps,
           "step_ms_median": statistics.median(walls) * 1e3, "step_ms_mean": statistics.mean(walls) * 1e3,
           "wait_ms_median": statistics.median(waits) * 1e3 if waits else None,
           "host_ms_median": statistics.median([w - x for w, x in zip(walls, waits)]) * 1e3 if waits else None}
    if trace is not None:
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(8):
                eng.step()
            torch.cuda.synchronize()
        rec["gpu"] = gpu_summary(prof, 8)
        trace.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace / f"trace_b{b}_c{ctx}.json"))
    graphs = eng.model.graphs
    key = graphs.stats.keys[-1]
    g = graphs.graphs[key].graph
    torch.cuda.synchronize()
    a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(50):
        g.replay()
    z.record()
    torch.cuda.synchronize()
    rec["replay_ms"] = a.elapsed_time(z) / 50
    rec["graph_key"] = list(key)
    del eng
    torch.cuda.empty_cache()
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--rows", nargs="*", type=_row, default=[(1, 1024), (8, 1024), (1, 4096), (8, 4096)])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--trace", type=Path)
    args = ap.parse_args()
    rows = []
    for b, c in args.rows:
        rec = run_row(args.model_dir, b, c, args.steps, args.trace)
        rows.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k != "gpu"}), flush=True)
        if "gpu" in rec:
            gsum = rec["gpu"]
            print(f"  gpu span/step {gsum['span_us_per_step']:.1f} us, busy {gsum['busy_us_per_step']:.1f} us, "
                  f"{gsum['events_per_step']:.0f} events/step", flush=True)
            for x in gsum["by_name"][:25]:
                print(f"    {x['us_per_step']:8.1f} us  {x['calls_per_step']:5.1f}x  {x['name']}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
