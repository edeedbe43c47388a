"""pagedkit.kernels.quant: int8 / fp8 / int4 codes, nibble packing, per-token scales, Walsh-Hadamard."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from pagedkit.kernels import quant


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# int8
# ---------------------------------------------------------------------------------------------


def test_int8_round_trip_and_rint():
    x = torch.randn(4, 3, 32, generator=_gen(0), dtype=torch.float32) * 2.0
    s = float(x.abs().max()) / 127
    codes = quant.quantize(x, s, "int8")
    assert codes.dtype == torch.int8 and codes.shape == x.shape
    back = quant.dequantize(codes, s, "int8")
    assert float((back - x).abs().max()) <= s / 2 * (1 + 1e-6)
    # independent oracle: numpy rint (half to even) and clip
    ref = np.clip(np.rint(x.double().numpy() / s), -128, 127).astype(np.int8)
    assert np.array_equal(codes.numpy(), ref)
    # exact halves round to even
    halves = torch.tensor([2.5, 3.5, -2.5, -3.5, 0.5, -0.5])
    assert quant.quantize_int8(halves, 1.0).tolist() == [2, 4, -2, -4, 0, 0]


def test_int8_clamps():
    x = torch.tensor([1000.0, -1000.0, 127.4, -128.4, 126.6])
    assert quant.quantize_int8(x, 1.0).tolist() == [127, -128, 127, -128, 127]


# ---------------------------------------------------------------------------------------------
# fp8 E4M3
# ---------------------------------------------------------------------------------------------


def test_fp8_matches_ml_dtypes_cast_and_clamps():
    x = torch.randn(2, 5, 64, generator=_gen(1)) * 40
    x[0, 0, :4] = torch.tensor([1e6, -1e6, 449.0, -460.0])
    s = 0.25
    stored = quant.quantize(x, s, "float8e4m3fn")
    assert stored.dtype == torch.float8_e4m3fn
    ref = np.clip(x.double().numpy() / s, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    assert np.array_equal(stored.view(torch.uint8).numpy(), ref.view(np.uint8))
    assert stored[0, 0, :4].float().tolist() == [448.0, -448.0, 448.0, -448.0]
    back = quant.dequantize(stored, s, "float8e4m3fn")
    inside = (x / s).abs() < 448
    rel = ((back - x).abs() / x.abs().clamp_min(1e-3))[inside & ((x / s).abs() > 2 ** -6)]
    assert float(rel.max()) <= 2 ** -4 * (1 + 1e-6)  # 3 mantissa bits: half an ulp


# ---------------------------------------------------------------------------------------------
# int4
# ---------------------------------------------------------------------------------------------


def test_int4_nibble_layout_hand_packed():
    codes = torch.tensor([-8, 7, 0, 1, -1, 3], dtype=torch.int8)
    # nibbles q + 8 = [0, 15, 8, 9, 7, 11]; element 2i low, 2i+1 high
    packed = quant.pack_int4(codes)
    assert packed.dtype == torch.uint8
    assert packed.tolist() == [0xF0, 0x98, 0xB7]
    assert quant.unpack_int4(packed, 6).tolist() == codes.tolist()


def test_int4_odd_size_pads_last_byte():
    codes = torch.tensor([[1, -2, 5]], dtype=torch.int8)  # nibbles 9, 6, 13 (+ pad 8 = code 0)
    packed = quant.pack_int4(codes)
    assert packed.shape == (1, 2) and packed.tolist() == [[0x69, 0x8D]]
    assert quant.unpack_int4(packed, 3).tolist() == codes.tolist()
    assert quant.stored_width("int4", 3) == 2 and quant.stored_width("int8", 3) == 3


def test_int4_round_trip_and_clamp():
    x = torch.randn(3, 2, 16, generator=_gen(2))
    s = float(x.abs().max()) / 7
    stored = quant.quantize(x, s, "int4")
    assert stored.shape == (3, 2, 8) and stored.dtype == torch.uint8
    ref = np.clip(np.rint(x.double().numpy() / s), -8, 7).astype(np.int8)
    assert np.array_equal(quant.unpack_int4(stored, 16).numpy(), ref)
    back = quant.dequantize(stored, s, "int4", 16)
    assert float((back - x).abs().max()) <= s / 2 * (1 + 1e-6)
    assert quant.quantize_int4(torch.tensor([100.0, -100.0, 7.6, -8.4]), 1.0).tolist() == [7, -8, 7, -8]


def test_int4_pack_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        quant.pack_int4(torch.tensor([8], dtype=torch.int8))
    with pytest.raises(ValueError, match="head_size 6"):
        quant.unpack_int4(torch.zeros(2, dtype=torch.uint8), 6)


# ---------------------------------------------------------------------------------------------
# scales
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,qmax", [("int8", 127), ("float8e4m3fn", 448), ("int4", 7)])
def test_per_token_scale_rounded_to_scale_dtype(fmt, qmax):
    x = torch.randn(5, 2, 32, generator=_gen(3)) * 3
    x[1, 0] = 0.0  # amax 0 -> scale 1, codes 0
    s = quant.per_token_scale(x, fmt, torch.float16)
    assert s.shape == (5, 2, 1) and s.dtype == torch.float16
    ref = (x.double().abs().amax(-1, keepdim=True) / qmax).to(torch.float16)
    ref[1, 0] = 1.0
    assert torch.equal(s, ref)
    stored = quant.quantize(x, s.float(), fmt)  # codes use the stored (rounded) scale
    back = quant.dequantize(stored, s.float(), fmt, 32)
    assert float(back[1, 0].abs().max()) == 0.0
    peak = (back.abs().amax(-1) / x.abs().amax(-1).clamp_min(1e-30))[torch.arange(5) != 1]
    assert float((peak - 1).abs().max()) < 2e-3  # the amax element maps to +-qmax (up to scale rounding)
    assert quant.per_token_scale(x, fmt, torch.float32).dtype == torch.float32


def test_static_scale_shapes():
    assert quant.static_scale(torch.tensor([0.5]), "PER_TENSOR", 2, 8).shape == (1, 1)
    ch = torch.arange(16, dtype=torch.float32).reshape(2, 1, 8)
    assert torch.equal(quant.static_scale(ch, "PER_CHANNEL", 2, 8), ch.reshape(2, 8))
    with pytest.raises(ValueError, match=r"\(2, 1, 8\)"):
        quant.static_scale(torch.ones(8), "PER_CHANNEL", 2, 8)
    with pytest.raises(ValueError, match="PER_TENSOR or PER_CHANNEL"):
        quant.static_scale(torch.ones(1), "PER_TOKEN", 2, 8)


def test_unknown_format_is_an_error():
    with pytest.raises(ValueError, match="uint4"):
        quant.quantize(torch.ones(4), 1.0, "uint4")


# ---------------------------------------------------------------------------------------------
# Walsh-Hadamard
# ---------------------------------------------------------------------------------------------


def test_hadamard_sylvester_order_and_orthonormal():
    h4 = quant.hadamard_matrix(4, torch.float64)
    expected = torch.tensor([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]], dtype=torch.float64) / 2
    assert torch.equal(h4, expected)
    for n in (1, 2, 8, 64, 128):
        h = quant.hadamard_matrix(n, torch.float64)
        assert torch.allclose(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-12, rtol=0)
        assert torch.equal(h, h.T)
        assert torch.allclose(h.abs(), torch.full((n, n), 1 / math.sqrt(n), dtype=torch.float64), atol=1e-15)


def test_hadamard_is_sylvester_ordered():
    """Sylvester's ordering (scipy.linalg.hadamard's; scipy is not a dependency): H[i, j] = (-1)^popcount(i & j)."""
    for n in (2, 16, 64):
        i = np.arange(n)
        signs = np.array([[(-1.0) ** bin(a & b).count("1") for b in i] for a in i])
        ref = torch.from_numpy(signs) / math.sqrt(n)
        assert torch.allclose(quant.hadamard_matrix(n, torch.float64), ref, atol=1e-15, rtol=0)


def test_hadamard_involution_and_norm():
    x = torch.randn(3, 4, 64, generator=_gen(4))
    y = quant.hadamard(x)
    assert not torch.allclose(y, x)
    assert torch.allclose(quant.hadamard(y), x, atol=1e-6, rtol=0)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-6)


def test_hadamard_non_power_of_two_names_the_size():
    with pytest.raises(ValueError, match="head_size should be a power of two, got 96"):
        quant.hadamard(torch.ones(2, 96), "head_size")
    with pytest.raises(ValueError, match="got 0"):
        quant.hadamard_matrix(0)
