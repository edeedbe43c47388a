"""Windowed decode steps whose first in-window key sits at a KV tile edge, and one key before / after it, against
the float64 oracle (tests/paged_oracle.py: dense masked attention over each sequence's contiguous context, no
pages, no tiles):

- the Triton launches (write_kv, then the split-KV kernel from the chunk's first window tile `t_lo`), at KV tiles
  smaller than, equal to and larger than the 32-token block (tile = the kernel's block_n), one split and several;
- the torch variants (the loop reference, torch_sdpa's block ranges, torch_planned's per-item key ranges) at the
  block edges of the same steps;
- teeth: copies of the kernel / variant modules with the window's first key moved by one (the kernel's first
  tile, the key mask; torch_sdpa's first block, torch_planned's first key) each fail the comparison.

Each step holds decode sequences whose first row's first in-window key (past + 1 - W) is tile * k - 1, tile * k
and tile * k + 1, a 3-token step starting at an edge, and a 3-token step whose LAST row starts at an edge."""

from __future__ import annotations

import math
import os

import pytest

from mutants import mutant
from paged_oracle import Spec, build, clone_inputs, oracle, rel_err

triton = pytest.importorskip("triton") if not os.environ.get("CI") else __import__("triton")  # CI: never skip

from pagedkit.kernels.paged import reference, torch_planned, torch_sdpa  # noqa: E402
from pagedkit.kernels.triton import _decode_kernels, common, decode  # noqa: E402
from pagedkit.kernels.triton.cache_write import write_kv  # noqa: E402

FLOAT = common.SideFormat(common.FMT_FLOAT, common.SCALE_NONE)
BS = 32  # cache block size; the kernel's KV tile (block_n) is set apart from it
TOL = 2e-3  # fp16 output rounding: 2**-11 of the largest element (the reference's bound, tests/test_reference_paged)


def edge_spec(window: int, tile: int, seed: int = 0) -> Spec:
    """Five sequences: decode rows whose first in-window key is 2 * tile - 1, 2 * tile, 2 * tile + 1; a 3-token
    step whose first row's first key is 3 * tile; a 3-token step whose last row's first key is 3 * tile."""
    firsts = [2 * tile - 1, 2 * tile, 2 * tile + 1, 3 * tile, 3 * tile - 2]
    q_lens = [1, 1, 1, 3, 3]
    past = [f + window - 1 for f in firsts]
    offsets = sorted({(p + 1 - window) % tile for p in past[:3]})
    assert offsets == sorted({tile - 1, 0, 1}), offsets  # the edge and one key either side of it
    return Spec(q_lens=q_lens, past=past, num_heads=2, kv_num_heads=1, head_size=16, block_size=BS,
                rotary="half", attrs={"local_window_size": window}, seed=seed)


def _triton_step(case, *, tile: int, splits: int):
    """write_kv then the attention over the case (a copy of its caches)."""
    x, a = clone_inputs(case.inputs), case.attrs
    h, hkv, d = a["num_heads"], a["kv_num_heads"], case.spec.head_size
    kw = dict(key_cache=x["key_cache"], value_cache=x["value_cache"], k_format=FLOAT, v_format=FLOAT,
              cumulative_sequence_length=x["cumulative_sequence_length"], past_seqlens=x["past_seqlens"],
              block_table=x["block_table"], num_heads=h, kv_num_heads=hkv, head_size=d, v_head_size=d,
              scale=1.0 / math.sqrt(d), k_scale=None, v_scale=None, k_scale_cache=None, v_scale_cache=None,
              query_positions=None, softcap=0.0, local_window_size=a["local_window_size"], is_causal=True,
              head_sink=None, attention_bias=None, qk_output=0, v_rotation=False, max_query_len=3, max_kv_len=0,
              num_splits=splits, block_n=tile)
    cos, sin = x["cos_cache"], x["sin_cache"]
    q = write_kv(x["query"], x["key"], x["value"], num_heads=h, kv_num_heads=hkv, head_size=d,
                 cumulative_sequence_length=x["cumulative_sequence_length"], past_seqlens=x["past_seqlens"],
                 block_table=x["block_table"], key_cache=x["key_cache"], value_cache=x["value_cache"],
                 k_format=FLOAT, v_format=FLOAT, cos_cache=cos, sin_cache=sin, unique_slots=True)
    return decode._paged_decode(q, **kw)[0]


TRITON_CASES = [  # (window, tile, splits): tiles below, at and above the 32-token block
    (7, 16, 1), (40, 16, 3), (7, 32, 3), (40, 32, 1), (7, 64, 1), (40, 64, 3),
]


@pytest.mark.parametrize("window,tile,splits", TRITON_CASES)
def test_window_edge_triton_equals_the_oracle(window, tile, splits):
    case = build(edge_spec(window, tile, seed=window + tile))
    want = oracle(case)["output"]
    got = _triton_step(case, tile=tile, splits=splits)
    assert rel_err(got, want) <= TOL, rel_err(got, want)


TORCH_VARIANTS = {"reference": reference, "torch_sdpa": torch_sdpa, "torch_planned": torch_planned}


@pytest.mark.parametrize("window", [7, 40])
@pytest.mark.parametrize("variant", list(TORCH_VARIANTS))
def test_window_edge_torch_variants_equal_the_oracle(variant, window):
    """The torch variants' ranges are per block (torch_sdpa) or per key (torch_planned): edges of the block."""
    case = build(edge_spec(window, BS, seed=window))
    got = TORCH_VARIANTS[variant].paged_attention(clone_inputs(case.inputs), outputs=["output"], **case.attrs)
    assert rel_err(got["output"], oracle(case)["output"]) <= TOL


# --- teeth: the window's first key moved by one ---------------------------------------------------------------


KERNEL_MUTANTS = {  # the first window tile t_lo; the per-key mask
    "first tile one key late": ("2147483647 - window), 0) - window + 1, 0)",
                                "2147483647 - window), 0) - window + 2, 0)"),
    "mask one key early": ("allowed = allowed & (kp[None, :] >= pos[:, None] - window + 1)",
                           "allowed = allowed & (kp[None, :] >= pos[:, None] - window)"),
    "mask one key late": ("allowed = allowed & (kp[None, :] >= pos[:, None] - window + 1)",
                          "allowed = allowed & (kp[None, :] >= pos[:, None] - window + 2)"),
}


@pytest.mark.parametrize("name", list(KERNEL_MUTANTS))
def test_teeth_kernel_window_off_by_one(name, tmp_path, monkeypatch):
    import pagedkit.kernels.triton as pkg

    old, new = KERNEL_MUTANTS[name]
    window, tile, splits = 7, 16, 1
    case = build(edge_spec(window, tile, seed=window + tile))
    want = oracle(case)["output"]
    monkeypatch.setattr(pkg, "_decode_kernels", mutant(_decode_kernels, [(old, new)], tmp_path, monkeypatch))
    got = _triton_step(case, tile=tile, splits=splits)
    assert rel_err(got, want) > 10 * TOL, rel_err(got, want)


TORCH_MUTANTS = {
    "torch_sdpa first block one key late": (torch_sdpa, "lo = max(0, step.past[b] + j0 - window + 1)",
                                            "lo = max(0, step.past[b] + j0 - window + 2)"),
    "torch_planned first key one late": (torch_planned, "lo = [max(0, past[b] + j0 - window + 1) if window",
                                         "lo = [max(0, past[b] + j0 - window + 2) if window"),
    "reference mask one key early": (reference, "allowed &= kpos[None, :] >= qpos - window + 1",
                                     "allowed &= kpos[None, :] >= qpos - window"),
}


@pytest.mark.parametrize("name", list(TORCH_MUTANTS))
def test_teeth_torch_window_off_by_one(name, tmp_path, monkeypatch):
    module, old, new = TORCH_MUTANTS[name]
    case = build(edge_spec(7, BS, seed=7))
    bad = mutant(module, [(old, new)], tmp_path, monkeypatch)
    got = bad.paged_attention(clone_inputs(case.inputs), outputs=["output"], **case.attrs)
    assert rel_err(got["output"], oracle(case)["output"]) > 10 * TOL
