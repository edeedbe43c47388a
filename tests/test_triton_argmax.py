"""The two-launch row argmax (kernels/triton/argmax.py; on CPU through Triton's interpreter) against a plain
Python loop oracle: the first index of the largest value, NaN above everything, -0.0 equal to +0.0. Rows span
several chunks (V not a multiple of CHUNK), ties sit in different chunks, rows are strided views. Teeth: the
kernel's result with the key's index part reversed (ties to the last index) or without the -0.0 fold fails."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")  # under CI a failure (conftest.py)
from pagedkit.kernels.triton import argmax  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _oracle(x: torch.Tensor) -> list[int]:
    out = []
    for row in x.double().cpu().tolist():
        best, at = None, 0
        for i, v in enumerate(row):
            if math.isnan(v):
                best, at = v, i
                break
            if best is None or v > best:  # strictly greater: the first of equal values stays
                best, at = v, i
        out.append(at)
    return out


def _cases(dtype):
    g = torch.Generator().manual_seed(7)
    v = 2 * argmax.CHUNK + 333
    x = torch.randn(6, v, generator=g) * 4
    x[1, 5] = x[1, argmax.CHUNK + 9] = x[1].max() + 1  # a tie across chunks: the first wins
    x[2] = -torch.rand(v, generator=g) - 1  # all negative
    x[2, v - 1] = -0.5
    x[3] = 0.0
    x[3, :17] = -1.0
    x[3, 17] = -0.0  # equal to the +0.0 values after it: 17 wins
    x[4, argmax.CHUNK + 40] = float("nan")
    x[4, 3] = float("inf")
    x[5] = float("-inf")
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_argmax_rows_matches_loop_oracle(dtype):
    x = _cases(dtype).to(DEVICE)
    want = _oracle(x)
    got = argmax.argmax_rows(x)
    assert got.dtype == torch.int64 and got.device == x.device
    assert got.cpu().tolist() == want
    assert want[3] == 17 and want[1] == 5 and want[4] == argmax.CHUNK + 40 and want[5] == 0  # the oracle's view


def test_argmax_rows_random_and_strided():
    torch.manual_seed(3)
    for v in (1, 5, argmax.CHUNK, argmax.CHUNK + 1, 3 * argmax.CHUNK - 7):
        base = torch.randn(4, v + 3).half().to(DEVICE)
        view = base[:, 2:2 + v]  # row stride v + 3
        assert argmax.argmax_rows(view).cpu().tolist() == _oracle(view)
        coarse = (base * 2).round().to(DEVICE)  # many ties
        assert argmax.argmax_rows(coarse).cpu().tolist() == _oracle(coarse)


def test_argmax_rows_refuses_other_ranks():
    with pytest.raises(ValueError, match=r"logits: expected \[R, V\]"):
        argmax.argmax_rows(torch.zeros(3))


def test_argmax_teeth():
    """The oracle separates the kernel from near-misses: ties to the last index, and -0.0 ordered below +0.0."""
    x = _cases(torch.float32)
    want = _oracle(x)
    last_tie = [len(r) - 1 - int(torch.argmax(torch.flip(r, [0]))) for r in x.nan_to_num(nan=float("inf"))]
    assert last_tie != want
    signed = [int(torch.argmax(torch.where((r == 0) & (torch.sign(1 / r) < 0), -1e-30, r))) for r in x]
    assert signed != want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_argmax_rows_cuda_vocab_rows(dtype):
    """A decode step's logits on the GPU ([R, 128256], ties planted across chunks) against torch's CPU argmax."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(33, 128256, generator=g) * 3).to(dtype)
    x[::3, 70000] = x[::3, 1234] = 1e3  # ties: 1234 first
    got = argmax.argmax_rows(x.cuda())
    assert got.cpu().tolist() == x.float().argmax(-1).tolist()
    assert got[0].item() == 1234


class _Spy:
    """Stands in for a @triton.jit kernel: records each launch's grid and forwards it."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return self.kernel[grid]


def test_the_triton_kernels_run_and_the_fallbacks_do_not(monkeypatch):
    """argmax_rows launches its two kernels (one chunk program a row and chunk, one final program a row); an empty
    tensor and an integer tensor take torch.argmax without a launch."""
    chunk, final = _Spy(argmax._argmax_chunk_kernel), _Spy(argmax._argmax_final_kernel)
    monkeypatch.setattr(argmax, "_argmax_chunk_kernel", chunk)
    monkeypatch.setattr(argmax, "_argmax_final_kernel", final)
    x = _cases(torch.float32).to(DEVICE)
    assert argmax.argmax_rows(x).cpu().tolist() == _oracle(x)
    assert chunk.grids == [(6, 3)] and final.grids == [(6,)]
    for other in (torch.zeros(0, 5), torch.tensor([[1, 4, 4, 0], [3, 2, 1, 0]], dtype=torch.int32)):
        assert argmax.argmax_rows(other.to(DEVICE)).cpu().tolist() == other.argmax(-1).tolist()
    assert len(chunk.grids) == 1 and len(final.grids) == 1
