"""paged-serve on the GPU (`pytest -m gpu` on the H200): the OpenAI-compatible server over the real engine on CUDA
(decode steps as CUDA-graph replays) with a tiny exported Llama (vocab 144) and a word-level tokenizer, called
through a real HTTP client. Concurrent greedy completions (half streamed) each equal the same request run alone
on the same server; the streamed text equals the plain one; `paged-serve MODEL_DIR --device cuda` as a subprocess
serves the same text as the in-process CUDA engine. Teeth: a request with a different prompt gives another text
(the comparisons can fail)."""

from __future__ import annotations

import asyncio

import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from pagedkit.engine import Engine  # noqa: E402
from pagedkit.apps.serve import create_app  # noqa: E402
from pagedkit.apps.serve.tokenizer import load_tokenizer  # noqa: E402
from test_serve_helpers import ServeCommand, ServerThread, completion_text, tiny_served_model  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
PROMPTS = ["hello", "the cat sat on the mat", "a dog", "world hello world", "t40 t41 t42", "mat mat"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_served_model(tmp_path_factory.mktemp("serve_gpu") / "tiny-llama")


@pytest.fixture(scope="module")
def engine(model_dir):
    return Engine(model_dir, "cuda", max_batch_size=8, max_num_tokens=128)


@pytest.fixture(scope="module")
def url(model_dir, engine):
    with ServerThread(create_app(engine, load_tokenizer(model_dir), model_dir.name)) as base:
        yield base


def _reqs():
    return [{"prompt": p, "max_tokens": 10 + 3 * i, "temperature": 0, "ignore_eos": True}
            for i, p in enumerate(PROMPTS)]


def _alone(url: str, req: dict) -> str:
    return httpx.post(f"{url}/v1/completions", json=req, timeout=120).json()["choices"][0]["text"]


def test_concurrent_cuda_requests_equal_alone(url, engine):
    reqs = _reqs()
    alone = [_alone(url, r) for r in reqs]
    assert len(set(alone)) > 1 and all(alone)  # teeth: different prompts give different texts

    async def together():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return await asyncio.gather(*(completion_text(client, r, stream=i % 2) for i, r in enumerate(reqs)))

    engine.stats.max_batch = 0
    got = asyncio.run(together())
    assert got == alone
    assert engine.stats.max_batch > 1  # they were batched together
    assert engine.check_invariants() == []


def test_streamed_equals_plain_on_cuda(url):
    req = _reqs()[1]

    async def streamed():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return await completion_text(client, req, stream=True)

    assert asyncio.run(streamed()) == _alone(url, req)


def test_paged_serve_command_on_cuda(model_dir, url):
    options = ("--device", "cuda", "--max-batch-size", "4", "--log-level", "warning")
    with ServeCommand(model_dir, *options, timeout=180) as base:
        assert httpx.get(f"{base}/v1/models").json()["data"][0]["id"] == "tiny-llama"
        for req in _reqs()[:3]:
            assert _alone(base, req) == _alone(url, req)
