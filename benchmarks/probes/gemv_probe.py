"""Probe (H100 / H200): the decode GEMV kernel (kernels/triton/linear.py, what PAGEDKIT_DECODE_LINEAR=1 runs) against
cuBLAS at a Llama-3.2-1B layer's decode products and its LM head, M = 1 and 8 rows.

1. A tile sweep per product: every (BLOCK_N, BLOCK_K, warps, stages) of the grid on W^T [N, K] against
   F.linear (cuBLAS) on the same W [N, K]; L2-cold (each timing cycles through enough weight copies to pass
   2.5x the L2); CUDA-graph replays; us, TB/s of weight bytes, the floor (bytes / --bandwidth), the error
   against cuBLAS (max |diff| / max |ref|).
2. A 16-layer chain of (QKV, O, gate | up, down) on fixed inputs: cuBLAS products alone (no norm / SiluMul
   launches: a lower bound of the unfused step's products) against the kernel with each product's best tiles,
   plain and with the step's folds (RMS norm + residual before QKV and gate | up, SiluMul before down), with
   the in-kernel L2 prefetch on and off. This is the probe that says whether the decode linear path can beat
   the products of benchmarks/results/linear_probe.json (H200: 0.70 ms a 16-layer chain at M 1, floor 0.44).

    PYTHONPATH=$PWD python3 benchmarks/probes/gemv_probe.py [--rows 1 8] [--bn 4 8 16 32] [--bk 256 512 1024]
        [--warps 4 8] [--stages 3 4] [--out FILE]
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python3 benchmarks/probes/gemv_probe.py --dry-run   # CPU: tiny shapes,
        every config against float64, no timing
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import itertools
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

LAYER = (("qkv", 2048, 3072), ("o", 2048, 2048), ("gate_up", 2048, 16384), ("down", 8192, 2048))
HEAD = ("lm_head", 2048, 128256)
DRY = (("qkv", 64, 96), ("down", 256, 64))  # --dry-run shapes (K, N)
FOLD = {"qkv": "rms", "o": "plain", "gate_up": "rms", "down": "silu"}  # the op folded into each product in a step


def _err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30))


def _call(lin, kind: str, x: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor, skip: torch.Tensor):
    if kind == "rms":
        return lin.linear("rms", x, w, skip=skip, gamma=gamma, want_sum=True)[0]
    return lin.linear(kind, x, w)[0]


def dry_run(args, lin) -> int:
    """Every config of the grid on tiny shapes, plain / rms / silu, against float64 loops: no timing."""
    torch.manual_seed(0)
    worst = 0.0
    for (name, k, n), m, cfg in itertools.product(DRY, args.rows, _grid(args)):
        lin.TILES.update({kind: cfg for kind in lin.KINDS})
        w = torch.randn(n, k, dtype=torch.float16) * 0.05
        x = torch.randn(m, k, dtype=torch.float16)
        ref = x.double() @ w.double().T
        worst = max(worst, _err(lin.linear("plain", x, w)[0], ref))
        a = torch.randn(m, 2 * k, dtype=torch.float16)
        h = (F.silu(a[:, :k].float()) * a[:, k:].float()).half()
        worst = max(worst, _err(lin.linear("silu", a, w)[0], h.double() @ w.double().T))
        skip, gamma = torch.randn(m, k, dtype=torch.float16), torch.rand(k, dtype=torch.float16) + 0.5
        s = x.float() + skip.float()
        normed = (s * torch.rsqrt(s.square().mean(-1, keepdim=True) + 1e-6) * gamma.float()).half()
        worst = max(worst, _err(_call(lin, "rms", x, w, gamma, skip), normed.double() @ w.double().T))
    print(f"dry run: {len(DRY) * len(args.rows) * len(_grid(args))} configs x 3 kinds, worst error {worst:.2e}")
    return 0 if worst < 2e-2 else 1


def _grid(args) -> list[tuple[int, int, int, int]]:
    return list(itertools.product(args.bn, args.bk, args.warps, args.stages))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "gemv_probe.json")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--bn", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--bk", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[3, 4])
    ap.add_argument("--bandwidth", type=float, default=4.4, help="TB/s of the floor (4.4: H200; H100 about 3.0)")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    lin = importlib.import_module("pagedkit.kernels.triton.linear")
    if args.dry_run:
        return dry_run(args, lin)
    time_graph = importlib.import_module("_timing").time_graph
    versions = importlib.import_module("_provenance").versions
    write_result = importlib.import_module("_provenance").write_result
    bw = args.bandwidth * 1e12
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    result = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(0),
              "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "versions": versions(),
              "l2_bytes": l2, "bandwidth_bytes_per_s": bw,
              "what": "us per product (CUDA-graph replays, L2-cold), TB/s of weight bytes; chains in ms",
              "products": [], "best": {}, "chains": []}
    lin.SHAPE_TILES.clear()  # the sweep sets TILES["plain"]; no shape override may mask it
    for (name, k, n), m in itertools.product((*LAYER, HEAD), args.rows):
        nbytes = k * n * 2
        copies = max(2, math.ceil(2.5 * l2 / nbytes))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02 for _ in range(copies)]
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        ref = F.linear(x, ws[0]).float()
        outs: list = []

        def run_blas():
            outs.clear()
            outs.extend(F.linear(x, w) for w in ws)
        blas_us = time_graph(run_blas, 10, 3) * 1000 / copies
        rows = [{"product": name, "k": k, "n": n, "m": m, "arm": "cublas", "us": blas_us,
                 "tb_s": nbytes / blas_us / 1e6, "floor_us": nbytes / bw * 1e6, "err": 0.0}]
        for cfg in _grid(args):
            lin.TILES["plain"] = cfg

            def run_tri():
                outs.clear()
                outs.extend(lin.linear("plain", x, w)[0] for w in ws)
            try:
                us = time_graph(run_tri, 10, 3) * 1000 / copies
                err = _err(lin.linear("plain", x, ws[0])[0].float(), ref)
            except Exception as exc:  # a config that does not compile / fit: recorded, not fatal
                rows.append({"product": name, "m": m, "arm": "triton", "tiles": cfg, "error": str(exc)[:200]})
                continue
            rows.append({"product": name, "k": k, "n": n, "m": m, "arm": "triton", "tiles": cfg, "us": us,
                         "tb_s": nbytes / us / 1e6, "floor_us": nbytes / bw * 1e6, "err": err})
        good = [r for r in rows if r["arm"] == "triton" and "us" in r and r["err"] < 1e-2]
        best = min(good, key=lambda r: r["us"]) if good else None
        result["products"] += rows
        result["best"][f"{name}/M{m}"] = best and {"tiles": best["tiles"], "us": best["us"], "cublas_us": blas_us}
        print(f"{name:8s} M{m:<2d} cuBLAS {blas_us:8.2f} us  best triton "
              + (f"{best['us']:8.2f} us {best['tiles']} ({best['tb_s']:.2f} TB/s)" if best else "none")
              + f"  floor {nbytes / bw * 1e6:.2f} us", flush=True)
        del ws
        torch.cuda.empty_cache()
        write_result(args.out, result)  # as it goes: a call cut at its time limit keeps what ran
    shapes = {}  # the SHAPE_TILES entries this run suggests: each product's best tiles at the most rows asked
    for (name, k, n) in (*LAYER, HEAD):
        best = result["best"].get(f"{name}/M{max(args.rows)}")
        if best and best["us"] < best["cublas_us"]:
            shapes[(FOLD.get(name, "plain") if name != "lm_head" else "plain", n, k)] = tuple(best["tiles"])
    result["suggested_shape_tiles"] = {f"{kd}/{n}x{k}": v for (kd, n, k), v in shapes.items()}
    print(f"SHAPE_TILES = {shapes!r}  # kernels/triton/linear.py (products where the kernel beat cuBLAS)", flush=True)
    for m in args.rows:
        layers = [[torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02 for _, k, n in LAYER]
                  for _ in range(16)]
        xs = {k: torch.randn(m, k, device="cuda", dtype=torch.float16) for k in (2048, 8192)}
        a_silu = torch.randn(m, 2 * 8192, device="cuda", dtype=torch.float16)
        skip = torch.randn(m, 2048, device="cuda", dtype=torch.float16)
        gamma = torch.rand(2048, device="cuda", dtype=torch.float16) + 0.5
        floor = 16 * sum(k * n * 2 for _, k, n in LAYER) / bw * 1e3

        def chain_blas():
            for ws in layers:
                for (_, k, _n), w in zip(LAYER, ws):
                    F.linear(xs[k], w)

        def chain_tri(fold: bool):
            def run():
                for ws in layers:
                    for (name, k, _n), w in zip(LAYER, ws):
                        kind = FOLD[name] if fold else "plain"
                        best = result["best"].get(f"{name}/M{m}")
                        if best:
                            lin.SHAPE_TILES[(kind, _n, k)] = tuple(best["tiles"])
                        x = a_silu if kind == "silu" else xs[k]
                        _call(lin, kind, x, w, gamma, skip)
            return run
        arms = [("cublas", chain_blas)]
        for fold, prefetch in itertools.product((False, True), (True, False)):
            arms.append((f"triton{'_fold' if fold else ''}{'' if prefetch else '_noprefetch'}",
                         (chain_tri(fold), prefetch)))
        for arm, fn in arms:
            if isinstance(fn, tuple):
                fn, lin.PREFETCH = fn
            ms = time_graph(fn, 10, 3)
            lin.PREFETCH = True
            result["chains"].append({"m": m, "arm": arm, "ms": ms, "floor_ms": floor})
            print(f"chain M{m:<2d} {arm:24s} {ms * 1000:8.1f} us (floor {floor * 1000:.1f})", flush=True)
            write_result(args.out, result)
        del layers
        torch.cuda.empty_cache()
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
