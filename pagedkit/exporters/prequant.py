"""Pre-quantized int4 checkpoints (GPTQ, AWQ) -> com.microsoft::MatMulNBits, codes and zero points repacked, never
dequantized and requantized.

Checkpoint forms (4 bits; K input features, N output features, G groups along K):
- GPTQ (AutoGPTQ / GPTQModel, `quant_method` "gptq"): qweight int32 [K / 8, N], element k of column n in nibble
  k % 8 (low first) of qweight[k // 8, n]; qzeros int32 [G, N / 8], column n in nibble n % 8; scales [G, N];
  g_idx int32 [K] (row k's group; absent: k // group_size). `checkpoint_format` "gptq" (v1, the common one)
  stores each zero minus one: the zero used is the stored value + 1; "gptq_v2" stores it as is.
  W[k, n] = scales[g, n] * (q[k, n] - zero[g, n]), g = g_idx[k].
- AWQ (AutoAWQ GEMM, `quant_method` "awq"): qweight int32 [K, N / 8] and qzeros int32 [G, N / 8], both packed
  along N in AutoAWQ's order: nibble i of word c holds column 8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]; scales [G, N];
  group g = k // group_size; W[k, n] = scales[g, n] * (q[k, n] - zero[g, n]).
MatMulNBits (bits 4) holds B uint8 [N, K / block, block / 2] (element k of row n in the low nibble of byte
k // 2 when k is even, the high nibble when odd), scales [N * K / block] and zero points uint8
[N * ceil(K / block / 2)] packed the same way per row (a zero of 16 — GPTQ v1's stored 15 — does not fit a nibble:
then the zero points are written in the scales' type): W[n, k] = (B[n, k] - zp[n, b]) * scale[n, b], b = k //
block. The block is the largest power of two (16 .. 128) dividing every group boundary, so a group of 128 is
one block and a per-channel group (group_size -1) several blocks sharing a scale. Act-order checkpoints whose
g_idx is not monotone (groups permuted along K) are refused, naming the tensor: MatMulNBits' blocks are
contiguous.

A linear's weight that is such a tensor (or rows of several: packed QKV, `split` of a fused projection) becomes one
MatMulNBits node in `graph.linear` (accuracy_level 0: activations in their own type). Any other use of the weight
(a transform across K, as MLA's absorption) reads it dequantized to float, and says so once per tensor.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from .lazy import LazyTensor

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8c + AWQ_ORDER[i]
MAX_BLOCK = 128


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 words [r, c] -> their nibbles [r, c, 8], low nibble first (uint8; the words little-endian)."""
    b = words.contiguous().view(torch.uint8).reshape(words.shape[0], words.shape[1], 4)
    return torch.stack([b & 0xF, b >> 4], dim=-1).reshape(words.shape[0], words.shape[1], 8)


_AWQ_COLUMNS = torch.tensor([AWQ_ORDER.index(j) for j in range(8)])  # column 8c + j sits in nibble [j]


@dataclass
class Int4Source:
    """One GPTQ / AWQ linear of the checkpoint: its tensors and how they are packed."""

    index: object  # checkpoint.CheckpointIndex
    prefix: str  # the module's key prefix (`model.layers.0.self_attn.q_proj`)
    method: str  # "gptq" | "awq"
    n: int
    k: int
    group_size: int
    zero_plus_one: bool  # GPTQ v1

    def __post_init__(self):
        words = self.index.info(f"{self.prefix}.qweight")[0]
        # the packed words, read once per initializer written (slicing.whole keeps it while its chunks are cut)
        self.qweight = LazyTensor(torch.empty(words, dtype=torch.int32, device="meta"),
                                  lambda: self.index.read(f"{self.prefix}.qweight"))

    def codes(self, a: int, b: int) -> torch.Tensor:
        """The 4-bit codes of output rows [a, b): uint8 [b - a, K]."""
        from .slicing import whole

        qw = whole(self.qweight)
        if self.method == "gptq":  # [K / 8, N]: along K
            nib = _nibbles(qw[:, a:b])  # [K / 8, b - a, 8]
            return nib.permute(1, 0, 2).reshape(b - a, -1)[:, :self.k].contiguous()
        c0, c1 = a // 8, -(-b // 8)  # AWQ [K, N / 8]: along N, in AutoAWQ's order
        cols = _nibbles(qw[:, c0:c1])[:, :, _AWQ_COLUMNS].reshape(self.k, -1)
        return cols[:, a - 8 * c0:b - 8 * c0].t().contiguous()

    def zeros(self) -> torch.Tensor:
        """The zero of each group and column [G, N] (int16; GPTQ v1: stored + 1; none stored: 8)."""
        key = f"{self.prefix}.qzeros"
        if key not in self.index:
            return torch.full((self.groups(), self.n), 8, dtype=torch.int16)
        nib = _nibbles(self.index.read(key))
        if self.method == "awq":
            nib = nib[:, :, _AWQ_COLUMNS]
        z = nib.reshape(nib.shape[0], -1)[:, :self.n].to(torch.int16)
        return z + 1 if self.zero_plus_one else z

    def scales(self) -> torch.Tensor:
        return self.index.read(f"{self.prefix}.scales")  # [G, N]

    def groups(self) -> int:
        return self.index.info(f"{self.prefix}.scales")[0][0]

    def g_idx(self) -> torch.Tensor:
        key = f"{self.prefix}.g_idx"
        if self.method == "gptq" and key in self.index:
            return self.index.read(key).to(torch.int64)
        return torch.arange(self.k) // (self.group_size if self.group_size > 0 else self.k)

    def block(self, g_idx: torch.Tensor) -> int:
        """MatMulNBits' block size for this g_idx (module doc); ValueError for an act-order g_idx."""
        if bool((g_idx[1:] < g_idx[:-1]).any()):
            raise ValueError(f"{self.prefix}.g_idx: act-order (desc_act) GPTQ checkpoint, its groups are not "
                             "contiguous along K; MatMulNBits needs contiguous blocks (re-quantize without "
                             "desc_act, or with static_groups)")
        starts = [0] + (torch.nonzero(g_idx[1:] != g_idx[:-1]).flatten() + 1).tolist() + [self.k]
        g = 0
        for s in starts:
            g = math.gcd(g, int(s))
        block = 1 << (min(g & -g, MAX_BLOCK).bit_length() - 1)
        if block < 16:
            raise ValueError(f"{self.prefix}: quantization groups of {g} rows; MatMulNBits blocks are 16 .. "
                             f"{MAX_BLOCK} rows (a power of two dividing every group boundary)")
        return block

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """W [N, K] = (q - zero) * scale in float32, then `dtype`."""
        g = self.g_idx()
        q = self.codes(0, self.n).to(torch.float32)
        w = (q - self.zeros().t()[:, g].to(torch.float32)) * self.scales().t()[:, g].to(torch.float32)
        return w.to(dtype)


def quantized_leaf(index, name: str, meta: torch.Tensor, qcfg: dict) -> LazyTensor | None:
    """The LazyTensor of a GPTQ / AWQ linear's `weight` (None when `name` is not one): its value is the
    dequantized weight (any use other than a linear's), its `_int4` the source MatMulNBits is written from."""
    if not name.endswith(".weight") or meta.dim() != 2:
        return None
    prefix = name[:-len(".weight")]
    if f"{prefix}.qweight" not in index:
        return None
    n, k = meta.shape
    method = str(qcfg.get("quant_method", "")).lower()
    if method not in ("gptq", "awq"):
        shape = index.info(f"{prefix}.qweight")[0]
        method = "gptq" if shape == [k // 8, n] else "awq" if shape == [k, n // 8] else method
    bits = int(qcfg.get("bits", qcfg.get("w_bit", 4)))
    if method not in ("gptq", "awq") or bits != 4:
        raise NotImplementedError(f"{prefix}.qweight: {method or 'unknown'} {bits}-bit checkpoints are not read "
                                  "(4-bit GPTQ and AWQ are)")
    if method == "awq" and str(qcfg.get("version", "gemm")).lower() != "gemm":
        raise NotImplementedError(f"{prefix}.qweight: AWQ version {qcfg.get('version')!r}; the GEMM packing is read")
    group = int(qcfg.get("group_size", qcfg.get("q_group_size", 128)))
    fmt = str(qcfg.get("checkpoint_format", "gptq")).lower()
    src = Int4Source(index, prefix, method, int(n), int(k), group, method == "gptq" and fmt != "gptq_v2")

    def value():
        if prefix not in _told:
            _told.add(prefix)
            warnings.warn(f"{prefix}: int4 weight used other than as a linear's: exported dequantized to float",
                          stacklevel=2)
        return src.dequantized(meta.dtype)

    t = LazyTensor(meta.detach().to("meta"), value)
    t._int4 = src
    return t


_told: set[str] = set()


# ---- a linear's weight made of int4 rows -> MatMulNBits --------------------------------------------------------

def int4_rows(w) -> list[tuple[Int4Source, int, int]] | None:
    """[(source, first row, end row)] when w is rows of int4 checkpoint weights (itself, cat / split / chunk /
    row slices along the output axis, casts), else None."""
    if not isinstance(w, LazyTensor):
        return None
    src = getattr(w, "_int4", None)
    if src is not None:
        return [(src, 0, src.n)]
    if w._src is None:
        return None
    func, args, kwargs, j = w._src
    kwargs = kwargs or {}
    name = getattr(func, "__name__", "")
    if name in ("detach", "contiguous", "clone", "to", "float", "half", "bfloat16"):
        return int4_rows(args[0])
    if name in ("cat", "concat", "concatenate"):
        if (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % w.dim() != 0:
            return None
        parts = [int4_rows(t) for t in args[0]]
        return None if any(p is None for p in parts) else [r for p in parts for r in p]
    if name in ("chunk", "split"):
        src_t = args[0]
        if (args[2] if len(args) > 2 else kwargs.get("dim", 0)) % src_t.dim() != 0:
            return None
        rows = int4_rows(src_t)
        if rows is None:
            return None
        with torch._C.DisableTorchFunctionSubclass():
            outs = func(src_t.as_subclass(torch.Tensor), *args[1:], **kwargs)
        off = sum(o.shape[0] for o in outs[:j])
        return _take(rows, off, off + outs[j].shape[0])
    return None


def _take(rows, a, b):
    out, off = [], 0
    for src, r0, r1 in rows:
        n = r1 - r0
        lo, hi = max(a - off, 0), min(b - off, n)
        if lo < hi:
            out.append((src, r0 + lo, r0 + hi))
        off += n
    return out


class Packed:
    """MatMulNBits' B, scales and zero points of a linear made of int4 rows, as lazy tensors read when written."""

    def __init__(self, rows: list[tuple[Int4Source, int, int]], scale_dtype: torch.dtype):
        self.rows, self.scale_dtype = rows, scale_dtype
        ks = {src.k for src, _, _ in rows}
        if len(ks) != 1:
            raise ValueError(f"{rows[0][0].prefix}: int4 rows with different input sizes {sorted(ks)}")
        self.k, self.n = ks.pop(), sum(b - a for _, a, b in rows)
        self.block = min(src.block(src.g_idx()) for src, _, _ in rows)
        self.k_blocks = -(-self.k // self.block)
        z = self.block_zeros()
        self.zero_kind = "none" if bool((z == 8).all()) else "uint8" if 0 <= int(z.min()) and int(z.max()) <= 15 \
            else "float"

    def _per_block(self, table: torch.Tensor, src: Int4Source, a: int, b: int) -> torch.Tensor:
        """A [G, N] table -> [b - a, k_blocks]: the value of each block's group, rows a..b."""
        first = src.g_idx()[torch.arange(self.k_blocks) * self.block]
        return table[first][:, a:b].t()

    def block_zeros(self) -> torch.Tensor:
        return torch.cat([self._per_block(src.zeros(), src, a, b) for src, a, b in self.rows])

    def b_rows(self, r0: int, r1: int) -> torch.Tensor:
        """B [r1 - r0, k_blocks, block / 2] uint8: rows r0..r1 of the packed codes."""
        out, off, pad = [], 0, self.k_blocks * self.block - self.k
        for src, a, b in self.rows:
            lo, hi = max(r0 - off, 0), min(r1 - off, b - a)
            if lo < hi:
                q = src.codes(a + lo, a + hi)
                if pad:
                    q = torch.nn.functional.pad(q, (0, pad))
                out.append((q[:, 0::2] | (q[:, 1::2] << 4)).reshape(hi - lo, self.k_blocks, self.block // 2))
            off += b - a
        return torch.cat(out)

    def b(self) -> LazyTensor:
        meta = torch.empty(self.n, self.k_blocks, self.block // 2, dtype=torch.uint8, device="meta")
        return LazyTensor(meta, lambda: self.b_rows(0, self.n), lambda d, a, b: self.b_rows(a, b) if d == 0 else None)

    def scales(self) -> LazyTensor:
        meta = torch.empty(self.n * self.k_blocks, dtype=self.scale_dtype, device="meta")
        return LazyTensor(meta, lambda: torch.cat([self._per_block(src.scales(), src, a, b) for src, a, b
                                                   in self.rows]).to(self.scale_dtype).reshape(-1))

    def zero_points(self) -> LazyTensor | None:
        """uint8 nibbles packed per row, or the scales' type when a zero does not fit a nibble; None: all 8."""
        if self.zero_kind == "none":
            return None
        if self.zero_kind == "float":
            meta = torch.empty(self.n * self.k_blocks, dtype=self.scale_dtype, device="meta")
            return LazyTensor(meta, lambda: self.block_zeros().to(self.scale_dtype).reshape(-1))
        half = -(-self.k_blocks // 2)

        def packed():
            z = self.block_zeros().to(torch.uint8)
            if z.shape[1] % 2:
                z = torch.nn.functional.pad(z, (0, 1))
            return (z[:, 0::2] | (z[:, 1::2] << 4)).reshape(-1).contiguous()
        return LazyTensor(torch.empty(self.n * half, dtype=torch.uint8, device="meta"), packed)


def matmul_nbits(g, x: str, packed: Packed, prefix: str, init_prefix: str, rows, accuracy_level: int = 0) -> str:
    """com.microsoft::MatMulNBits y[T, N] = x[T, K] @ W^T from `packed`; names as onnxruntime's quantizer gives."""
    from onnx import TensorProto

    w = f"{init_prefix}.MatMul.weight"
    ins = [x, g.initializer(f"{w}_Q4", packed.b(), TensorProto.UINT8), g.initializer(f"{w}_scales", packed.scales())]
    zp = packed.zero_points()
    if zp is not None:
        ins.append(g.initializer(f"{w}_zero_points", zp, TensorProto.UINT8 if zp.dtype == torch.uint8 else None))
    attrs = dict(K=packed.k, N=packed.n, bits=4, block_size=packed.block)
    if accuracy_level:
        attrs["accuracy_level"] = accuracy_level
    return g.node("MatMulNBits", ins, f"{prefix}/MatMul_Q4", domain="com.microsoft",
                  outputs=[f"{prefix}/MatMul/output_0"], out_type=g.float_type, out_shape=(rows, packed.n), **attrs)
