"""Tensor parallelism on NCCL (`pytest -m gpu` on a machine with >= 2 GPUs; NOT RUN YET: no multi-GPU machine was
lent to this work, see docs/distributed.md). The same checks as the CPU ones (tests/test_tp_run.py) on CUDA:
TP = 2 on NCCL gives the single-GPU export's logits within 1e-3 x max|ref| and its greedy tokens (fp32 exports);
the engine at TP = 2 gives the single-GPU engine's greedy tokens; the collectives are CUDA-graph capturable (an
all-reduce and an all-gather captured on each rank, replayed over new inputs, give the sums / concatenations of
those inputs)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

import tp_harness as H

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.fixture(autouse=True)
def two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs (NCCL), this machine has {torch.cuda.device_count()}")


def test_tp2_nccl_matches_single_gpu(tmp_path):
    from pagedkit.runtime.distributed import TensorParallel
    from pagedkit.runtime.generate import Generator

    one, two = H.export_pair(H.Case("LlamaConfig").model(), tmp_path)
    ref = list(Generator(one, device="cuda").greedy(H.PROMPT, H.STEPS, stop_at_eos=False))
    with TensorParallel(2, device="cuda", timeout=120) as tp:
        got = Generator(two, session=tp.session(two)).teacher_forced(H.PROMPT, [r.token for r in ref])
    print("nccl:", H.compare(ref, got))


def test_engine_tp2_nccl(tmp_path):
    from pagedkit.engine import Engine
    from test_tp_engine import _generate

    one, two = H.export_pair(H.Case("LlamaConfig", seed=5).model(), tmp_path)
    ref = _generate(Engine(one, "cuda", max_batch_size=4, max_num_tokens=48, cuda_graphs=False))
    assert _generate(Engine(two, "cuda", max_batch_size=4, max_num_tokens=48, tp=2)) == ref


def _capture(rank: int, store: str, out: str) -> None:
    from pagedkit.runtime.distributed import group

    torch.cuda.set_device(rank)
    g = group.init(rank, 2, store, torch.device("cuda", rank), 60)
    x = torch.zeros(4, 8, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside the capture (NCCL communicator set up)
        g.all_reduce(x), g.all_gather(x, 1)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, z = g.all_reduce(x), g.all_gather(x, 1)
    results = []
    for step in range(3):
        x.copy_(torch.full((4, 8), float(10 * step + rank + 1), device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        results.append((y.clone().cpu(), z.clone().cpu()))
    torch.save(results, f"{out}.{rank}")
    group.close()


def test_collectives_are_capturable():
    folder = tempfile.mkdtemp()
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_capture, args=(r, os.path.join(folder, "store"), os.path.join(folder, "out")))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    for r in range(2):
        for step, (y, z) in enumerate(torch.load(os.path.join(folder, f"out.{r}"))):
            a, b = 10 * step + 1, 10 * step + 2
            assert torch.equal(y, torch.full((4, 8), float(a + b)))
            assert torch.equal(z, torch.cat([torch.full((4, 8), float(a)), torch.full((4, 8), float(b))], 1))
