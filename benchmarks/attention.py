"""One PagedAttention call (cache write of the step's new tokens + attention + reduce) on the H200: pagedkit's
Triton kernel, onnxruntime-gpu's own CUDA kernel and pagedkit's torch_sdpa on the same inputs, against the
bandwidth floor. Writes <out>/attention.json and <out>/attention_roofline.png.

    PYTHONPATH=/tmp/ortgpu:$PWD python3 benchmarks/attention.py --out benchmarks/results      # every row
    python3 benchmarks/attention.py --quick                      # a few rows
    python3 benchmarks/attention.py --cases 'fp16-*' --ort-no-graph
    python3 benchmarks/attention.py --list                       # the rows
    TRITON_INTERPRET=1 python3 benchmarks/attention.py --dry-run --out /tmp/att   # CPU plumbing check, tiny shapes

Arms (each on its own copy of the caches, built from the same seed; see docs/benchmarks.md):
- triton: `pagedkit.kernels.triton.paged:paged_attention` (imported lazily; skipped with the reason if it does not
  import), warmed up eagerly, one call captured with torch.cuda.graph, replayed: --batches batches of --replays
  replays between CUDA events, the median per replay. `eager_ms`: the same call eagerly, a device sync per batch.
- sdpa_prefill (prefill rows without a cached prefix): `pagedkit.kernels.triton.sdpa_prefill:paged_attention`, the
  variant dispatch picks for the plan hint "prefill": triton_paged's cache-write prologue, then torch's fused
  attention (cuDNN, else FlashAttention-2) on the prompts gathered from the cache; timed like triton, its `route`
  recorded. The paged call itself, cache write included (unlike sdpa_flash / sdpa_cudnn below).
- ort: a one-node PagedAttention model (pagedkit's node builder) in onnxruntime's CUDAExecutionProvider with
  enable_cuda_graph=1, every tensor bound with IOBinding (attention_metadata a CPU input, the cache outputs bound
  to the cache buffers), warm-up runs, then batches of run_with_iobinding (ORT replays its graph) without ORT's
  per-run sync (run option disable_synchronize_execution_providers=1), wall clock with a device sync around each
  batch. A configuration ORT refuses is `{"skipped": reason}`. ort_no_graph (--ort-no-graph, or when the graph
  arm fails at run time): the same without the CUDA graph.
- torch_sdpa: pagedkit's torch path (validate=False), eager (it reads lengths on the host), a device sync per call.
- reference (--dry-run, or --arms): the loop-based oracle.
- sdpa_flash / sdpa_cudnn (prefill rows without a cached prefix): torch's dense scaled_dot_product_attention with
  one backend (FlashAttention-2 / cuDNN) on the step's own Q / K / V as [B, H, S, D], CUDA events, eager: the
  reference point for what a fused dense kernel reaches on the shape (not a paged kernel).
Floor: traffic() bytes / --bandwidth (4.4 TB/s); per arm effective TB/s = bytes / time, fraction = floor / time.
Prefill rows (query_len > 1) are compute-bound: their floor is the larger of that and flops() / --tflops (790),
and each arm also reports TFLOP/s; they are plotted apart (attention_prefill.png).
Parity: max|a - b| / max|b| of the outputs, warned about above 2e-2. Exit code 0 whatever an arm does.
"""

from __future__ import annotations

import argparse
import datetime as dt
import fnmatch
import gc
import importlib
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(Path(__file__).resolve().parent), str(REPO)]
import _attention_cases as C  # noqa: E402
import _ort_peer  # noqa: E402
from _provenance import versions  # noqa: E402
from _timing import Skip, one_line, sync, time_events, time_wall  # noqa: E402

SDPA_BACKENDS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION"}  # torch.nn.attention.SDPBackend
ENTRIES = {"triton": "pagedkit.kernels.triton.paged:paged_attention",
           "triton_mla": "pagedkit.kernels.triton.mla:paged_attention",
           "sdpa_prefill": "pagedkit.kernels.triton.sdpa_prefill:paged_attention",
           "torch_sdpa": "pagedkit.kernels.paged.torch_sdpa:paged_attention",
           "reference": "pagedkit.kernels.paged.reference:paged_attention"}
ARMS = ("triton", "triton_mla", "sdpa_prefill", "ort", "ort_no_graph", "torch_sdpa", "reference", "sdpa_flash", "sdpa_cudnn")
PARITY_PAIRS = (("triton", "ort"), ("sdpa_prefill", "ort"), ("sdpa_prefill", "triton"), ("sdpa_prefill", "reference"),
                ("triton_mla", "ort"), ("triton_mla", "reference"), ("triton_mla", "triton"),
                ("triton", "torch_sdpa"), ("triton", "reference"), ("torch_sdpa", "ort"),
                ("torch_sdpa", "reference"), ("ort_no_graph", "ort"), ("triton", "sdpa_flash"),
                ("triton", "sdpa_cudnn"))
RATIO_PAIRS = (("triton", "ort"), ("sdpa_prefill", "ort"), ("sdpa_prefill", "triton"), ("sdpa_prefill", "sdpa_cudnn"),
               ("triton_mla", "ort"), ("triton_mla", "triton"), ("triton", "ort_no_graph"),
               ("triton", "torch_sdpa"), ("torch_sdpa", "ort"), ("torch_sdpa", "reference"), ("triton", "sdpa_flash"),
               ("triton", "sdpa_cudnn"))
PARITY_WARN = 2e-2
GRAPH_ARMS = ("triton", "triton_mla", "sdpa_prefill")  # timed as CUDA-graph replays (capturable variants)


def summary(samples: list[float], timing: str) -> dict:
    return {"ms": statistics.median(samples), "samples_ms": [round(s, 5) for s in samples], "timing": timing}


def load_entry(arm: str, device: torch.device):
    if arm in GRAPH_ARMS and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise Skip(f"on the CPU the {arm} arm needs TRITON_INTERPRET=1")
    mod, _, fn = ENTRIES[arm].partition(":")
    try:
        return getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError) as exc:
        raise Skip(f"{ENTRIES[arm]} does not import: {one_line(exc)}") from None


def pagedkit_arm(arm: str, base: dict, attrs: dict, outputs: list[str], args, device,
                 case: C.Case | None = None) -> tuple[dict, torch.Tensor]:
    if arm == "sdpa_prefill" and case is not None and (not case.prefill or any(c != case.query_len
                                                                               for c in case.contexts)):
        raise Skip("sdpa_prefill serves first prompts (plan prefill) only")
    fn = load_entry(arm, device)
    x = C.arm_copy(base)

    def call():
        return fn(x, outputs=outputs, validate=False, **attrs)

    try:
        for _ in range(args.warmup):
            out = call()
    except (NotImplementedError, ImportError) as exc:  # a refusal, or a kernel module that is not there yet
        raise Skip(one_line(exc)) from None
    sync(device)
    route = {}
    if arm == "sdpa_prefill":
        route = {"route": importlib.import_module(ENTRIES[arm].partition(":")[0]).LAST_ROUTE}
    if arm not in GRAPH_ARMS or device.type != "cuda":
        eager = time_wall(call, 1, args.eager_reps, device)
        res = summary(eager, "eager, wall clock, a device sync per call" if device.type == "cuda" else "eager (CPU)")
        return res | route, out["output"].clone()
    eager = time_wall(call, args.replays, args.batches, device)
    res = {"eager_ms": statistics.median(eager)} | route
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graph wants
            for _ in range(args.warmup):
                call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call()
        graph.replay()
        sync(device)
    except Exception as exc:  # not capturable: report the eager time, flagged
        tqdm_write(f"[{args.row}] triton: CUDA graph capture failed ({one_line(exc)}); reporting eager time")
        res.update(summary(eager, "eager (CUDA graph capture failed), wall clock"), graph_error=one_line(exc))
        return res, call()["output"].clone()
    res.update(summary(time_events(graph.replay, args.replays, args.batches),
                       f"CUDA graph replay, CUDA events around {args.replays} replays, median of {args.batches}"))
    return res, out["output"].clone()


def ort_arm(base: dict, attrs: dict, outputs: list[str], args, device, graph: bool) -> tuple[dict, torch.Tensor]:
    x = C.arm_copy(base)
    dv = attrs.get("v_head_size") or base["value"].shape[1] // attrs["kv_num_heads"]
    out = torch.full((x["query"].shape[0], attrs["num_heads"] * dv), float("nan"), dtype=x["query"].dtype,
                     device=device)
    try:
        model = C.onnx_model(x, attrs, outputs)
        # cache outputs: the cache buffers (attention_metadata stays in host memory)
        call = _ort_peer.bound_call(model, x, {n: out if n == "output" else x[n[: -len("_out")]] for n in outputs},
                                    device, graph)
        samples = _ort_peer.time_runs(call, device, graph, warmup=args.warmup, replays=args.replays,
                                      batches=args.batches)
    except _ort_peer.Unavailable as exc:
        raise Skip(str(exc)) from None
    how = "CUDA graph replays (enable_cuda_graph=1)" if graph else "no CUDA graph"
    res = summary(samples, f"{how}, run_with_iobinding unsynchronized, wall clock around {args.replays} runs "
                           f"with a device sync, median of {args.batches}")
    result = out.clone()
    del call
    return res, result


def dense_arm(arm: str, case: C.Case, base: dict, attrs: dict, args, device) -> tuple[dict, torch.Tensor]:
    """torch's dense attention (scaled_dot_product_attention, one SDPA backend) on the step's own Q / K / V as
    [B, H, S, D]: the same result as the paged call when the row is a prefill with no cached prefix (the
    keys are the new tokens) and no feature beyond causal GQA. Not a paged kernel: the reference point."""
    if not case.prefill or any(c != case.query_len for c in case.contexts):
        raise Skip("dense attention serves prefills without a cached prefix only")
    if case.cache != "fp16" or case.features or case.rotation or case.window > 0 or case.latent:
        raise Skip("dense attention: plain float16 causal rows only")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    b, q, h, hkv, d = case.batch, case.query_len, case.num_heads, case.kv_heads, case.head_size
    qd = base["query"].view(b, q, h, d).transpose(1, 2).contiguous()
    kd = base["key"].view(b, q, hkv, d).transpose(1, 2).contiguous()
    vd = base["value"].view(b, q, hkv, d).transpose(1, 2).contiguous()
    backend = getattr(SDPBackend, SDPA_BACKENDS[arm])

    def call():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=hkv != h)

    try:
        for _ in range(args.warmup):
            out = call()
        sync(device)
    except Exception as exc:  # the backend refuses the shape / device
        raise Skip(f"{SDPA_BACKENDS[arm]}: {one_line(exc)}") from None
    samples = (time_events(call, args.replays, args.batches) if device.type == "cuda"
               else time_wall(call, 1, args.eager_reps, device))
    res = summary(samples, "eager, CUDA events" if device.type == "cuda" else "eager (CPU)")
    return res, out.transpose(1, 2).reshape(b * q, h * d).clone()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def run_row(case: C.Case, arms: list[str], args, device: torch.device) -> dict:
    from pagedkit.validators import check_inputs

    args.row = case.name
    traffic = C.traffic(case)
    row = {"name": case.name, "config": case.config() | {"attention_metadata": args.metadata},
           "bytes": traffic, "floor_ms": C.floor_ms(traffic["total"], args.bandwidth), "arms": {},
           "ratios": {}, "parity": {}}
    if case.prefill or case.latent:  # compute-bound (MLA at many heads too): the floor is the larger of the two
        row["flops"] = C.flops(case)
        row["compute_floor_ms"] = C.compute_floor_ms(row["flops"], args.tflops)
        row["floor_ms"] = max(row["floor_ms"], row["compute_floor_ms"])
    try:
        base, attrs, outputs = C.build_inputs(case, device, args.seed, args.metadata)
        issues = check_inputs(base, attrs, outputs=outputs, node_name=case.name)
        if issues:
            raise ValueError("pagedkit's validator rejects the inputs: " + "; ".join(map(str, issues))[:400])
    except Exception as exc:
        row["error"] = one_line(exc)
        tqdm_write(f"[{case.name}] inputs: {row['error']}")
        return row
    row["config"]["attributes"] = attrs
    outs = {}
    for arm in arms:
        graph_failed = "skipped" in row["arms"].get("ort", {})  # then ORT is tried without its graph too
        if arm == "ort_no_graph" and (device.type == "cpu" or not (args.ort_no_graph or graph_failed)):
            continue
        try:
            if arm.startswith("ort"):
                res, out = ort_arm(base, attrs, outputs, args, device, graph=arm == "ort" and device.type == "cuda")
            elif arm in SDPA_BACKENDS:
                res, out = dense_arm(arm, case, base, attrs, args, device)
            else:
                res, out = pagedkit_arm(arm, base, attrs, outputs, args, device, case)
            outs[arm] = out
        except Skip as exc:
            res = {"skipped": str(exc)}
            tqdm_write(f"[{case.name}] {arm}: skipped: {exc}")
        except Exception as exc:
            res = {"error": one_line(exc)}
            tqdm_write(f"[{case.name}] {arm}: error: {res['error']}")
        if "ms" in res:
            res["tb_s"] = C.effective_tb_s(traffic["total"], res["ms"])
            res["fraction_of_floor"] = row["floor_ms"] / res["ms"]
            if "flops" in row:
                res["tflop_s"] = row["flops"] / (res["ms"] * 1e-3) / 1e12
        row["arms"][arm] = res
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for a, b in PARITY_PAIRS:
        if a in outs and b in outs:
            err = row["parity"][f"{a}_vs_{b}"] = rel_err(outs[a], outs[b])
            if not err <= PARITY_WARN:  # NaN too
                row.setdefault("parity_warnings", []).append(f"{a} vs {b}: {err:.3g}")
                tqdm_write(f"!!! [{case.name}] PARITY: {a} vs {b} max|diff|/max|ref| = {err:.3g} > {PARITY_WARN}")
    for a, b in RATIO_PAIRS:
        ma, mb = row["arms"].get(a, {}).get("ms"), row["arms"].get(b, {}).get("ms")
        if ma and mb:
            row["ratios"][f"{a}_speedup_vs_{b}"] = mb / ma
    return row


def safe_row(case: C.Case, arms: list[str], args, device: torch.device) -> dict:
    """run_row; an unexpected failure becomes the row's one-line error (the run goes on)."""
    try:
        return run_row(case, arms, args, device)
    except Exception as exc:  # noqa: BLE001
        tqdm_write(f"[{case.name}] error: {one_line(exc)}")
        total = C.traffic(case)["total"]
        return {"name": case.name, "config": case.config(), "floor_ms": C.floor_ms(total, args.bandwidth),
                "arms": {}, "ratios": {}, "parity": {}, "error": one_line(exc)}
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def tqdm_write(msg: str) -> None:
    from tqdm import tqdm

    tqdm.write(msg, file=sys.stderr)


def _scatter(rows: list[dict], path: Path, key: str, line: float, line_label: str, ylabel: str, title: str,
             rotation: int) -> None:
    """One point per (row, arm) of `key`, a dashed line at `line`, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [a for a in ARMS if any(key in r["arms"].get(a, {}) for r in rows)]
    fig, ax = plt.subplots(figsize=(max(8.0, 0.55 * len(rows) + 3), 5.5))
    for k, arm in enumerate(arms):
        pts = [(i + 0.12 * (k - (len(arms) - 1) / 2), r["arms"][arm][key]) for i, r in enumerate(rows)
               if key in r["arms"].get(arm, {})]
        ax.scatter(*zip(*pts), label=arm, marker="os^Dv<>"[k % 7], s=36, zorder=3)
    ax.axhline(line, ls="--", color="black", label=line_label)
    ax.set_yscale("log")
    ax.set_xticks(range(len(rows)), [r["name"] for r in rows], rotation=rotation, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot(rows: list[dict], path: Path, bandwidth: float, device_name: str) -> None:
    """Decode rows on the bandwidth roofline (`path`); prefill rows in TFLOP/s beside it (attention_prefill.png)."""
    pre = [r for r in rows if r["config"].get("query_tokens_per_sequence", 1) > 1]
    dec = [r for r in rows if r not in pre]
    if pre:
        _scatter(pre, path.with_name(path.stem.replace("roofline", "prefill") + path.suffix), "tflop_s",
                 C.PEAK_TFLOP_S, f"peak: {C.PEAK_TFLOP_S:g} TFLOP/s", "TFLOP/s (attention FLOPs / time)",
                 f"PagedAttention, prefill calls: {device_name}", 30)
    if dec:
        _scatter(dec, path, "tb_s", bandwidth, f"floor: {bandwidth} TB/s",
                 "effective TB/s (bytes that must move / time)", f"PagedAttention, one decode call: {device_name}", 60)


def pick_cases(args) -> list[C.Case]:
    table = C.DRY_CASES if args.dry_run else C.CASES
    if args.cases:
        names = [n for n in table if any(fnmatch.fnmatch(n, p) for p in args.cases)]
        if not names:
            sys.exit(f"--cases {args.cases}: no row matches; rows: {', '.join(table)}")
        return [table[n] for n in names]
    return [table[n] for n in (C.QUICK if args.quick and not args.dry_run else table)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", metavar="NAME", help="rows to run (names or fnmatch patterns; --list)")
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(C.QUICK)}")
    ap.add_argument("--list", action="store_true", help="list the rows and exit")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, eager timing: the plumbing only")
    ap.add_argument("--arms", nargs="+", choices=ARMS,
                    help="default: triton triton_mla sdpa_prefill ort torch_sdpa sdpa_flash sdpa_cudnn (ort_no_graph when ORT's "
                         "graph fails; --dry-run: reference instead of sdpa_cudnn)")
    ap.add_argument("--ort-no-graph", action="store_true", help="also time onnxruntime without its CUDA graph")
    ap.add_argument("--metadata", action=argparse.BooleanOptionalAction, default=True,
                    help="pass attention_metadata [1, max_context, 0] (host int32) to every arm")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--bandwidth", type=float, default=C.BANDWIDTH_TB_S, help="TB/s of the floor")
    ap.add_argument("--tflops", type=float, default=C.PEAK_TFLOP_S, help="TFLOP/s of prefill rows' floor")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--replays", type=int, default=20, help="calls per timed batch (graph replays, ORT runs)")
    ap.add_argument("--batches", type=int, default=10, help="timed batches; the median is reported")
    ap.add_argument("--eager-reps", type=int, default=10, help="timed eager calls (torch_sdpa, reference)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.list:
        for c in (C.DRY_CASES if args.dry_run else C.CASES).values():
            print(f"{c.name:32} {json.dumps({k: v for k, v in c.config().items() if v not in (None, False, -1, '')})}")
        return 0
    device = torch.device("cpu" if args.dry_run else "cuda")
    if args.dry_run:
        args.replays, args.batches, args.eager_reps, args.warmup = 1, 3, 3, 1
    elif not torch.cuda.is_available():
        sys.exit("no CUDA device: run on the H200, or --dry-run for the CPU plumbing check")
    arms = args.arms or (["reference", "torch_sdpa", "triton", "triton_mla", "sdpa_prefill", "ort", "sdpa_flash"]
                         if args.dry_run else ["triton", "triton_mla", "sdpa_prefill", "ort", "ort_no_graph",
                                               "torch_sdpa", "sdpa_flash", "sdpa_cudnn"])
    if args.ort_no_graph and "ort_no_graph" not in arms:
        arms.append("ort_no_graph")
    device_name = (torch.cuda.get_device_name(device) if device.type == "cuda"
                   else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)")
    from tqdm import tqdm

    rows = [safe_row(c, arms, args, device) for c in tqdm(pick_cases(args), desc="attention rows", unit="row")]
    result = {"command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
              "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "device": device_name,
              "dry_run": args.dry_run, "versions": versions(), "bandwidth_tb_s": args.bandwidth,
              "bandwidth_note": "floor = bytes that must move / this bandwidth (H200 HBM3e peak 4.4 TB/s)",
              "settings": {"warmup": args.warmup, "replays": args.replays, "batches": args.batches,
                           "eager_reps": args.eager_reps, "seed": args.seed, "attention_metadata": args.metadata,
                           "arms": arms, "parity_warn": PARITY_WARN},
              "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attention.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(rows, args.out / "attention_roofline.png", args.bandwidth, device_name)
    print(f"{'row':32} {'floor ms':>9} " + " ".join(f"{a:>22}" for a in arms) + "   parity")
    for r in rows:
        cells = []
        for a in arms:
            res = r["arms"].get(a, {})
            cells.append(f"{res['ms']:.4g} ms {res['tflop_s']:.3g} TF/s" if "tflop_s" in res else
                         f"{res['ms']:.4g} ms {res['tb_s']:.3g} TB/s" if "ms" in res else
                         "skipped" if "skipped" in res else "error" if "error" in res else "-")
        parity = " ".join(f"{k}={v:.2g}" for k, v in r["parity"].items())
        print(f"{r['name']:32} {r['floor_ms']:9.4g} " + " ".join(f"{c:>22}" for c in cells) + "   " + parity
              + (f"   ERROR {r['error']}" if "error" in r else ""))
    print(f"wrote {args.out / 'attention.json'} and {args.out / 'attention_roofline.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
