"""The onnxruntime-genai-style wrapper over the engine (pagedkit/engine/genai.py), and the runnable
example of docs/engine.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pagedkit.engine import SamplingParams
from pagedkit.engine.genai import Generator, GeneratorParams, Model
import test_engine
from test_engine import assert_pool_free, assert_same_greedy, prompts_of

oracle = test_engine.oracle  # the session fixture (tiny_llama: conftest.py)
REPO = Path(__file__).resolve().parents[1]


def test_interleaved_generators_equal_alone(tiny_llama, oracle):
    model = Model(tiny_llama, max_batch_size=4)
    prompts = prompts_of((6, 21, 3), seed=40)
    gens = []
    for p, n in zip(prompts, (8, 5, 10)):
        params = GeneratorParams(model)
        params.set_search_options(max_length=len(p) + n, do_sample=False, ignore_eos=True)
        g = Generator(model, params)
        g.append_tokens(p)
        gens.append(g)
    streamed = [[] for _ in gens]
    while not all(g.is_done() for g in gens):
        for i, g in enumerate(gens):
            if not g.is_done():
                g.generate_next_token()
                streamed[i].append(g.get_next_tokens()[0])
    for g, s, p, n in zip(gens, streamed, prompts, (8, 5, 10)):
        assert g.get_sequence(0) == p + s and len(s) == n and g.finish_reason == "length"
        assert_same_greedy(s, oracle, p, n, "genai wrapper", ignore_eos=True)
    assert model.engine.stats.max_batch > 1
    assert_pool_free(model.engine)


def test_wrapper_errors(tiny_llama):
    model = Model(tiny_llama, max_batch_size=2)
    params = GeneratorParams(model)
    with pytest.raises(ValueError, match=r"unsupported option\(s\) \['num_beams'\]"):
        params.set_search_options(num_beams=4)
    params.set_search_options(max_length=3)
    g = Generator(model, params)
    g.append_tokens([1, 2, 3])
    with pytest.raises(ValueError, match="max_length 3 must exceed the prompt length 3"):
        g.generate_next_token()
    params.set_search_options(max_length=5, do_sample=True, temperature=0.9, random_seed=3, ignore_eos=True)
    g = Generator(model, params)
    g.append_tokens([1, 2, 3])
    g.generate_next_token()
    with pytest.raises(NotImplementedError, match="append_tokens after generation started"):
        g.append_tokens([4])
    g.generate_next_token()
    assert g.is_done() and len(g.get_sequence(0)) == 5
    same = model.engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, temperature=0.9, seed=3,
                                                             ignore_eos=True))[0]
    assert g.get_sequence(0)[3:] == same.token_ids


def test_docs_example_runs(capsys, monkeypatch):
    text = (REPO / "docs/engine.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks
    monkeypatch.chdir(REPO)
    for code in blocks:
        exec(compile(code, "docs/engine.md", "exec"), {})
    out = capsys.readouterr().out
    assert "128 [2] 128 {'full': 32}" in out and "EngineStats(" in out
