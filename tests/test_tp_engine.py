"""The engine on a tensor-parallel set: `Engine(folder, tp=2)` (this process rank 0: scheduler, KV manager,
sampling; one follower process on gloo) gives the same greedy tokens as the engine on the single-device export of
the same tiny Llama, over a batch that mixes chunked prefills, decodes, and a speculative request whose rejected
drafts are rolled back."""

from __future__ import annotations

import pytest

import tp_harness as H

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

PROMPTS = [H.PROMPT[:5], H.PROMPT, H.PROMPT + H.PROMPT[:14], (H.PROMPT * 3)[:41]]


def _generate(engine) -> list[list[int]]:
    from pagedkit.engine.params import SamplingParams

    params = [SamplingParams(max_new_tokens=8, ignore_eos=True, num_draft_tokens=2 if i == 3 else 0)
              for i in range(len(PROMPTS))]
    try:
        return [o.token_ids for o in engine.generate(PROMPTS, params)]
    finally:
        engine.close()


def test_engine_tp2_same_greedy_tokens(tmp_path):
    from pagedkit.engine import Engine

    one, two = H.export_pair(H.Case("LlamaConfig", seed=5).model(), tmp_path)
    kw = dict(max_batch_size=4, max_num_tokens=48)
    ref = _generate(Engine(one, **kw))
    engine = Engine(two, tp=2, **kw)
    assert engine.model.tp is not None and engine.model.tp.world == 2
    got = _generate(engine)
    assert got == ref and all(len(t) == 8 for t in ref)
    print("engine tokens", ref)


def test_engine_refuses_a_world_size_the_folder_is_not(tmp_path):
    from pagedkit.engine import Engine

    one, two = H.export_pair(H.Case("LlamaConfig", seed=5).model(), tmp_path)
    with pytest.raises(ValueError, match="tensor-parallel export of 2 ranks: run it with --tp 2"):
        Engine(two, tp=4)
    with pytest.raises(ValueError, match="single-device export: run it without --tp"):
        Engine(one, tp=2)


def test_paged_serve_on_two_ranks(tmp_path):
    """paged-serve's app over Engine(tp=2) on the tiny served model (tests/test_serve_helpers.py: the tiny Llama and
    its word-level tokenizer), fp32: a greedy completion is the single-device server's, word for word."""
    import httpx

    from pagedkit.apps.serve import create_app
    from pagedkit.apps.serve.tokenizer import load_tokenizer
    from pagedkit.engine import Engine
    from test_serve_helpers import ServerThread, write_tokenizer

    from export_utils import tiny_model

    one, two = H.export_pair(tiny_model("LlamaConfig"), tmp_path)
    body = {"model": "m", "prompt": "hello world the cat", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    texts = []
    for folder, tp in ((one, None), (two, 2)):
        write_tokenizer(folder)
        engine = Engine(folder, max_batch_size=4, max_num_tokens=64, tp=tp)
        try:
            with ServerThread(create_app(engine, load_tokenizer(folder), "m")) as url:
                r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
                assert r.status_code == 200, r.text
                texts.append(r.json()["choices"][0]["text"])
        finally:
            engine.close()
    assert texts[0] == texts[1] and texts[0].strip()
    print("served:", texts[0])
