"""H200 probe of the skinny decode product (kernels/triton/skinny.py) against cuBLAS at Llama-3.2-1B decode
shapes: per (M, K, N) a CUDA graph of `chain` rounds, each an RMS norm (the Triton kernel a product follows in a
decode step) then the product on its own weight copy (rotating copies: L2-cold, as in a step). Arms: cuBLAS
F.linear on W [N, K]; the skinny kernel at each tile of the sweep, with programmatic dependent launch off / on.
Prints us per (norm + product) round and the best tile per shape; --out writes JSON.

    python benchmarks/skinny_probe.py [--out FILE.json] [--quick]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import _timing  # noqa: E402
from pagedkit.kernels.triton import common, norm, skinny  # noqa: E402

SHAPES = [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048), (2048, 128256)]


def probe(m: int, k: int, n: int, tiles, chain: int = 8) -> dict:
    copies = max(2, min(chain, (256 << 20) // (k * n * 2)))
    ws = [(torch.randn(n, k, device="cuda") / k ** 0.5).half() for _ in range(copies)]
    x = torch.randn(m, k, dtype=torch.float16, device="cuda")
    gamma = torch.ones(k, dtype=torch.float16, device="cuda")
    ref = F.linear(x, ws[0]).float()

    def run(product):
        def fn():
            for i in range(chain):
                h, _ = norm.rms_norm(x, gamma, 1e-5)
                product(h, ws[i % copies])
        return _timing.time_graph(fn, reps=10, batches=5) * 1e3 / chain

    norm_only = _timing.time_graph(lambda: [norm.rms_norm(x, gamma, 1e-5) for _ in range(chain)],
                                   reps=10, batches=5) * 1e3 / chain
    out = {"copies": copies, "norm_us": norm_only, "cublas_us": run(lambda h, w: F.linear(h, w)), "skinny": []}
    for pdl in (False, True):
        common.PDL = pdl
        out["cublas_pdl_norm_us" if pdl else "cublas_us"] = run(lambda h, w: F.linear(h, w))
        for tile in tiles:
            try:
                err = float((skinny.skinny_matmul(x, ws[0], tile).float() - ref).abs().max() / ref.abs().max())
                us = run(lambda h, w, t=tile: skinny.skinny_matmul(h, w, t))
            except Exception as exc:  # a tile the compiler refuses (shared memory): recorded, not fatal
                out["skinny"].append({"tile": tile, "pdl": pdl, "error": type(exc).__name__})
                continue
            out["skinny"].append({"tile": tile, "pdl": pdl, "us": us, "err": err})
    common.PDL = False
    ok = [r for r in out["skinny"] if "us" in r]
    for pdl in (False, True):
        best = min((r for r in ok if r["pdl"] == pdl), key=lambda r: r["us"], default=None)
        out["best_pdl" if pdl else "best"] = best
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    args = ap.parse_args()
    if args.quick:
        tiles = [(16, 512, 1, 4), (16, 512, 3, 4), (32, 512, 3, 4), (16, 256, 4, 4)]
    else:
        tiles = [(16, 512, 1, 4), (16, 512, 3, 4), (16, 256, 4, 4), (16, 1024, 2, 8), (32, 512, 1, 4),
                 (32, 512, 3, 4), (32, 256, 4, 4), (64, 256, 3, 4)]
    res = {}
    for m in args.rows:
        for k, n in SHAPES:
            r = probe(m, k, n, tiles)
            key = f"M{m}_K{k}_N{n}"
            res[key] = r
            b, bp = r["best"], r["best_pdl"]
            mb = k * n * 2 / 1e6
            print(f"{key}: norm {r['norm_us']:.2f}  cublas {r['cublas_us']:.2f} us ({mb / (r['cublas_us'] - r['norm_us']) / 1e3:.2f} TB/s)"
                  f"  cublas+pdl-norm {r['cublas_pdl_norm_us']:.2f}  skinny {b['us']:.2f} {b['tile']}  "
                  f"skinny+pdl {bp['us']:.2f} {bp['tile']} err {bp['err']:.1e}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                              "results": res}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
