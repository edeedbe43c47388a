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
