"""paged-bench's onnxruntime-genai arm (apps/bench/genai_arm.py) on the CPU:

- on a model onnxruntime-genai's builder wrote (tiny random Llama, GroupQueryAttention, CPU), the arm's engine run
  gives every request the greedy tokens of onnxruntime-genai's own Generator on the same prompt (an independent
  path through the same library), its timing fields are consistent, and a batch beyond the engine's max_batch_size
  is refused naming it;
- the CLI with `--arms pagedkit genai` on pagedkit's paged export: the arm runs, or is skipped with a one-line reason
  (onnxruntime's CPU provider has no PagedAttention kernel) while the pagedkit arm still runs; the JSON says which.
The CUDA engine (onnxruntime-genai-cuda on the device) is what issue 40 compares against; it is not run here.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

og = pytest.importorskip("onnxruntime_genai")
if not hasattr(og, "Engine"):
    pytest.skip("onnxruntime-genai without Engine (0.18 or newer)", allow_module_level=True)

from test_genai_run import build, shared_root  # noqa: E402

from pagedkit.apps.bench import cli, genai_arm  # noqa: E402
from pagedkit.apps.bench.engine_arm import Row  # noqa: E402


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory):
    return build(shared_root(tmp_path_factory), "llama", "gqa")[0]


def _generator_greedy(model_dir, prompt, n):
    cfg = og.Config(str(model_dir))
    cfg.clear_providers()
    model = og.Model(cfg)
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompt) + n, min_length=len(prompt) + n)
    gen = og.Generator(model, params)
    gen.append_tokens(np.asarray(prompt, dtype=np.int32))
    out = []
    while not gen.is_done():
        gen.generate_next_token()
        out.append(int(gen.get_next_tokens()[0]))
    return out[:n]


def test_unavailable_names_what_is_missing():
    why = genai_arm.unavailable("cuda")
    if not (hasattr(og, "is_cuda_available") and og.is_cuda_available()):
        assert why is not None and "CUDA" in why
    assert genai_arm.unavailable("cpu") is None


def test_engine_tokens_equal_the_generators(gqa_model):
    runner = genai_arm.GenaiRunner(str(gqa_model), "cpu")
    rng = np.random.default_rng(3)
    row = Row(batch=3, context=40, decode_steps=6)
    vocab = json.loads((gqa_model / "genai_config.json").read_text())["model"]["vocab_size"]
    prompts = [[int(t) for t in rng.integers(3, vocab, size=n)] for n in (row.prompt_tokens, 9, 21)]
    import time

    t = time.perf_counter()
    rec = runner.run_row(row, prompts)
    wall_ms = (time.perf_counter() - t) * 1e3
    assert [len(t) for t in rec["tokens"]] == [row.decode_steps + 1] * 3
    for p, got in zip(prompts, rec["tokens"]):
        assert got == _generator_greedy(gqa_model, p, row.decode_steps + 1)
    assert rec["decode_tokens"] == 3 * row.decode_steps and rec["decode_steps_run"] >= row.decode_steps
    assert 0 < rec["ttft_first_ms"] <= rec["ttft_ms"] and rec["prefill_steps"] >= 1
    assert rec["ms_per_step"] > 0 and rec["tokens_per_s"] > 0
    assert rec["ttft_ms"] + rec["ms_per_step_mean"] * rec["decode_steps_run"] <= wall_ms  # milliseconds, in the call
    assert rec["ms_per_step"] <= rec["ms_per_step_mean"] * rec["decode_steps_run"]
    assert rec["ttft_ms"] >= 0.01 and rec["ms_per_step"] >= 0.01  # not seconds
    assert rec["tokens_per_s"] == pytest.approx(rec["decode_tokens"] / (rec["ms_per_step_mean"] / 1e3
                                                                        * rec["decode_steps_run"]))
    too_many = Row(batch=runner.max_batch_size + 1, context=40, decode_steps=2)
    with pytest.raises(RuntimeError, match="max_batch_size"):
        runner.run_row(too_many, [[5] * too_many.prompt_tokens] * too_many.batch)


def test_cli_runs_or_skips_the_arm_with_a_reason(tiny_llama, tmp_path):
    out = tmp_path / "b"
    rc = cli.main([str(tiny_llama), "--device", "cpu", "--batches", "2", "--contexts", "40", "--decode-steps", "3",
                   "--warmup", "0", "--arms", "pagedkit", "genai", "--out", str(out), "--no-progress"])
    assert rc == 0
    res = json.loads((out / "paged_bench.json").read_text())
    assert res["settings"]["arms"] == ["pagedkit", "genai"]
    row = res["rows"][0]
    assert "tokens_per_s" in row["arms"]["pagedkit"]
    info = res["arms"]["genai"]
    if info["ran"]:
        assert "tokens_per_s" in row["arms"]["genai"] and "parity_genai" in row
    else:
        assert info["skipped"] and "\n" not in info["skipped"] and row["arms"]["genai"]["skipped"] == info["skipped"]
        assert row.get("pagedkit_over_genai") is None
