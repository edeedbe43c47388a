"""CPU benchmark: torch.compile (inductor) of pagedkit's execution plan vs the eager plan, on exported models.
Writes benchmarks/results/plan_compile.json.

    python benchmarks/probes/plan_compile.py                             # /tmp/m/smollm2-fp16 (exported if absent)
    python benchmarks/probes/plan_compile.py --model /tmp/m/smollm2-fp16 --model /tmp/m/smollm2-fp32
    python benchmarks/probes/plan_compile.py --variants eager segments --decode-steps 40     # quicker

Workload (batch 1, --threads 2 via torch.set_num_threads): a --prompt-token (61) prompt, the first tokens of
tests/data/ppl_text.txt, then --decode-steps (139) decode steps teacher-forced on the text's next tokens, so the
context grows 62 -> 200 and every variant sees the same tokens. One session per model; each variant has its own
Generator (own paged caches) over it and its own plan executor, swapped in as the session's `_execute` (nothing
under pagedkit/ is changed). Variants:

- eager: the plan as the session runs it today (runtime/plan.execute).
- whole_raw: torch.compile(dynamic=True) of the plan's op loop (plan.execute's body) as one function, graph
  breaks allowed; dynamo also traces into the attention kernels (they read lengths on the host).
- whole_attn_eager (not in the default set): the same, each attention call wrapped in torch.compiler.disable.
- whole_unrolled (not in the default set: its compile takes minutes): the plan written out as straight-line
  Python (one statement per op, no loop: a graph break inside a loop makes dynamo give up the enclosing frame),
  attention calls disabled, torch.compile(dynamic=True): dynamo resumes after each attention call, so the run is
  31 graphs per shape.
- segments: each maximal run of non-attention ops between attention nodes as one compiled function over its slot
  values (attention runs eager, between them); structurally identical segments (the 29 layer bodies o_proj ->
  next qkv_proj) share one function, the weights being arguments, so they share compiled graphs; the token
  dimension of the activations is marked dynamic when > 1 (torch._dynamo.mark_dynamic; decode's 1 is
  specialized by dynamo anyway).
- segments_1t: the same with inductor's cpp.threads = 1 (its generated C++ kernels single-threaded; tried because
  on 2 busy cores an OpenMP region around a 576-element norm can wait for the second thread to be scheduled;
  the matmuls are aten's / oneDNN's and keep --threads).
The compiled variants call each non-attention op's implementation as the session binds it on the CPU
(impl(inputs, attrs, ctx)); a MatMul / Gemm whose weight the session prepacked for oneDNN (float32) calls the
same oneDNN kernel through a custom op (`packed_impl`: inductor cannot lower mkldnn._linear_pointwise on a
weight it did not pack itself).

Per variant: warm-up (--warmup-steps steps: the first prefill and first decode pay the compiles), then --prefill-reps
prefills (variants interleaved, rotating order) and the teacher-forced decode run in lockstep (per step every
variant runs once, rotating order, so a shared machine's drift hits all alike). Reported: the first prefill /
first decode wall times (compile included), graphs compiled (a counting wrapper around inductor's compile_fx) during
warm-up and during the measured runs (recompiles), dynamo's graph-break count, recompile-limit hits (dynamo's
warning), median prefill ms, median ms per decode step and the median per-step ratio to eager, and the logits
difference to eager, max |diff| / max |ref| per step (the max and median over steps, prefill included).
A fresh TORCHINDUCTOR_CACHE_DIR is used unless --warm-cache, so compile times are cold (identical graphs within
the run still hit inductor's FX graph cache).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import functools
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = Path("/tmp/m/smollm2-fp16")
DEFAULT_OUTPUT = REPO / "benchmarks" / "results" / "plan_compile.json"
PROMPT_TEXT = REPO / "tests" / "data" / "ppl_text.txt"
VARIANTS = ("eager", "whole_raw", "whole_attn_eager", "whole_unrolled", "segments", "segments_1t")
DEFAULT_VARIANTS = ("eager", "whole_raw", "segments", "segments_1t")
# logits within this of eager's (max|diff| / max|ref|) count as equal, by the model's dtype
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 2e-3}


# ---- what the run measures on ----------------------------------------------------------------------
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def default_model() -> Path:
    if (DEFAULT_MODEL / "model.onnx").is_file():
        return DEFAULT_MODEL
    print(f"exporting SmolLM2-135M into {DEFAULT_MODEL} (paged-export --model smollm2-135m)", flush=True)
    subprocess.run(["paged-export", "--model", "smollm2-135m", "--output", str(DEFAULT_MODEL)], check=True)
    return DEFAULT_MODEL


def text_tokens(model: Path, n: int) -> list[int]:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(model / "tokenizer.json")).encode(PROMPT_TEXT.read_text()).ids
    if len(ids) < n:
        raise SystemExit(f"{PROMPT_TEXT} has {len(ids)} tokens, {n} needed")
    return ids[:n]


# ---- variants ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class Variant:
    name: str
    execute: object = None  # (prog, feeds, outer) -> vals, installed as the session's _execute
    graphs: int = 0  # graphs compiled by inductor (the counting backend)
    backend_s: float = 0.0  # time inside inductor's compile_fx
    breaks: int = 0  # dynamo graph breaks (counters["graph_break"]) while this variant ran
    limit_hits: list = dataclasses.field(default_factory=list)  # recompile-limit warnings (first line)
    notes: list = dataclasses.field(default_factory=list)
    error: str | None = None


CURRENT: list[Variant | None] = [None]  # the variant running now (dynamo's warnings are attributed to it)


class _DynamoLog(logging.Handler):
    """Counts dynamo's recompile-limit warnings for the running variant (and keeps dynamo's log quiet)."""

    def emit(self, record):
        msg = record.getMessage()
        if "recompile_limit" in msg and CURRENT[0] is not None:
            CURRENT[0].limit_hits.append(msg.splitlines()[0][:200])
            fn = [l.strip() for l in msg.splitlines() if "function:" in l]
            if fn:
                CURRENT[0].limit_hits[-1] += " " + fn[0][:160]


def counting_backend(var: Variant, options: dict | None):
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        t0 = time.perf_counter()
        var.graphs += 1
        try:
            return compile_fx(gm, example_inputs, config_patches=options or None)
        finally:
            var.backend_s += time.perf_counter() - t0

    return backend


_PACKED_IMPLS: dict = {}


def packed_impl(op_type: str):
    """MatMul / Gemm over a oneDNN-packed float32 weight (the session's prepack on the CPU) as an op inductor
    calls as is: inductor cannot lower mkldnn._linear_pointwise on a packed weight it did not pack itself (a
    LoweringException), so compiled code calls the very kernel the eager plan calls through a custom op."""
    import torch

    if not _PACKED_IMPLS:
        @torch.library.custom_op("plan_compile_bench::linear_packed", mutates_args=(),
                                 schema="(Tensor a, Tensor packed) -> Tensor")
        def linear_packed(a, packed):
            return torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")

        @linear_packed.register_fake
        def _(a, packed):
            return a.new_empty(a.shape[0], packed.shape[0])

        def make(gemm: bool):
            def impl(inputs, attrs, ctx):
                a, b = inputs[0], inputs[1]
                y = linear_packed(a.reshape(-1, b.in_features), b.packed).reshape(*a.shape[:-1], b.out_features)
                c = inputs[2] if gemm and len(inputs) > 2 else None
                return [y if c is None else y + c.to(y.dtype)]
            return impl

        _PACKED_IMPLS.update(MatMul=make(False), Gemm=make(True))
    return _PACKED_IMPLS[op_type]


def op_call(prog, op):
    """(impl, attrs, ctx) of a non-attention op as the session binds it on the CPU, a oneDNN-packed MatMul /
    Gemm weight routed through packed_impl."""
    s = op.step
    b = prog.template[op.ins[1]] if s.op_type in ("MatMul", "Gemm") and len(op.ins) > 1 else None
    if getattr(b, "packed", None) is not None:
        return packed_impl(s.op_type), s.attrs, s.ctx
    return s.impl, s.attrs, s.ctx


def fresh(fn, name: str):
    """fn with a code object of its own: dynamo keeps its compiled entries, recompile counts and skip marks per
    code object, so variants (and models) must not share one."""
    import types

    return types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name, fn.__defaults__,
                              fn.__closure__)


def compile_runs(prog, *, attn_eager: bool, tag: str):
    """Per op, the call compiled code makes: attention as bound (torch.compiler.disable'd if attn_eager), the
    others impl(ins, attrs, ctx) from op_call (one code object for all of them, as the session's op.run)."""
    import torch

    def call(ins, impl, attrs, ctx):
        return impl(ins, attrs, ctx)

    call = fresh(call, f"op_call_{tag}")
    runs = []
    for op in prog.ops:
        if op.step.call is not None or op.step.has_subgraph:
            runs.append(torch.compiler.disable(op.run) if attn_eager else op.run)
        else:
            impl, attrs, ctx = op_call(prog, op)
            runs.append(functools.partial(call, impl=impl, attrs=attrs, ctx=ctx))
    return runs


def _run_all(ops, vals):
    """plan.execute's loop (without its error naming)."""
    for op in ops:
        res = op.run([vals[j] for j in op.ins])
        for j, t in zip(op.outs, res):
            vals[j] = t
        vals[0] = None
        for j in op.release:
            vals[j] = None
    return vals


def whole_loop(var: Variant, prog, *, attn_eager: bool, options):
    import torch
    from pagedkit.runtime import plan as plan_mod

    runs = compile_runs(prog, attn_eager=attn_eager, tag=var.name)
    ops = [dataclasses.replace(op, run=run) for op, run in zip(prog.ops, runs)]
    fn = torch.compile(fresh(_run_all, f"run_all_{var.name}"), dynamic=True, backend=counting_backend(var, options))

    def execute(p, feeds, outer):
        return fn(ops, plan_mod.start(p, feeds, outer))

    return execute


def whole_unrolled(var: Variant, prog, *, options):
    """The plan as one straight-line function (one statement per op), attention calls disabled."""
    import torch
    from pagedkit.runtime import plan as plan_mod

    runs = compile_runs(prog, attn_eager=True, tag=var.name)
    lines = ["def plan_unrolled(v):"]
    for i, op in enumerate(prog.ops):
        ins = ", ".join("None" if j == plan_mod.NONE_SLOT else f"v[{j}]" for j in op.ins)
        lines.append(f"    r = R[{i}]([{ins}])")
        lines += [f"    v[{j}] = r[{k}]" for k, j in enumerate(op.outs) if j != plan_mod.NONE_SLOT]
        lines += [f"    v[{j}] = None" for j in op.release]
    lines.append("    return v")
    ns = {"R": runs}
    exec(compile("\n".join(lines), "<plan_unrolled>", "exec"), ns)
    fn = torch.compile(ns["plan_unrolled"], dynamic=True, backend=counting_backend(var, options))

    def execute(p, feeds, outer):
        return fn(plan_mod.start(p, feeds, outer))

    return execute


def _segment_body(prog, idxs):
    """A segment's inputs (slots read before being written in it), outputs (slots read after it or graph
    outputs), releases, and a signature + body that name no slot (so identical layers share them)."""
    from pagedkit.runtime.plan import NONE_SLOT

    ops = [prog.ops[i] for i in idxs]
    later = set(prog.outputs)
    for op in prog.ops[idxs[-1] + 1:]:
        later.update(op.ins)
    ext_in: list[int] = []  # read before written in the segment, in order of first read
    written: set[int] = set()
    for op in ops:
        ext_in += [j for j in op.ins if j != NONE_SLOT and j not in written and j not in ext_in]
        written.update(op.outs)
    local = {j: i for i, j in enumerate(ext_in)}
    for op in ops:
        for j in op.outs:
            if j != NONE_SLOT and j not in local:
                local[j] = len(local)
    outs = [j for j in dict.fromkeys(j for op in ops for j in op.outs) if j != NONE_SLOT and j in later]
    steps, sig = [], []
    for op in ops:
        impl, attrs, ctx = op_call(prog, op)
        ii = tuple(local[j] if j != NONE_SLOT else -1 for j in op.ins)
        oo = tuple(local[j] if j != NONE_SLOT else -1 for j in op.outs)
        steps.append((impl, attrs, ctx, ii, oo))
        sig.append((id(impl), repr(sorted(attrs.items())), repr(dataclasses.replace(ctx, node_name="")), ii, oo))
    out_idx = tuple(local[j] for j in outs)
    release = [j for op in ops for j in op.release]
    const = {j for j, t in enumerate(prog.template) if t is not None}
    dyn = [k for k, j in enumerate(ext_in) if j not in const]  # activations: their dim 0 is the token count
    return ext_in, outs, release, dyn, (tuple(sig), len(local), out_idx, len(ext_in)), (steps, len(local), out_idx)


def _make_segment_fn(body, k: int):
    steps, n, out_idx = body

    def seg(args):
        v = list(args) + [None] * (n - len(args))
        for impl, attrs, ctx, ii, oo in steps:
            res = impl([v[i] if i >= 0 else None for i in ii], attrs, ctx)
            for o, t in zip(oo, res):
                if o >= 0:
                    v[o] = t
        return [v[i] for i in out_idx]

    seg.__code__ = seg.__code__.replace(co_name=f"plan_segment_{k}")  # a code object (dynamo cache) of its own
    return seg


def segments(var: Variant, prog, *, options, device_type: str):
    import torch
    from pagedkit.runtime import plan as plan_mod

    if device_type != "cpu":
        raise RuntimeError("segments: the op calls are rebuilt as the session binds them on the CPU only")
    sched, cur, shared = [], [], {}
    items = []
    for i, op in enumerate(prog.ops):
        if op.step.call is not None or op.step.has_subgraph:
            if cur:
                items.append(cur)
                cur = []
            items.append(i)
        else:
            cur.append(i)
    if cur:
        items.append(cur)
    for it in items:
        if isinstance(it, int):
            sched.append(prog.ops[it])
            continue
        ext_in, outs, release, dyn, sig, body = _segment_body(prog, it)
        fn = shared.get(sig)
        if fn is None:
            fn = shared[sig] = torch.compile(_make_segment_fn(body, len(shared)), dynamic=None,
                                             backend=counting_backend(var, options))
        sched.append((fn, ext_in, outs, release, dyn))
    n_seg = sum(1 for s in sched if isinstance(s, tuple))
    var.notes.append(f"{n_seg} segments, {len(shared)} distinct; {len(prog.ops) - sum(len(x) for x in items if isinstance(x, list))} attention ops eager")
    mark = torch._dynamo.mark_dynamic

    def execute(p, feeds, outer):
        vals = plan_mod.start(p, feeds, outer)
        for s in sched:
            if isinstance(s, tuple):
                fn, ext_in, outs, release, dyn = s
                args = [vals[j] for j in ext_in]
                for k in dyn:
                    t = args[k]
                    if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] > 1:
                        mark(t, 0)
                res = fn(args)
                for j, t in zip(outs, res):
                    vals[j] = t
                for j in release:
                    vals[j] = None
            else:
                res = s.run([vals[j] for j in s.ins])
                for j, t in zip(s.outs, res):
                    vals[j] = t
                vals[plan_mod.NONE_SLOT] = None
                for j in s.release:
                    vals[j] = None
        return vals

    return execute


# ---- measurement ------------------------------------------------------------------------------------
def _rel(a, ref) -> float:
    return float((a - ref).abs().max() / ref.abs().max())


def bench_model(model: Path, names: list[str], args) -> dict:
    import torch
    from torch._dynamo.utils import counters
    from pagedkit.runtime.generate import Generator

    torch._dynamo.reset()  # nothing compiled for an earlier model carries over
    t0 = time.perf_counter()
    base = Generator(model, threads=args.threads, max_seq_len=args.prompt_tokens + args.decode_steps + 8)
    sess = base.session
    create_s = time.perf_counter() - t0
    prog = sess._main
    eager_exec = sess._execute  # the bound method
    # the activations' precision: the logits' type (the fp32 export keeps fp16 caches and attention)
    logits_type = next(a.type for a in sess.get_outputs() if a.name == base.logits_name)
    dtype = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(bfloat16)": "bfloat16"}.get(
        logits_type, logits_type)
    cache_dtype = str(base.dtype).replace("torch.", "")
    tokens = text_tokens(model, args.prompt_tokens + args.decode_steps + 1)
    prompt, cont = tokens[:args.prompt_tokens], tokens[args.prompt_tokens:args.prompt_tokens + args.decode_steps]
    options = {"emulate_precision_casts": True} if args.emulate_precision_casts else None

    variants: dict[str, Variant] = {}
    gens: dict[str, Generator] = {}
    for name in names:
        var = Variant(name)
        try:
            if name == "eager":
                var.execute = eager_exec
            elif name == "whole_raw":
                var.execute = whole_loop(var, prog, attn_eager=False, options=options)
            elif name == "whole_attn_eager":
                var.execute = whole_loop(var, prog, attn_eager=True, options=options)
            elif name == "whole_unrolled":
                var.execute = whole_unrolled(var, prog, options=options)
            elif name in ("segments", "segments_1t"):
                opts = (options or {}) | ({"cpp.threads": 1} if name == "segments_1t" else {})
                var.execute = segments(var, prog, options=opts, device_type=sess.device.type)
            else:
                raise ValueError(name)
        except Exception as exc:  # noqa: BLE001 - a variant that cannot be built is recorded
            var.error = f"{type(exc).__name__}: {exc}"[:500]
        variants[name] = var
        gens[name] = base if name == "eager" else Generator(model, session=sess, max_seq_len=base.max_seq_len)

    def run(name, n_steps, forced):
        """One generation (prefill + n_steps - 1 decodes) on the variant; its StepResults."""
        var = variants[name]
        sess._execute = var.execute
        CURRENT[0] = var
        b0 = sum(counters["graph_break"].values())
        try:
            return list(gens[name].run(prompt, n_steps, forced=forced[:n_steps]))
        finally:
            var.breaks += sum(counters["graph_break"].values()) - b0
            CURRENT[0] = None
            sess._execute = eager_exec

    live = [n for n in names if variants[n].error is None]
    rows: dict[str, dict] = {n: {} for n in names}
    # warm-up: the compiles
    for name in list(live):
        var = variants[name]
        t0 = time.perf_counter()
        try:
            steps = run(name, args.warmup_steps, cont)
        except Exception as exc:  # noqa: BLE001
            var.error = f"{type(exc).__name__}: {exc}"[:500]
            live.remove(name)
            print(f"  {name}: FAILED {var.error}", flush=True)
            continue
        r = rows[name]
        r["warmup_s"] = round(time.perf_counter() - t0, 2)
        r["first_prefill_s"] = round(steps[0].seconds, 3)
        r["first_decode_s"] = round(steps[1].seconds, 3) if len(steps) > 1 else None
        r["warmup_step_s"] = [round(s.seconds, 3) for s in steps]
        r["graphs_warmup"] = var.graphs
        print(f"  {name}: warm-up {r['warmup_s']} s (first prefill {r['first_prefill_s']} s, first decode "
              f"{r['first_decode_s']} s), {var.graphs} graphs, {var.breaks} breaks", flush=True)

    # prefills, interleaved
    prefill = {n: [] for n in live}
    for rep in range(args.prefill_reps):
        for name in live[rep % len(live):] + live[:rep % len(live)]:
            prefill[name].append(run(name, 1, cont)[0].seconds)

    # teacher-forced decode in lockstep
    its, seqs = {}, {}
    for name in live:
        its[name] = gens[name].run(prompt, len(cont), forced=cont)
        seqs[name] = []
    failed = set()
    for k in range(len(cont)):
        order = live[k % len(live):] + live[:k % len(live)]
        for name in order:
            if name in failed:
                continue
            var = variants[name]
            sess._execute = var.execute
            CURRENT[0] = var
            b0 = sum(counters["graph_break"].values())
            try:
                seqs[name].append(next(its[name]))
            except Exception as exc:  # noqa: BLE001
                var.error = f"decode step {k}: {type(exc).__name__}: {exc}"[:500]
                failed.add(name)
            finally:
                var.breaks += sum(counters["graph_break"].values()) - b0
                CURRENT[0] = None
                sess._execute = eager_exec
    for it in its.values():
        it.close()

    ref = seqs.get("eager")
    eager_dec = [s.seconds for s in ref[1:]] if ref else None
    for name in names:
        var, r = variants[name], rows[name]
        r["error"] = var.error
        if var.notes:
            r["notes"] = var.notes
        if name in live and name not in failed:
            dec = [s.seconds for s in seqs[name][1:]]
            r["prefill_ms"] = round(statistics.median(prefill[name] + [seqs[name][0].seconds]) * 1e3, 1)
            r["decode_ms_per_step"] = round(statistics.median(dec) * 1e3, 2)
            r["decode_ms_p25_p75"] = [round(x * 1e3, 2) for x in statistics.quantiles(dec, n=4)[::2]]
            r["decode_ms_min"] = round(min(dec) * 1e3, 2)
            r["prefill_ms_min"] = round(min(prefill[name] + [seqs[name][0].seconds]) * 1e3, 1)
            if eager_dec:
                r["decode_ratio_to_eager"] = round(statistics.median(a / b for a, b in zip(dec, eager_dec)), 3)
                r["prefill_ratio_to_eager"] = round(r["prefill_ms"] / rows["eager"]["prefill_ms"], 3)
                diffs = [_rel(s.logits, e.logits) for s, e in zip(seqs[name], ref)]
                r["logits_rel_diff_max"] = float(f"{max(diffs):.3g}")
                r["logits_rel_diff_median"] = float(f"{statistics.median(diffs):.3g}")
                r["logits_equal"] = max(diffs) <= TOLERANCE.get(dtype, 1e-5)
            r["compile_s_estimate"] = round(max(0.0, r["first_prefill_s"] - r["prefill_ms"] / 1e3)
                                            + max(0.0, (r["first_decode_s"] or 0) - r["decode_ms_per_step"] / 1e3), 1)
        r["graphs_total"] = var.graphs
        r["recompiles_after_warmup"] = var.graphs - r.get("graphs_warmup", 0)
        r["inductor_compile_s"] = round(var.backend_s, 1)
        r["graph_breaks"] = var.breaks
        r["recompile_limit_hits"] = len(var.limit_hits)
        if var.limit_hits:
            r["recompile_limit_examples"] = sorted(set(var.limit_hits))[:4]
    return {"model": str(model), "dtype": dtype, "cache_dtype": cache_dtype, "session_create_s": round(create_s, 2),
            "tolerance": TOLERANCE.get(dtype, 1e-5), "variants": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, action="append", default=None,
                    help="an exported paged model folder; repeat to run several (default: %(default)s -> "
                         f"{DEFAULT_MODEL}, exported if absent)")
    ap.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=VARIANTS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=61)
    ap.add_argument("--decode-steps", type=int, default=139)
    ap.add_argument("--warmup-steps", type=int, default=4)
    ap.add_argument("--prefill-reps", type=int, default=4)
    ap.add_argument("--emulate-precision-casts", action="store_true",
                    help="inductor's emulate_precision_casts (round low-precision intermediates as eager does)")
    ap.add_argument("--warm-cache", action="store_true", help="keep inductor's on-disk cache (compile times warm)")
    ap.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = ap.parse_args()
    if "eager" not in args.variants:
        args.variants = ["eager"] + args.variants
    if not args.warm_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="plan_compile_inductor_")

    import torch

    torch.set_num_threads(args.threads)
    dlog = logging.getLogger("torch._dynamo")
    dlog.addHandler(_DynamoLog())
    dlog.propagate = False  # dynamo's graph-break / recompile warnings are counted, not printed
    models = args.model or [default_model()]
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    results = []
    for model in models:
        print(f"{model}:", flush=True)
        res = bench_model(model, args.variants, args)
        results.append(res)
        for name, r in res["variants"].items():
            print(f"  {name:17s} prefill {r.get('prefill_ms')} ms, decode {r.get('decode_ms_per_step')} ms/step "
                  f"(x{r.get('decode_ratio_to_eager')} of eager), compile ~{r.get('compile_s_estimate')} s, "
                  f"graphs {r['graphs_total']} (+{r['recompiles_after_warmup']} after warm-up), breaks "
                  f"{r['graph_breaks']}, limit hits {r['recompile_limit_hits']}, logits diff "
                  f"{r.get('logits_rel_diff_max')}{'  ERROR ' + r['error'] if r['error'] else ''}", flush=True)
    out = {
        "command": " ".join(["python"] + sys.argv),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "loadavg_start": [round(x, 2) for x in load0],
                    "loadavg_end": [round(x, 2) for x in os.getloadavg()]},
        "threads": args.threads,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "workload": {"batch": 1, "prompt_tokens": args.prompt_tokens, "decode_steps": args.decode_steps,
                     "context": [args.prompt_tokens + 1, args.prompt_tokens + args.decode_steps],
                     "text": str(PROMPT_TEXT.relative_to(REPO)), "warmup_steps": args.warmup_steps,
                     "prefill_reps": args.prefill_reps, "emulate_precision_casts": args.emulate_precision_casts,
                     "inductor_cache": "warm" if args.warm_cache else "cold (fresh dir)"},
        "wall_s": round(time.perf_counter() - t0, 1),
        "models": results,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.output} ({out['wall_s']} s)")


if __name__ == "__main__":
    main()
