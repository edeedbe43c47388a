"""The swapped-operand decode kernel (pagedkit/kernels/triton/_swap_kernels.py, decode.SWAP_DECODE) vs the loop-based
reference (kernels/paged/reference.py), in Triton's interpreter on CPU (compiled on CUDA): the harness of
tests/test_triton_decode.py (poisoned outputs, shuffled garbage-filled caches, max|diff| <= tol * max|ref|), with
every launch asserted to have gone through the swapped kernel, or (features it does not serve) not."""

from __future__ import annotations

import pytest
import torch

from pagedkit.kernels.triton import common

pytestmark = pytest.mark.skipif(not common.HAVE_TRITON, reason="needs triton")
if common.HAVE_TRITON:
    from test_triton_decode import TOL, base, check, errors

    from pagedkit.kernels.triton import _swap_kernels as KS
    from pagedkit.kernels.triton import decode


class _Spy:
    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.launches.append({"grid": grid, **{k: v for k, v in kw.items() if k.isupper()}})
            return self.kernel[grid](*args, **kw)
        return launch


@pytest.fixture
def swap(monkeypatch):
    """SWAP_DECODE on; the swapped kernel's launches recorded."""
    monkeypatch.setattr(decode, "SWAP_DECODE", True)
    spy = _Spy(KS._swap_decode_kernel)
    monkeypatch.setattr(KS, "_swap_decode_kernel", spy)
    return spy


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3])
def test_ragged_decode(swap, dtype, splits):
    """One token a sequence, contexts 0 .. 300, one split (the kernel writes the output) and three (partials)."""
    check(base(q_lens=[1, 1, 1, 1], past=[0, 7, 300, 33], dtype=dtype), num_splits=splits)
    assert swap.launches and swap.launches[-1]["DIRECT"] == (splits == 1)


@pytest.mark.parametrize("h,hkv,d", [(4, 4, 64), (8, 2, 128), (6, 2, 80), (16, 2, 16), (4, 1, 32)])
def test_groups_and_head_sizes(swap, h, hkv, d):
    """Groups 1 / 4 / 3 (padded) / 8 / 4 (MQA), head sizes 64 / 128 / 80 (padded) / 16 / 32."""
    check(base(num_heads=h, kv_num_heads=hkv, head_size=d, q_lens=[1, 1], past=[40, 3]), num_splits=2)
    assert swap.launches[-1]["GP"] == 8


@pytest.mark.parametrize("bs,bn", [(16, 64), (32, 32), (64, 16)])
def test_tiles_over_blocks(swap, bs, bn):
    """Tiles wider than a block (a per-key block vector), equal, narrower (one block a tile)."""
    check(base(block_size=bs, q_lens=[1, 1, 1], past=[70, 4, 130]), tiles={"block_n": bn}, num_splits=2)
    assert swap.launches[-1]["BLOCK_N"] == bn


@pytest.mark.parametrize("cache", ["int8", "float8e4m3fn"])
@pytest.mark.parametrize("kq,vq", [("PER_TENSOR", "PER_TENSOR"), ("PER_CHANNEL", "PER_CHANNEL"),
                                   ("PER_TENSOR", "PER_CHANNEL")])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_quantized_caches(swap, cache, kq, vq, dtype):
    check(base(cache=cache, k_quant=kq, v_quant=vq, dtype=dtype, head_size=64, q_lens=[1, 1, 1], past=[50, 0, 17]),
          num_splits=2)
    assert swap.launches[-1]["K_FMT"] != 0


def test_more_tokens_than_the_bound_stay_exact(swap):
    """A host bound of one token a sequence that is wrong (3 and 2 tokens) costs speed, never the result."""
    check(base(q_lens=[3, 0, 2], past=[9, 4, 30]), tiles={}, max_query_len=1, num_splits=2)
    assert swap.launches


def test_unmapped_and_extra_columns(swap):
    """Unmapped past-only blocks read as absent keys, like the general kernel (the reference skips them)."""
    check(base(q_lens=[1, 1], past=[40, 35], unmapped=((0, 1),)), num_splits=2)
    assert swap.launches


@pytest.mark.parametrize("feature", [dict(sink=True), dict(attrs={"softcap": 30.0}),
                                     dict(attrs={"local_window_size": 8}), dict(cache="int8", k_quant="PER_TOKEN",
                                                                                v_quant="PER_TOKEN"),
                                     dict(cache="int4", k_quant="PER_TENSOR", v_quant="PER_TENSOR")])
def test_features_it_does_not_serve_take_the_general_kernel(swap, feature):
    check(base(q_lens=[1, 1], past=[30, 12], **feature))
    assert not swap.launches


def test_off_by_default_flag_routes_to_the_general_kernel(swap, monkeypatch):
    monkeypatch.setattr(decode, "SWAP_DECODE", False)
    check(base(q_lens=[1, 1], past=[30, 12]))
    assert not swap.launches


@pytest.mark.parametrize("cache", ["same", "int8"])
def test_teeth_a_2_percent_wrong_scale_fails(swap, cache):
    spec = base(q_lens=[1, 1, 1], past=[60, 9, 33], cache=cache, k_quant="NONE" if cache == "same" else "PER_TENSOR",
                v_quant="NONE" if cache == "same" else "PER_TENSOR")
    good, _ = errors(spec, num_splits=2)
    assert good <= TOL[torch.float16]
    bad, _ = errors(spec, num_splits=2, scale=1.02 / 4.0)  # head 16: the default scale is 1 / 4
    assert swap.launches and bad > TOL[torch.float16], (good, bad)
