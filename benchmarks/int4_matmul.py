"""CPU benchmark: com.microsoft MatMulNBits (int4, block 32) at SmolLM2-135M's shapes, 30 layers of the five
products onnxruntime-genai's builder writes per layer (qkv 960x576, o 576x576, gate / up 1536x576,
down 576x1536), at M = 1 (decode) and M = 61 (a prefill chunk), in every layout pagedkit can give the weight:

- `int4-bf16`: nbits.Int4Linear, torch's `_weight_int4pack_mm_for_cpu` with A cast to bfloat16 (the default
  for accuracy_level >= 3);
- `int4-bf16-hilo`: the same with A split into bf16 hi + lo parts (one call on both stacked);
- `int4-bf16-hilo-scalelo`: hi + lo, plus a call with the bf16 rounding residue of the scales (only the
  kernel's bf16 output rounding is left);
- `int4-fp32act`: the same kernel fed float32 A (its slow path; for reference);
- `dequant-fp32`: nbits.DequantizedLinear, W dequantized once, `a @ W.T` (the exact layout);
- `dequant-fp32-onednn`: W dequantized once and packed for oneDNN (mkldnn._reorder_linear_weight /
  _linear_pointwise);
- `per-call`: no prepack: W dequantized on every call (the unpacked path);
- `ort-level4` / `ort-level0`: onnxruntime's own CPU MatMulNBits (the peer), one graph holding the 150 nodes,
  accuracy_level 4 (A quantized to int8 blocks, what genai's CPU builder writes) and 0 (A unquantized).

Time: the median (and min) over --reps of the 150 products run back to back (variants interleaved rep by rep).
Accuracy: per product, max|y - exact| / max|exact| with `exact` the float64 product of the dequantized weight,
max and mean over the products of --accuracy-layers layers, weights from rounding N(0, 0.02) to nearest
(symmetric, as genai's default, and asymmetric with packed zero points). Memory: bytes each layout holds.

    python benchmarks/int4_matmul.py [--threads 2] [--reps 15] [--machine TEXT] [--append]
                                     [--out benchmarks/results/int4_matmul.json]

The JSON holds {"runs": [...]}, one run per machine: --append keeps the file's runs of other machines.
Numbers are for the machine named in each run only (a shared machine's load is recorded beside them).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pagedkit.runtime.ops import OpContext, nbits  # noqa: E402
from pagedkit.runtime.ops.quant import dequantize_nbits, matmul_nbits, unpack_bits  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate": (1536, 576), "up": (1536, 576), "down": (576, 1536)}
LAYERS, BLOCK = 30, 32


def quantize(w: torch.Tensor, symmetric: bool) -> dict:
    """Round-to-nearest 4-bit blocks of w [N, K]: MatMulNBits' B [N, kb, 16], scales [N, kb], zero points."""
    n, k = w.shape
    wb = w.reshape(n, k // BLOCK, BLOCK)
    if symmetric:
        scale = wb.abs().amax(-1) / 7.5
        zp = torch.full_like(scale, 8)
    else:
        lo, hi = wb.amin(-1), wb.amax(-1)
        scale = (hi - lo) / 15
        zp = torch.round(-lo / scale).clamp(0, 15)
    q = torch.round(wb / scale.unsqueeze(-1) + zp.unsqueeze(-1)).clamp(0, 15).to(torch.uint8)
    b = (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()
    z = None
    if not symmetric:
        zq = zp.to(torch.uint8)
        zq = torch.cat([zq, zq.new_zeros(n, zq.shape[1] % 2)], 1)
        z = (zq[:, 0::2] | (zq[:, 1::2] << 4)).contiguous()
    return dict(b=b, scales=scale.float().contiguous(), zp=z, n=n, k=k)


def attrs_of(w: dict, level: int = 4) -> dict:
    return dict(K=w["k"], N=w["n"], bits=4, block_size=BLOCK, accuracy_level=level)


def exact_weight(w: dict) -> torch.Tensor:
    return dequantize_nbits(w["b"], w["scales"], w["zp"], 4, BLOCK, w["n"], w["k"], torch.float64)


class OneDNN:
    def __init__(self, w: torch.Tensor):
        self.packed, self.k, self.n = torch.ops.mkldnn._reorder_linear_weight(w, 1), w.shape[1], w.shape[0]
        self.nbytes = w.numel() * 4

    def matmul(self, a):
        return torch.ops.mkldnn._linear_pointwise(a, self.packed, None, "none", [], "")


class Int4HiLo(nbits.Int4Linear):
    """A as bf16 hi + lo parts (~16 bits of A), one kernel call on both stacked, outputs summed in float32."""

    def matmul(self, a):
        hi = a.to(torch.bfloat16)
        y = self.kernel(torch.cat([hi, (a - hi.float()).to(torch.bfloat16)]))[:, :self.out_features].float()
        return y[:a.shape[0]] + y[a.shape[0]:]


class Int4HiLoScaleLo(Int4HiLo):
    """Int4HiLo plus a third product with the bf16 rounding residue of the scales / zeros (same packed weight):
    only the kernel's bf16 output rounding is left."""

    def __init__(self, *args):
        super().__init__(*args)
        q, scales, zp = args[:3]
        s = scales.float()
        z = torch.zeros_like(s) if zp is None else (8.0 - zp.float()) * s
        exact = torch.stack([s.T, z.T], -1)
        self.sz_lo = (exact - self.scales_and_zeros.float()).to(torch.bfloat16).contiguous()

    def matmul(self, a):
        y = super().matmul(a)
        lo = torch.ops.aten._weight_int4pack_mm_for_cpu(a.to(torch.bfloat16), self.weight, BLOCK, self.sz_lo)
        return y + lo[:, :self.out_features].float()


def int4(w: dict, split: bool | str) -> nbits.Int4Linear:
    kb = w["k"] // BLOCK
    q = unpack_bits(w["b"], 4).reshape(w["n"], -1)
    zp = None if w["zp"] is None else unpack_bits(w["zp"], 4)[:, :kb].float()
    cls = {False: nbits.Int4Linear, True: Int4HiLo, "scale-lo": Int4HiLoScaleLo}[split]
    return cls(q, w["scales"], zp, BLOCK, w["n"], w["k"], w["zp"] is not None)


class Int4Fp32Act:
    def __init__(self, w: dict):
        self.p = int4(w, False)
        self.sz = self.p.scales_and_zeros.float()
        self.nbytes = self.p.nbytes

    def matmul(self, a):
        return torch.ops.aten._weight_int4pack_mm_for_cpu(a, self.p.weight, BLOCK, self.sz)


class PerCall:
    def __init__(self, w: dict):
        self.w, self.attrs = w, attrs_of(w)
        self.nbytes = w["b"].numel() + w["scales"].numel() * 4

    def matmul(self, a):
        return matmul_nbits([a, self.w["b"], self.w["scales"], self.w["zp"]], self.attrs, OpContext())[0]


VARIANTS = {
    "int4-bf16": lambda w: int4(w, False),
    "int4-bf16-hilo": lambda w: int4(w, True),
    "int4-bf16-hilo-scalelo": lambda w: int4(w, "scale-lo"),
    "int4-fp32act": Int4Fp32Act,
    "dequant-fp32": lambda w: nbits.DequantizedLinear(exact_weight(w).float(), w["zp"] is not None),
    "dequant-fp32-onednn": lambda w: OneDNN(exact_weight(w).float()),
    "per-call": PerCall,
}


class OrtPeer:
    """onnxruntime CPU: one graph of independent MatMulNBits nodes (one per weight) over two inputs."""

    def __init__(self, weights: list[dict], level: int, threads: int):
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper

        nodes, inits, outs = [], [], []
        for i, w in enumerate(weights):
            names = [f"x{w['k']}", f"b{i}", f"s{i}"] + ([f"z{i}"] if w["zp"] is not None else [])
            inits += [numpy_helper.from_array(w["b"].numpy(), f"b{i}"),
                      numpy_helper.from_array(w["scales"].numpy(), f"s{i}")]
            if w["zp"] is not None:
                inits.append(numpy_helper.from_array(w["zp"].numpy(), f"z{i}"))
            nodes.append(helper.make_node("MatMulNBits", names, [f"y{i}"], domain="com.microsoft",
                                          **attrs_of(w, level)))
            outs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None))
        ks = sorted({w["k"] for w in weights})
        ins = [helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, ["M", k]) for k in ks]
        model = helper.make_model(helper.make_graph(nodes, "nbits", ins, outs, initializer=inits),
                                  opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                                  ir_version=10)
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        self.sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        self.version = ort.__version__

    def run(self, xs: dict[int, np.ndarray]) -> list[np.ndarray]:
        return self.sess.run(None, {f"x{k}": v for k, v in xs.items()})


def time_all(fns: dict, reps: int) -> dict:
    times = {name: [] for name in fns}
    for _ in range(reps + 1):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {n: dict(median_ms=round(statistics.median(t[1:]), 3), min_ms=round(min(t[1:]), 3))
            for n, t in times.items()}  # the first rep warms up


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).abs().max() / ref.abs().max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--per-call-reps", type=int, default=3, help="reps of the slow per-call / fp32-activation rows")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 61])
    ap.add_argument("--accuracy-layers", type=int, default=3)
    ap.add_argument("--machine", default="", help="a description of the machine for the JSON")
    ap.add_argument("--append", action="store_true", help="keep the runs of other machines already in --out")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "int4_matmul.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    weights = [quantize(torch.randn(*SHAPES[s], generator=g) * 0.02, True) for _ in range(LAYERS) for s in SHAPES]
    layouts = {name: [make(w) for w in weights] for name, make in VARIANTS.items()}
    try:
        peers = {f"ort-level{lv}": OrtPeer(weights, lv, args.threads) for lv in (4, 0)}
    except ImportError:
        peers = {}
    result = dict(
        command="python " + " ".join([os.path.relpath(__file__, ROOT), *sys.argv[1:]]),
        machine=args.machine or platform.processor() or platform.machine(),
        machine_details=dict(cpu_count=os.cpu_count(), torch=torch.__version__, python=platform.python_version(),
                             onnxruntime=next(iter(peers.values())).version if peers else None,
                             loadavg_at_start=[round(x, 2) for x in os.getloadavg()]),
        date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        threads=args.threads,
        shapes=dict(layers=LAYERS, block_size=BLOCK, products_per_layer={k: list(v) for k, v in SHAPES.items()}),
        memory_mib={n: round(sum(p.nbytes for p in ps) / 2**20, 1) for n, ps in layouts.items()},
        time={}, accuracy={})
    for m in args.rows:
        xs = {k: torch.randn(m, k, generator=g) for k in (576, 1536)}
        xn = {k: v.numpy() for k, v in xs.items()}
        fns = {n: (lambda ps=ps: [p.matmul(xs[w["k"]]) for p, w in zip(ps, weights)])
               for n, ps in layouts.items() if n not in ("per-call", "int4-fp32act")}
        fns |= {n: (lambda p=p: p.run(xn)) for n, p in peers.items()}
        rows = time_all(fns, args.reps)
        slow = {n: (lambda ps=layouts[n]: [p.matmul(xs[w["k"]]) for p, w in zip(ps, weights)])
                for n in ("per-call", "int4-fp32act")}
        rows |= time_all(slow, args.per_call_reps)
        result["time"][f"M={m}"] = rows
        print(f"M={m}: " + ", ".join(f"{n} {r['median_ms']:.2f} ms" for n, r in rows.items()), flush=True)
    for symmetric in (True, False):
        acc_w = [quantize(torch.randn(*SHAPES[s], generator=g) * 0.02, symmetric)
                 for _ in range(args.accuracy_layers) for s in SHAPES]
        acc_layouts = {n: [make(w) for w in acc_w] for n, make in VARIANTS.items() if n != "per-call"}
        acc_peers = {f"ort-level{lv}": OrtPeer(acc_w, lv, args.threads) for lv in (4, 0)} if peers else {}
        key = "symmetric" if symmetric else "asymmetric (packed zero points)"
        result["accuracy"][key] = {}
        for m in args.rows:
            xs = {k: torch.randn(m, k, generator=g) for k in (576, 1536)}
            refs = [xs[w["k"]].double() @ exact_weight(w).T for w in acc_w]
            errs = {n: [rel_err(p.matmul(xs[w["k"]]), r) for p, w, r in zip(ps, acc_w, refs)]
                    for n, ps in acc_layouts.items()}
            for n, p in acc_peers.items():
                ys = p.run({k: v.numpy() for k, v in xs.items()})
                errs[n] = [rel_err(torch.from_numpy(y), r) for y, r in zip(ys, refs)]
            result["accuracy"][key][f"M={m}"] = {n: dict(max=float(f"{max(e):.3g}"), mean=float(f"{np.mean(e):.3g}"))
                                                 for n, e in errs.items()}
            print(f"{key} M={m}: " + ", ".join(f"{n} {max(e):.2e}" for n, e in errs.items()), flush=True)
    result["machine_details"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    out = Path(args.out)
    runs = json.loads(out.read_text())["runs"] if args.append and out.exists() else []
    runs = [r for r in runs if r["machine"] != result["machine"]] + [result]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
