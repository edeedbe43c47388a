"""The distinct-slots promise (kernels/scope.py): the engine's and the generator's runs promise that no two
tokens write the same cache slot (KVCacheManager plans; pad rows write only the pad block), and the Triton
cache write then skips its dedup (no dedup state, DEDUP=False) with the same results. Through Triton's
interpreter on the CPU (or compiled on CUDA)."""

from __future__ import annotations

import pytest
import torch

from cases import compare_case, load_cases
from pagedkit.kernels import scope

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_scope_carries_the_promise():
    assert scope.distinct_slots() is False  # outside a scope
    with scope.run_scope():
        assert scope.distinct_slots() is False
        with scope.run_scope(distinct_slots=True):
            assert scope.distinct_slots() is True
            assert scope.memo(("k",), lambda: 3) == 3  # memo still works beside the flag
        assert scope.distinct_slots() is False
    assert scope.distinct_slots() is False


@pytest.mark.parametrize("name", ["paged_llama_fp16_rotary", "paged_int4_per_token_rotation",
                                  "paged_slot_mapping_explicit", "paged_mla_latent"])
def test_triton_write_skips_dedup_under_the_promise(monkeypatch, name):
    """Same outputs and caches with and without the promise; the dedup state is only made without it. Teeth:
    the state check fails when the promise is not passed on."""
    pytest.importorskip("triton")
    from pagedkit.kernels.triton import cache_write, paged

    made = []
    real_state = cache_write._state
    monkeypatch.setattr(cache_write, "_state", lambda dev, n: made.append(n) or real_state(dev, n))
    case = load_cases([name])[0]
    for promise in (False, True):
        inputs = {k: v if k == "attention_metadata" else v.clone().to(DEVICE) for k, v in case.inputs.items()}
        made.clear()
        with scope.run_scope(distinct_slots=promise):
            got = paged.paged_attention(inputs, outputs=list(case.expected), validate=False, **case.attrs)
        compare_case(case, {k: v.cpu() for k, v in got.items()})
        assert bool(made) is not promise, f"promise={promise}: dedup state made {len(made)} times"


def test_engine_and_generator_runs_promise_distinct_slots(tiny_llama, monkeypatch):
    from pagedkit.runtime import session as session_mod
    from pagedkit.engine import Engine, SamplingParams
    from pagedkit.runtime.generate import Generator

    seen = []
    real = session_mod.run_scope

    def spy(**kw):
        seen.append(kw.get("distinct_slots", False))
        return real(**kw)

    monkeypatch.setattr(session_mod, "run_scope", spy)
    engine = Engine(tiny_llama, "cpu", max_batch_size=2, max_num_tokens=16, cuda_graphs="padded")
    engine.generate([[1, 5, 9, 3, 7, 2, 8, 4, 6, 10, 11, 12, 13, 14, 15, 16, 17, 18], [4, 4, 2]],
                    SamplingParams(max_new_tokens=3))
    assert seen and all(seen), seen
    seen.clear()
    list(Generator(tiny_llama).greedy([1, 5, 9], max_new_tokens=2))
    assert seen and all(seen), seen
