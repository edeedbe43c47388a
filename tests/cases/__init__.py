"""Fixed attention cases: inputs and expected outputs of PagedAttention and GroupQueryAttention.

`index.json` lists every case (op, attributes, input / output names, shapes, dtypes, tolerance, what it
exercises) and names its compact `.npz` (keys "input.<name>", "expected.<name>", "defined.<name>").
Expected outputs come from pagedkit's reference kernels; `generate.py` rebuilds them deterministically.
GQA cases labelled "onnxruntime CPU" (`expected_from`) are re-run on onnxruntime 1.32.0's CPU kernel, and
every GQA case is compared with an independent float64 oracle (tests/paged_oracle.gqa_oracle), by
tests/test_gqa_oracle.py. PagedAttention cases ("reference") are the reference's output; the reference
itself is checked against the PagedAttention oracle on its own inputs (tests/test_reference_paged.py).

    from cases import load_cases, compare_case
    for case in load_cases():
        name, op, attrs, inputs, expected = case
        got = my_kernel(inputs, outputs=list(expected), **attrs)   # e.g. torch tensors keyed by ONNX name
        compare_case(case, got)                                     # raises AssertionError on a mismatch

Inputs and expected outputs are torch tensors keyed by ONNX names (bf16 / fp8 included). Entries the
operator leaves unspecified (GQA: padded query rows, cache rows beyond the resident ones) are False in
`expected.defined[output]`; compare_case skips them. Floats compare as max|diff| <= tol * max|ref|
over the defined entries (tol from the index); quantized cache codes must match within `code_steps`.
Inputs are copied per load: a kernel that updates caches in place cannot spoil the next use.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

HERE = Path(__file__).parent
INDEX = HERE / "index.json"
_RAW = {"bfloat16": (np.uint16, torch.bfloat16), "float8e4m3fn": (np.uint8, torch.float8_e4m3fn)}
_TORCH = {"float32": torch.float32, "float16": torch.float16, "int8": torch.int8, "uint8": torch.uint8,
          "int32": torch.int32, "int64": torch.int64, "bool": torch.bool,
          **{k: v[1] for k, v in _RAW.items()}}
DTYPE_NAMES = {v: k for k, v in _TORCH.items()}


class Expected(dict):
    """Expected outputs by ONNX name; .defined[name] is a bool mask (absent: every entry defined)."""

    def __init__(self, values: dict, defined: dict):
        super().__init__(values)
        self.defined = defined


class Case(NamedTuple):
    name: str
    op: str
    attrs: dict
    inputs: dict
    expected: Expected


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """Storage form: bf16 / fp8 as their raw bits (uint16 / uint8)."""
    name = DTYPE_NAMES[t.dtype]
    if name in _RAW:
        return t.contiguous().view(torch.uint16 if name == "bfloat16" else torch.uint8).numpy()
    return t.numpy()


def from_numpy(a: np.ndarray, dtype: str) -> torch.Tensor:
    t = torch.from_numpy(np.array(a))
    return t.view(_RAW[dtype][1]) if dtype in _RAW else t


def load_index() -> list[dict]:
    return json.loads(INDEX.read_text())["cases"]


def load_cases(names=None, op: str | None = None) -> list[Case]:
    """Every case (or those named / of one op) as Case(name, op, attrs, inputs, expected)."""
    cases = []
    for entry in load_index():
        if (names is not None and entry["name"] not in names) or (op is not None and entry["op"] != op):
            continue
        with np.load(HERE / entry["file"]) as z:
            inputs = {t["name"]: from_numpy(z[f"input.{t['name']}"], t["dtype"]) for t in entry["inputs"]}
            values = {t["name"]: from_numpy(z[f"expected.{t['name']}"], t["dtype"]) for t in entry["outputs"]}
            defined = {t["name"]: torch.from_numpy(z[f"defined.{t['name']}"]) for t in entry["outputs"]
                       if f"defined.{t['name']}" in z}
        cases.append(Case(entry["name"], entry["op"], dict(entry["attributes"]), inputs, Expected(values, defined)))
    return cases


def tolerance(case_name: str) -> dict:
    return next(e["tolerance"] for e in load_index() if e["name"] == case_name)


def _codes(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.uint8:  # packed int4: compare the signed codes
        from pagedkit.kernels.quant import unpack_int4

        return unpack_int4(t, 2 * t.shape[-1]).long()
    return t.long()


def compare_case(case: Case, got: dict, tol: float | None = None, code_steps: int | None = None) -> dict:
    """Compare a kernel's outputs with the case's expected ones on the defined entries; returns
    {output: max|diff| / max|ref| (floats) or max code difference (quantized caches)}."""
    t = tolerance(case.name)
    tol = t["float"] if tol is None else tol
    code_steps = t["code_steps"] if code_steps is None else code_steps
    errs = {}
    for name, want in case.expected.items():
        assert name in got, f"{case.name}: output {name!r} missing"
        have = torch.as_tensor(got[name]).cpu()
        assert tuple(have.shape) == tuple(want.shape), f"{case.name}: {name} shape {tuple(have.shape)} != {tuple(want.shape)}"
        assert have.dtype == want.dtype, f"{case.name}: {name} dtype {have.dtype} != {want.dtype}"
        mask = case.expected.defined.get(name)
        if want.dtype in (torch.int8, torch.uint8):
            h, w = _codes(have), _codes(want)
            if mask is not None:
                mask = mask if h.shape == mask.shape else mask.repeat_interleave(2, -1)  # per int4 code
                h, w = h[mask], w[mask]
            errs[name] = int((h - w).abs().max()) if w.numel() else 0
            assert errs[name] <= code_steps, f"{case.name}: {name} codes differ by {errs[name]} > {code_steps}"
            continue
        h, w = have.double(), want.double()
        if mask is not None:
            h, w = h[mask], w[mask]
        assert torch.isfinite(h).all(), f"{case.name}: {name} has NaN/inf where defined"
        if w.numel() == 0:
            errs[name] = 0.0
            continue
        errs[name] = float((h - w).abs().max() / w.abs().max().clamp_min(1e-30))
        assert errs[name] <= tol, f"{case.name}: {name} max|diff| / max|ref| = {errs[name]:.3g} > {tol}"
    return errs
