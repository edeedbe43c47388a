"""Matrix products: MatMul (numpy semantics), Gemm, Einsum. Computed in the input dtype, except
fp16 / bf16 on the CPU: torch's half-precision CPU matmul is ~30x slower than float32, so those
products run in float32 (rounded back to the input dtype), with a float32 copy of each large operand
(the weights) made once and reused while that tensor lives unmodified.

At session creation (prepack, registry.py) a constant 2-D weight B of MatMul / Gemm on the CPU is laid out
once for its kernel, replacing the stored tensor (`PackedLinear`, packed.py):
- float32: oneDNN's packed layout (torch.ops.mkldnn._reorder_linear_weight, run by _linear_pointwise):
  measured on 2 cores at SmolLM2-135M's shapes, 30 layers at M=1 in ~19 ms vs ~22-28 ms for x @ B, and
  ~54 ms vs ~107 ms at M=61; the 49152 x 576 lm_head 3.9 ms vs 9.6 ms;
- float16: [N, K] (B transposed once). Where oneDNN has float16 kernels (AVX512-FP16 / AMX-FP16:
  `HALF_MATMUL_NATIVE`), F.linear in float16 at every M (float32 accumulation, one rounding: the same
  values as the float32 product rounded); measured on 2 cores with torch 2.13 it is as fast as float32 or
  faster at every shape tried (DeepSeek-V3's 7168 x 129280 lm_head at M=8: 150 ms vs 352 ms float32), and
  it needs no float32 copy. Elsewhere, F.linear in float16 up to HALF_ROWS rows; more rows run in
  float32 (a prefill, where the product dominates), B converted slice by slice into one scratch buffer
  and the product written into one output, so a call allocates two tensors whatever the vocabulary (per-
  slice temporaries had left a float32 copy of the whole lm_head resident and faulted it in page by page:
  +3.7 GB and 5.5 s at DeepSeek-V3's lm_head);
- bfloat16: [N, K], F.linear in bfloat16 (oneDNN; fast at every M).
Same values as the unpacked path up to summation order."""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from ... import settings
from .packed import RELEASE_BYTES, PackedLinear, transpose_releasing
from .registry import prepack, register
from .util import HALF_TYPES, opt

# torch's cuBLAS front end for CUDA products ("cublaslt" / "cublas"; None: torch's default), set once at the
# first CUDA product; PAGEDKIT_BLAS (tuning: benchmarks/step_profile.py "lt"; docs/settings.md)
BLAS: str | None = settings.read("PAGEDKIT_BLAS")
_BLAS_SET = [False]


def _cuda_blas() -> None:
    if BLAS and not _BLAS_SET[0]:
        torch.backends.cuda.preferred_blas_library(BLAS)
        _BLAS_SET[0] = True


HALF_ROWS = 8  # without native float16 kernels, products with fewer rows run in float16 (module docstring)
CONVERT_ELEMENTS = 1 << 22  # larger float16 products convert B to float32 this many elements at a time


def _native_half() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):  # pragma: no cover - builds without oneDNN
        return False


HALF_MATMUL_NATIVE = _native_half()  # oneDNN runs float16 products natively on this CPU

_F32: dict[int, tuple[weakref.ref, torch.Tensor, int]] = {}  # id(tensor) -> (ref, float32 copy, version)


def _f32(t: torch.Tensor) -> torch.Tensor:
    key = id(t)
    hit = _F32.get(key)
    if hit is not None and hit[0]() is t and hit[2] == t._version:
        return hit[1]
    f = t.float()
    if t.numel() >= 1 << 16:  # weights: keep the copy for the next call
        _F32[key] = (weakref.ref(t, lambda _, k=key: _F32.pop(k, None)), f, t._version)
    return f


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.device.type == "cpu" and a.dtype in HALF_TYPES and b.dtype == a.dtype:
        return torch.matmul(_f32(a), _f32(b)).to(a.dtype)
    return torch.matmul(a, b)


class _Linear(PackedLinear):
    """y = a @ B for a [..., K] in B's dtype; B held as [N, K] (`weight`) or oneDNN-packed (`packed`)."""

    def __init__(self, b_kn: torch.Tensor, consume: bool = False, release_min: int = RELEASE_BYTES):
        """consume: b_kn is ours to take apart (nobody reads it afterwards): transposed releasing its pages
        (when it holds at least release_min bytes)."""
        k, n = b_kn.shape
        self.shape, self.dtype, self.device = (k, n), b_kn.dtype, b_kn.device
        self.in_features, self.out_features = k, n
        self.weight = transpose_releasing(b_kn, release_min) if consume else b_kn.T.contiguous()  # [N, K]
        if not self.weight.is_contiguous():
            self.weight = self.weight.contiguous()
        self.packed = None
        if b_kn.dtype == torch.float32 and torch.backends.mkldnn.is_available():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 1)
            self.weight = None
            self.layout = "oneDNN packed float32"
        else:
            self.layout = f"[N, K] {str(b_kn.dtype).replace('torch.', '')}"
        self.nbytes = k * n * b_kn.element_size()

    def matmul(self, a: torch.Tensor) -> torch.Tensor:
        if a.dtype != self.dtype:
            raise TypeError(f"MatMul: A is {a.dtype}, the prepacked B is {self.dtype}")
        lead = a.shape[:-1]
        if self.packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(a.reshape(-1, self.in_features), self.packed, None, "none", [], "")
            return y.reshape(*lead, self.out_features)
        if self.dtype == torch.float16 and not HALF_MATMUL_NATIVE and a.numel() >= HALF_ROWS * self.in_features:
            return self._float32_product(a.reshape(-1, self.in_features)).reshape(*lead, self.out_features)
        return F.linear(a, self.weight)

    def _float32_product(self, a_mk: torch.Tensor) -> torch.Tensor:
        """a [M, K] float16 -> [M, N] float16 through float32: B [N, K] converted in row slices into one
        scratch [step, K] buffer, y^T [N, M] written slice by slice (contiguous rows), no per-slice tensors."""
        n, k = self.out_features, self.in_features
        step = min(n, max(1, CONVERT_ELEMENTS // k))
        a_km = a_mk.T.float()  # [K, M]
        scratch = torch.empty((step, k), dtype=torch.float32)  # B rows [step, K] in float32
        y_nm = torch.empty((n, a_mk.shape[0]), dtype=torch.float32)  # y^T [N, M]
        for n0 in range(0, n, step):
            rows = min(step, n - n0)
            b = scratch[:rows]
            b.copy_(self.weight[n0:n0 + rows])
            torch.mm(b, a_km, out=y_nm[n0:n0 + rows])
        return y_nm.T.to(self.dtype)


def _packable(b) -> bool:
    return (isinstance(b, torch.Tensor) and b.dim() == 2 and b.device.type == "cpu" and b.numel() >= 1 << 12
            and b.dtype in (torch.float32, torch.float16, torch.bfloat16))


class _BatchedLinear(PackedLinear):
    """y = a @ B for a constant B [E, K, N] (per-batch weights: MoE experts written as one MatMul, MLA's
    absorbed per-head projections): one _Linear per batch entry, a's leading dims broadcast as numpy's
    matmul does (a [..., 1 or E, M, K] or [M, K] -> [..., E, M, N]). Replaces the float32 copy of B the
    unpacked half path would keep (a second copy in another dtype)."""

    def __init__(self, b: torch.Tensor, consume: bool = False):
        e, k, n = b.shape
        self.shape, self.dtype, self.device = tuple(b.shape), b.dtype, b.device
        self.in_features, self.out_features = k, n
        # consumed: each entry's pages released as it is transposed (no second full copy at creation)
        self.parts = [_Linear(b[i], consume=consume, release_min=0) for i in range(e)]
        self.layout = f"{e} x {self.parts[0].layout}"
        self.nbytes = b.numel() * b.element_size()

    def matmul(self, a: torch.Tensor) -> torch.Tensor:
        if a.dim() == 2:
            a = a.unsqueeze(0)
        e = len(self.parts)
        if a.shape[-3] not in (1, e):
            raise ValueError(f"MatMul: A {tuple(a.shape)} does not broadcast with the constant B {self.shape}")
        return torch.stack([p.matmul(a.select(-3, i if a.shape[-3] > 1 else 0)) for i, p in enumerate(self.parts)],
                           dim=-3)


@prepack("MatMul")
def _prepack_matmul(inputs, attrs, ctx):
    """A constant 2-D B [K, N] on the CPU -> _Linear; a 3-D B [E, K, N] -> _BatchedLinear."""
    b = inputs[1]
    if str(ctx.device) != "cpu":
        return {}
    if isinstance(b, torch.Tensor) and b.dim() == 3 and b.shape[0] > 0 and _packable(b[0]):
        return {1: _BatchedLinear(b, consume=1 in ctx.consumable)}
    if not _packable(b):
        return {}
    return {1: _Linear(b, consume=1 in ctx.consumable)}


@prepack("Gemm")
def _prepack_gemm(inputs, attrs, ctx):
    """A constant B of a Gemm without transA / alpha / beta on the CPU -> _Linear (C stays an input)."""
    if (str(ctx.device) != "cpu" or not _packable(inputs[1]) or attrs.get("transA", 0)
            or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0):
        return {}
    b = inputs[1]
    return {1: _Linear(b.T if attrs.get("transB", 0) else b, consume=1 in ctx.consumable)}


@register("MatMul")
def matmul(inputs, attrs, ctx):
    if isinstance(inputs[1], PackedLinear):
        return [inputs[1].matmul(inputs[0])]
    if BLAS and inputs[0].is_cuda:
        _cuda_blas()
    return [_mm(inputs[0], inputs[1])]


@register("Gemm")
def gemm(inputs, attrs, ctx):
    a, b, c = inputs[0], inputs[1], opt(inputs, 2)  # a [M, K] (or [K, M]), b [K, N] (or [N, K]), c -> [M, N]
    if isinstance(b, PackedLinear):  # prepacked: no transA / alpha / beta (see _prepack_gemm)
        y = b.matmul(a)
        return [y + c.to(y.dtype) if c is not None else y]
    out_dtype = a.dtype
    if a.device.type == "cpu" and a.dtype in HALF_TYPES:  # float32 before transposing: the copy is reused
        a, b = _f32(a), _f32(b)
        c = None if c is None else c.float()
    a = a.T if attrs.get("transA", 0) else a
    b = b.T if attrs.get("transB", 0) else b
    alpha, beta = attrs.get("alpha", 1.0), attrs.get("beta", 1.0)
    y = a @ b
    if alpha != 1.0:
        y = y * alpha
    if c is not None:
        y = y + (c if beta == 1.0 else c * beta)
    return [y.to(out_dtype)]


@register("Einsum")
def einsum(inputs, attrs, ctx):
    return [torch.einsum(attrs["equation"].replace(" ", ""), *inputs)]
