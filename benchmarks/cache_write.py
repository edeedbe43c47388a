"""The PagedAttention cache write alone (pagedkit.kernels.triton.cache_write.write_kv, one launch) on the GPU:
decode (B tokens) and prefill (B x L tokens) rows, 32 / 8 heads, head 128, RoPE, fp16 / int8 / int4
PER_TOKEN caches, timed as CUDA-graph replays. Prints one line per row and, with --out, writes JSON.
Floor: bytes moved (Q/K/V read, Q and the K/V codes written) / 4.4 TB/s.

    python benchmarks/cache_write.py --out benchmarks/results/cache_write.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import time_graph  # noqa: E402

ROWS = [("decode-b16", 16, 1, "fp16"), ("decode-b64", 64, 1, "fp16"), ("decode-b64-int8", 64, 1, "int8"),
        ("decode-b64-int4-token", 64, 1, "int4"), ("prefill-4x4096", 4, 4096, "fp16")]
H, HKV, D, BS = 32, 8, 128, 16


def _row(name, b, qlen, cache, replays):
    from pagedkit.kernels.triton.cache_write import write_kv
    from pagedkit.kernels.triton.common import (FMT_FLOAT, FMT_INT4, FMT_INT8, SCALE_NONE, SCALE_TENSOR,
                                                SCALE_TOKEN, SideFormat)

    dev = "cuda"
    n = b * qlen
    past = torch.full((b,), 1000, dtype=torch.int32, device=dev)
    csl = torch.arange(0, n + 1, qlen, dtype=torch.int32, device=dev)
    cols = -(-(1000 + qlen) // BS)
    nb = b * cols
    bt = torch.randperm(nb, device=dev).view(b, cols).to(torch.int32)
    q = torch.randn(n, H * D, dtype=torch.half, device=dev)
    k = torch.randn(n, HKV * D, dtype=torch.half, device=dev)
    v = torch.randn_like(k)
    ang = torch.arange(8192, device=dev)[:, None] * 10000.0 ** (-torch.arange(D // 2, device=dev) / (D // 2))
    cos, sin = ang.cos().half(), ang.sin().half()
    extra = {}
    if cache == "fp16":
        fmt, width, dt = SideFormat(FMT_FLOAT, SCALE_NONE), D, torch.half
    elif cache == "int8":
        fmt, width, dt = SideFormat(FMT_INT8, SCALE_TENSOR), D, torch.int8
        extra = dict(k_scale=torch.tensor([0.05], device=dev), v_scale=torch.tensor([0.05], device=dev))
    else:
        fmt, width, dt = SideFormat(FMT_INT4, SCALE_TOKEN), D // 2, torch.uint8
        extra = dict(k_scale_cache=torch.zeros(nb, BS, HKV, dtype=torch.half, device=dev),
                     v_scale_cache=torch.zeros(nb, BS, HKV, dtype=torch.half, device=dev))
    kc = torch.zeros(nb, BS, HKV, width, dtype=dt, device=dev)
    vc = torch.zeros_like(kc)

    def call():
        return write_kv(q, k, v, num_heads=H, kv_num_heads=HKV, head_size=D, cumulative_sequence_length=csl,
                        past_seqlens=past, block_table=bt, key_cache=kc, value_cache=vc, k_format=fmt,
                        v_format=fmt, cos_cache=cos, sin_cache=sin, **extra)

    ms = time_graph(call, reps=replays, batches=1)
    code_bytes = n * HKV * 2 * width * kc.element_size()
    moved = n * (H + 2 * HKV) * D * 2 + n * H * D * 2 + code_bytes
    floor_ms = moved / 4.4e12 * 1e3
    return {"name": name, "tokens": n, "cache": cache, "ms": ms, "floor_ms": floor_ms,
            "floor_fraction": floor_ms / ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--replays", type=int, default=200)
    args = ap.parse_args()
    rows = []
    for r in ROWS:
        res = _row(*r, args.replays)
        print(f"{res['name']:24s} {res['tokens']:6d} tokens  {res['ms'] * 1e3:8.2f} us  "
              f"floor {res['floor_ms'] * 1e3:7.2f} us ({res['floor_fraction']:.0%})")
        rows.append(res)
    if args.out:
        args.out.write_text(json.dumps({
            "command": "python benchmarks/cache_write.py --out " + str(args.out),
            "device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
            "commit": os.environ.get("PAGEDKIT_COMMIT", ""), "torch": torch.__version__,
            "host": platform.node(), "bandwidth_TBps": 4.4, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
