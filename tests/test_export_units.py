"""Unit tests of paged-export's helpers (pagedkit/exporters): external-data size parsing, slicing a lazy weight
rule by rule against eager slicing (and that the leaves are asked only for the rows needed), RoPE / MoE / graph
helpers. Fast: no model is exported here."""

from __future__ import annotations

import pytest
import torch


# ---- external.parse_size -------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, want", [
    ("1gb", 1000 ** 3), ("1G", 1000 ** 3), ("2 GB", 2 * 1000 ** 3), ("1.5GiB", 3 * 1024 ** 3 // 2),
    ("500MiB", 500 * 1024 ** 2), ("512MB", 512 * 1000 ** 2), ("3m", 3 * 1000 ** 2), ("4KiB", 4096),
    ("7kb", 7000), ("1TiB", 1024 ** 4), ("2tb", 2 * 1000 ** 4), ("123", 123), ("64b", 64), (4096, 4096),
])
def test_parse_size_exact_bytes(text, want):
    from pagedkit.exporters.external import parse_size

    got = parse_size(text)
    assert got == want and isinstance(got, int), (text, got, want)


@pytest.mark.parametrize("text", [None, "", "off", "none", "0", " OFF ", 0])
def test_parse_size_off_is_one_file(text):
    from pagedkit.exporters.external import parse_size

    assert parse_size(text) is None


@pytest.mark.parametrize("text", ["gb", "MiB", "1.5xb", "12q", "abc"])
def test_parse_size_rejects_and_names_the_value(text):
    from pagedkit.exporters.external import parse_size

    with pytest.raises(ValueError, match="expected a number") as e:
        parse_size(text)
    assert repr(text) in str(e.value)


def test_parse_size_rejects_non_positive():
    from pagedkit.exporters.external import parse_size

    with pytest.raises(ValueError, match=r"'0\.0001b' must be positive"):
        parse_size("0.0001b")


# ---- slicing.narrow: rule by rule, against eager slicing and the rows each leaf is asked for ----------------

def _leaf(shape, seed, asked, tag):
    """A LazyTensor leaf over random values whose row reader (dim 0) records what it was asked."""
    from pagedkit.exporters.lazy import LazyTensor

    v = torch.randn(shape, generator=torch.Generator().manual_seed(seed))

    def slicer(d, a, b):
        asked.append((tag, d, a, b))
        return v[a:b] if d == 0 else None
    return LazyTensor(v.to("meta"), lambda: v, slicer), v


def _check(lazy_x, want, dim, a, b):
    from pagedkit.exporters import slicing

    try:
        got = slicing.narrow(lazy_x, dim, a, b)
    finally:
        slicing.clear()
    assert got.shape == want.narrow(dim, a, b - a).shape, (dim, a, b, tuple(got.shape))
    assert torch.equal(got, want.narrow(dim, a, b - a)), (dim, a, b)


def test_narrow_t_reads_source_rows():
    asked = []
    w, vw = _leaf((12, 8), 0, asked, "w")
    x = w.t()  # [8, 12]: its columns are w's rows
    _check(x, vw.t(), 1, 2, 7)
    assert asked == [("w", 0, 2, 7)]
    asked.clear()
    _check(x, vw.t(), 0, 1, 5)  # w's columns: read whole, sliced
    _check(x, vw.t(), -1, 3, 4)


@pytest.mark.parametrize("kw", [False, True])
def test_narrow_transpose_maps_the_axis(kw):
    asked = []
    a, va = _leaf((6, 4, 5), 1, asked, "a")
    x = a.transpose(dim0=2, dim1=0) if kw else a.transpose(-1, 0)  # [5, 4, 6]
    want = va.transpose(0, 2)
    _check(x, want, 2, 1, 4)
    assert asked == [("a", 0, 1, 4)]
    for d in range(3):
        _check(x, want, d, 1, 3)


def test_narrow_reshape_rows_and_merges():
    asked = []
    w, vw = _leaf((12, 8), 2, asked, "w")
    _check(w.reshape(3, 4, 8), vw.reshape(3, 4, 8), 0, 1, 3)  # each output row is 4 input rows
    assert asked == [("w", 0, 4, 12)]
    asked.clear()
    _check(w.reshape(6, 16), vw.reshape(6, 16), 0, 2, 5)
    assert asked == [("w", 0, 4, 10)]
    asked.clear()
    _check(w.reshape(24, 4), vw.reshape(24, 4), 0, 4, 10)  # two output rows per input row: aligned
    assert asked == [("w", 0, 2, 5)]
    asked.clear()
    _check(w.reshape(24, 4), vw.reshape(24, 4), 0, 3, 10)  # not aligned: whole, sliced
    assert asked == []


@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_narrow_split_along_and_across(dim):
    asked = []
    a, va = _leaf((6, 4, 5), 3, asked, "a")
    sizes = {0: [2, 4], 1: [1, 3], 2: [2, 3], -1: [2, 3]}[dim]
    x, want = a.split(sizes, dim=dim)[1], va.split(sizes, dim=dim)[1]
    for d in range(3):
        n = want.shape[d]
        for lo, hi in ((0, 1), (1, n), (max(0, n // 2 - 1), n // 2 + 1)):
            if lo < hi:
                _check(x, want, d, lo, hi)
    if dim == 0:  # rows of the second part are rows 2.. of the source
        asked.clear()
        _check(x, want, 0, 1, 3)
        assert asked == [("a", 0, 3, 5)]


def test_narrow_split_positional_dim():
    asked = []
    a, va = _leaf((6, 4, 5), 4, asked, "a")
    x, want = torch.split(a, [2, 3], 2)[0], torch.split(va, [2, 3], 2)[0]
    _check(x, want, 2, 1, 2)
    _check(x, want, 0, 2, 5)
    assert ("a", 0, 2, 5) in asked
