"""The skinny decode product (kernels/triton/skinny.py; on CPU through Triton's interpreter) against a float64
oracle: y[m, n] = sum_k x[m, k] * W[n, k] (a float64 loop over K, no shared code). Shapes: rows 1 .. 32, N not a
multiple of the tile, K not a multiple of the K tile, a strided x (a view of a wider buffer), float16 and
bfloat16; outputs poisoned (NaN) by a first call on another input. Teeth: a 2% wrong result and a dropped K
tile fail the same bound. The CUDA MatMul route (runtime/ops/math.py) and graph replay = eager on the GPU
(gpu mark)."""

from __future__ import annotations

import pytest
import torch

from pagedkit.kernels.triton import common

pytestmark = pytest.mark.skipif(not common.HAVE_TRITON, reason="needs triton")
if common.HAVE_TRITON:
    from pagedkit.kernels.triton import skinny

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _oracle(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xd, wd = x.double().cpu().reshape(-1, x.shape[-1]), w.double().cpu()
    out = torch.zeros((xd.shape[0], wd.shape[0]), dtype=torch.float64)
    for k in range(xd.shape[1]):  # a loop over K: rank-1 updates in float64
        out += xd[:, k:k + 1] * wd[:, k][None, :]
    return out.reshape(*x.shape[:-1], w.shape[0])


def _rel(a, b):
    return float((a.double().cpu() - b).abs().max() / b.abs().max())


CASES = [(1, 40, 64, None), (5, 100, 96, (16, 32, 1, 4)), (16, 64, 1040, None), (17, 33, 48, (32, 16, 2, 4)),
         (32, 48, 512, (16, 128, 3, 2))]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,tile", CASES)
def test_skinny_matches_float64_oracle(dtype, m, n, k, tile):
    torch.manual_seed(m * 7 + n + k)
    wide = torch.randn(m, k + 16).to(dtype).to(DEVICE)
    x = wide[:, 8:8 + k]  # row stride k + 16
    w = (torch.randn(n, k) / k ** 0.5).to(dtype).to(DEVICE)
    assert skinny.serves(x, w)
    skinny.skinny_matmul(torch.full_like(x, float("nan")), w, tile)  # poison the allocator's next block
    out = skinny.skinny_matmul(x, w, tile)
    assert out.shape == (m, n) and out.dtype == dtype and torch.isfinite(out).all()
    ref = _oracle(x, w)
    assert _rel(out, ref) <= TOL[dtype]
    # teeth: the same bound catches a 2% wrong scale and a product that drops one K tile
    assert _rel(out.double().cpu() * 1.02, ref) > TOL[dtype]
    bk = (tile or skinny.pick_tile(m, n, k))[1]
    if k > bk:
        x_cut = x.clone()
        x_cut[:, :bk] = 0
        assert _rel(skinny.skinny_matmul(x_cut, w, tile), ref) > TOL[dtype]


def test_serves_refuses_what_it_does_not_run():
    w = torch.randn(8, 32, dtype=torch.float16, device=DEVICE)
    assert not skinny.serves(torch.randn(33, 32, dtype=torch.float16, device=DEVICE), w)  # > MAX_ROWS rows
    assert not skinny.serves(torch.randn(2, 32, device=DEVICE), w)  # float32
    assert not skinny.serves(torch.randn(2, 24, dtype=torch.float16, device=DEVICE), torch.randn(
        8, 24, dtype=torch.float16, device=DEVICE))  # K not a multiple of 16
    assert not skinny.serves(torch.randn(2, 32, dtype=torch.bfloat16, device=DEVICE), w)  # dtype mismatch


def test_pick_tile_override(monkeypatch):
    monkeypatch.setattr(skinny, "TILE", (32, 64, 2, 8))
    assert skinny.pick_tile(1, 2048, 2048) == (32, 64, 2, 8)
    with pytest.raises(ValueError, match="PAGEDKIT_SKINNY_TILE"):
        skinny._tile("16x512")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pdl", [False, True])
def test_graph_replay_equals_eager_and_oracle_gpu(monkeypatch, pdl):
    """Llama-3.2-1B decode shapes: a CUDA-graph replay of the skinny product (PDL on / off) is bit-identical to
    the eager call, and both agree with the float64 oracle on a sampled slice of the output columns."""
    monkeypatch.setattr(common, "PDL", pdl)
    torch.manual_seed(3)
    for m, n, k in [(1, 3072, 2048), (8, 2048, 8192), (32, 16384, 2048)]:
        x = torch.randn(m, k, dtype=torch.float16, device="cuda")
        w = (torch.randn(n, k, device="cuda") / k ** 0.5).half()
        eager = skinny.skinny_matmul(x, w)
        torch.cuda.synchronize()
        static_y = [None]
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static_y[0] = skinny.skinny_matmul(x, w)
        static_y[0].fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y[0], eager)
        cols = torch.randperm(n)[:64]
        assert _rel(eager[:, cols], _oracle(x, w[cols])) <= TOL[torch.float16]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matmul_route_gpu():
    """runtime/ops/math.py on CUDA: a constant float16 B is prepacked [N, K]; decode-sized rows take the skinny
    kernel, larger ones cuBLAS; both agree with the oracle."""
    from pagedkit.runtime.ops import math as mops
    from pagedkit.runtime.ops.registry import OpContext

    b = (torch.randn(256, 384) / 16).half()
    packed = mops._prepack_matmul([None, b], {}, OpContext(device="cuda"))[1]
    assert isinstance(packed, mops._CudaLinear) and packed.weight.shape == (384, 256)
    for rows in (3, 40):
        a = torch.randn(rows, 256, dtype=torch.float16, device="cuda")
        assert _rel(mops.matmul([a, packed], {}, None)[0], _oracle(a, b.T)) <= TOL[torch.float16]
