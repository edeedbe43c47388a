"""Rotary embeddings beyond one static table, in standard ONNX ops shared by the families.

- `rope_type(config)`: the configuration's RoPE scaling kind ("default", "linear", "dynamic", "yarn",
  "llama3", "longrope", ...), from `rope_parameters` (transformers 5) or `rope_scaling`.
- `check_context(config, context)`: "dynamic" (NTK) scaling recomputes its frequencies once a sequence grows
  past `max_position_embeddings`; below that it is exactly the unscaled table, so pagedkit exports it for
  contexts up to `max_position_embeddings` and refuses longer ones with that reason.
- LongRoPE (Phi-3.5 / Phi-4-mini 128k): Hugging Face picks the long factors for *every* position of a forward
  once the longest sequence of the batch (max position + 1) exceeds `original_max_position_embeddings`, the
  short factors otherwise. `longrope_tables` returns both tables from the model's own rotary module;
  `select_tables` picks one per step in the graph with a Where on the batch's longest total length (past +
  new tokens: computed on the device from `past_sequence_lengths` and `cumulative_sequence_lengths`, no host
  read, so a step stays CUDA-graph capturable), as onnxruntime-genai does with its If node.
- `token_positions` / `apply_rope`: each token's position ([T] int64, from `query_positions` or derived from the
  sequence lengths) and RoPE applied in the graph, for a family that must normalize *after* RoPE (HunYuan) or
  scale queries per position (Llama 4): the attention node then runs with do_rotary=0.
- `chunk_bias`: Llama 4's chunked attention (a query at position p sees keys [floor(p / C) * C, p]) as the
  node's attention_bias, computed from the token positions once per graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from onnx import TensorProto

from .attention import GraphInputs
from .graph import GraphBuilder, rotary_tables

I64, BOOL = TensorProto.INT64, TensorProto.BOOL


class LongRope(NamedTuple):
    """A LongRoPE table pair: short / long (cos, sin), the long one used once a batch passes `original`."""

    short: tuple[torch.Tensor, torch.Tensor]
    long: tuple[torch.Tensor, torch.Tensor]
    original: int


def rope_parameters(config) -> dict:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return dict(rope) if isinstance(rope, dict) else {}


def rope_type(config) -> str:
    rope = rope_parameters(config)
    return str(rope.get("rope_type", rope.get("type", "default")) or "default")


def original_max_positions(config) -> int:
    rope = rope_parameters(config)
    orig = rope.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
    if not orig:
        raise NotImplementedError("rope_type 'longrope' without original_max_position_embeddings")
    return int(orig)


def check_context(config, context: int) -> None:
    """Refuse a context the exported static tables cannot serve exactly (dynamic NTK beyond its base length)."""
    if "dynamic" in rope_type(config) and context > config.max_position_embeddings:
        raise ValueError(f"--max-seq-len {context}: rope_type 'dynamic' rescales its frequencies with the "
                         f"sequence length beyond max_position_embeddings {config.max_position_embeddings}; "
                         "pagedkit exports the exact table up to that length only")


def longrope_tables(rotary_emb: torch.nn.Module, max_positions: int, original: int, **kw
                    ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None]:
    """(short, long) cos/sin tables [max_positions, rotary_dim / 2] of a LongRoPE module; long is None when
    max_positions <= original (the long factors are then never used). The short table's rows past `original`
    (never read: a batch that long uses the long table) repeat the long table's."""
    short = rotary_tables(rotary_emb, min(max_positions, original), **kw)  # max position + 1 <= original: short
    if max_positions <= original:
        return short, None
    long = rotary_tables(rotary_emb, max_positions, **kw)  # max position + 1 > original: long
    pad = [torch.cat([s, l[original:]]) for s, l in zip(short, long)]
    return (pad[0], pad[1]), long


def longest_total_length(g: GraphBuilder, io: GraphInputs) -> str:
    """[] int32: max over the batch of past_sequence_lengths[b] + new tokens of b (made once per graph)."""
    name = "/model/rope/longest/ReduceMax/output_0"
    if name in g.vi:
        return name
    i32 = TensorProto.INT32
    csl = io.cumulative_sequence_lengths
    hi = g.node("Slice", [csl, g.const([1], I64), g.const([2**62], I64)], "/model/rope/longest/Slice",
                out_type=i32, out_shape=("batch_size",))
    lo = g.node("Slice", [csl, g.const([0], I64), g.const([-1], I64)], "/model/rope/longest/Slice_1",
                out_type=i32, out_shape=("batch_size",))
    new = g.node("Sub", [hi, lo], "/model/rope/longest/Sub", out_type=i32, out_shape=("batch_size",))
    total = g.node("Add", [new, io.past_sequence_lengths], "/model/rope/longest/Add", out_type=i32,
                   out_shape=("batch_size",))
    return g.node("ReduceMax", [total], "/model/rope/longest/ReduceMax", keepdims=0, out_type=i32, out_shape=())


def select_tables(g: GraphBuilder, io: GraphInputs, short: tuple[str, str], long: tuple[str, str], original: int,
                  key: str) -> tuple[str, str]:
    """cos / sin = long if the batch's longest total length > original else short (Where: no host read)."""
    longest = longest_total_length(g, io)
    use_long = g.node("Greater", [longest, g.const(original, TensorProto.INT32)], f"/model/rope/{key}/Greater",
                      out_type=BOOL, out_shape=())
    out = []
    for s, l, part in zip(short, long, ("cos", "sin")):
        t, shape = g.vi[l]
        out.append(g.node("Where", [use_long, l, s], f"/model/rope/{key}/{part}/Where", out_type=t, out_shape=shape))
    return out[0], out[1]


def token_positions(g: GraphBuilder, io: GraphInputs) -> str:
    """[T] int64: each token's position — `query_positions` when the graph has it, else past_sequence_lengths[b]
    + the token's offset in its sequence b (b = how many sequences end at or before the token). Made once."""
    name = "/model/positions/output_0"
    if name in g.vi:
        return name
    if io.query_positions:
        return g.node("Cast", [io.query_positions], "/model/positions", to=I64, outputs=[name], out_type=I64,
                      out_shape=("num_tokens",))
    i32 = TensorProto.INT32
    csl = io.cumulative_sequence_lengths
    n = g.node("Shape", ["input_ids"], "/model/positions/Shape", out_type=I64, out_shape=(1,))
    n = g.node("Squeeze", [n, g.const([0], I64)], "/model/positions/Squeeze", out_type=I64, out_shape=())
    t = g.node("Range", [g.const(0, I64), n, g.const(1, I64)], "/model/positions/Range", out_type=I64,
               out_shape=("num_tokens",))
    ends = g.node("Slice", [csl, g.const([1], I64), g.const([2**62], I64)], "/model/positions/Slice", out_type=i32,
                  out_shape=("batch_size",))
    ends = g.node("Cast", [ends], "/model/positions/Cast", to=I64, out_type=I64, out_shape=("batch_size",))
    tcol = g.node("Unsqueeze", [t, g.const([1], I64)], "/model/positions/Unsqueeze", out_type=I64,
                  out_shape=("num_tokens", 1))
    done = g.node("GreaterOrEqual", [tcol, ends], "/model/positions/GreaterOrEqual", out_type=BOOL,
                  out_shape=("num_tokens", "batch_size"))
    done = g.node("Cast", [done], "/model/positions/Cast_1", to=I64, out_type=I64,
                  out_shape=("num_tokens", "batch_size"))
    seq = g.node("ReduceSum", [done, g.const([1], I64)], "/model/positions/ReduceSum", keepdims=0, out_type=I64,
                 out_shape=("num_tokens",))
    start = g.node("Gather", [csl, seq], "/model/positions/Gather", out_type=i32, out_shape=("num_tokens",))
    past = g.node("Gather", [io.past_sequence_lengths, seq], "/model/positions/Gather_1", out_type=i32,
                  out_shape=("num_tokens",))
    base = g.node("Sub", [past, start], "/model/positions/Sub", out_type=i32, out_shape=("num_tokens",))
    base = g.node("Cast", [base], "/model/positions/Cast_2", to=I64, out_type=I64, out_shape=("num_tokens",))
    return g.node("Add", [t, base], "/model/positions", outputs=[name], out_type=I64, out_shape=("num_tokens",))


def _table_rows(g: GraphBuilder, table: str, positions: str, rows, half: int) -> str:
    """[T, 1, R / 2] float32: the rows of a cos / sin table [P, R / 2] at `positions`, gathered in the table's type
    and then cast (only T rows converted, not the whole table), made once per (table, positions): every layer's Q
    and K share them."""
    p = "/model/rope/rows/" + "@".join(n.strip("/").replace("/", ".") for n in (table, positions))
    out = f"{p}/Unsqueeze/output_0"
    if out in g.vi:
        return out
    f32 = TensorProto.FLOAT
    r = g.node("Gather", [table, positions], f"{p}/Gather", out_type=g.vi[table][0], out_shape=(rows, half))
    r = g.node("Cast", [r], f"{p}/Cast", to=f32, out_type=f32, out_shape=(rows, half))
    return g.node("Unsqueeze", [r, g.const([1], I64)], f"{p}/Unsqueeze", out_type=f32, out_shape=(rows, 1, half))


def apply_rope(g: GraphBuilder, x: str, heads: int, head_dim: int, rope: tuple[str, str], positions: str,
               interleaved: bool, prefix: str) -> str:
    """RoPE of x [T, heads * head_dim] (the model's float type) at `positions` with cos / sin tables [P, R / 2]
    (R <= head_dim: the first R channels rotate, the rest pass): half-split pairs (i, i + R/2), or interleaved
    pairs (2i, 2i + 1). Computed in float32; returns x's type and shape."""
    f32 = TensorProto.FLOAT
    t, shape = g.vi[x]
    rows = shape[0]
    half = g.vi[rope[0]][1][1]
    rot = 2 * half
    cos, sin = (_table_rows(g, tab, positions, rows, half) for tab in rope)
    x3 = g.node("Reshape", [x, g.const([-1, heads, head_dim], I64)], f"{prefix}/Reshape", out_type=t,
                out_shape=(rows, heads, head_dim))
    x3 = g.node("Cast", [x3], f"{prefix}/Cast", to=f32, out_type=f32, out_shape=(rows, heads, head_dim))
    parts = [f"{prefix}/Split/output_{j}" for j in range(2 if rot == head_dim else 3)]
    sizes = [rot] if rot == head_dim else [rot, head_dim - rot]
    if rot == head_dim:
        xr, rest = x3, None
    else:
        g.node("Split", [x3, g.const(sizes, I64)], f"{prefix}/Split", outputs=parts[:2], axis=-1)
        xr, rest = parts[0], parts[1]
        g.vi[xr], g.vi[rest] = (f32, (rows, heads, rot)), (f32, (rows, heads, head_dim - rot))
    if interleaved:  # pairs (2i, 2i + 1): view as [.., half, 2]
        xp = g.node("Reshape", [xr, g.const([0, 0, half, 2], I64)], f"{prefix}/pairs/Reshape", out_type=f32,
                    out_shape=(rows, heads, half, 2))
        a, b = (f"{prefix}/pairs/Split/output_{j}" for j in range(2))
        g.node("Split", [xp, g.const([1, 1], I64)], f"{prefix}/pairs/Split", outputs=[a, b], axis=-1)
        a, b = (g.node("Squeeze", [v, g.const([-1], I64)], f"{prefix}/pairs/Squeeze_{j}", out_type=f32,
                       out_shape=(rows, heads, half)) for j, v in enumerate((a, b)))
    else:
        a, b = (f"{prefix}/halves/Split/output_{j}" for j in range(2))
        g.node("Split", [xr, g.const([half, half], I64)], f"{prefix}/halves/Split", outputs=[a, b], axis=-1)
    for v in (a, b):
        g.vi[v] = (f32, (rows, heads, half))

    def mul(u, v, n):
        return g.node("Mul", [u, v], f"{prefix}/{n}", out_type=f32, out_shape=(rows, heads, half))

    ra = g.node("Sub", [mul(a, cos, "Mul"), mul(b, sin, "Mul_1")], f"{prefix}/Sub", out_type=f32,
                out_shape=(rows, heads, half))
    rb = g.node("Add", [mul(b, cos, "Mul_2"), mul(a, sin, "Mul_3")], f"{prefix}/Add", out_type=f32,
                out_shape=(rows, heads, half))
    if interleaved:
        ra, rb = (g.node("Unsqueeze", [v, g.const([-1], I64)], f"{prefix}/out/Unsqueeze_{j}", out_type=f32,
                         out_shape=(rows, heads, half, 1)) for j, v in enumerate((ra, rb)))
        y = g.node("Concat", [ra, rb], f"{prefix}/out/Concat", axis=-1, out_type=f32, out_shape=(rows, heads, half, 2))
        y = g.node("Reshape", [y, g.const([0, 0, rot], I64)], f"{prefix}/out/Reshape", out_type=f32,
                   out_shape=(rows, heads, rot))
    else:
        y = g.node("Concat", [ra, rb], f"{prefix}/out/Concat", axis=-1, out_type=f32, out_shape=(rows, heads, rot))
    if rest is not None:
        y = g.node("Concat", [y, rest], f"{prefix}/out/Concat_1", axis=-1, out_type=f32,
                   out_shape=(rows, heads, head_dim))
    y = g.node("Reshape", [y, g.const([-1, heads * head_dim], I64)], f"{prefix}/out/Reshape_1", out_type=f32,
               out_shape=(rows, heads * head_dim))
    return g.node("Cast", [y], f"{prefix}/out/Cast", to=t, out_type=t, out_shape=shape)


def chunk_bias(g: GraphBuilder, io: GraphInputs, chunk: int, mask: float) -> str:
    """attention_bias [B, 1, Qc, Kc] (the attention type) of chunked attention, made once: 0 where key position
    k >= floor(pos / chunk) * chunk of the query at (b, j) (the node's causal mask bounds k <= pos), `mask`
    elsewhere; Qc = the longest new-token count, Kc = the longest past + new of the step."""
    p, t = "/model/chunk_bias", g.attn_type
    out = f"{p}/output_0"
    if out in g.vi:
        return out
    seq, qk = ("batch_size",), ("batch_size", "q_capacity")
    pos = token_positions(g, io)  # [T] int64
    start = g.node("Div", [pos, g.const(chunk, I64)], f"{p}/Div", out_type=I64, out_shape=("num_tokens",))
    start = g.node("Mul", [start, g.const(chunk, I64)], f"{p}/Mul", out_type=I64, out_shape=("num_tokens",))  # [T]
    csl = g.node("Cast", [io.cumulative_sequence_lengths], f"{p}/Cast", to=I64, out_type=I64,
                 out_shape=("batch_size + 1",))
    lo = g.node("Slice", [csl, g.const([0], I64), g.const([-1], I64)], f"{p}/Slice", out_type=I64, out_shape=seq)
    hi = g.node("Slice", [csl, g.const([1], I64), g.const([2**62], I64)], f"{p}/Slice_1", out_type=I64, out_shape=seq)
    n = g.node("Sub", [hi, lo], f"{p}/Sub", out_type=I64, out_shape=seq)
    past = g.node("Cast", [io.past_sequence_lengths], f"{p}/Cast_1", to=I64, out_type=I64, out_shape=seq)
    total = g.node("Add", [n, past], f"{p}/Add", out_type=I64, out_shape=seq)
    qc, kc = (g.node("ReduceMax", [v], f"{p}/ReduceMax_{j}", keepdims=0, out_type=I64, out_shape=())
              for j, v in enumerate((n, total)))
    j = g.node("Range", [g.const(0, I64), qc, g.const(1, I64)], f"{p}/Range", out_type=I64, out_shape=("q_capacity",))
    lo = g.node("Unsqueeze", [lo, g.const([1], I64)], f"{p}/Unsqueeze", out_type=I64, out_shape=("batch_size", 1))
    row = g.node("Add", [lo, j], f"{p}/Add_1", out_type=I64, out_shape=qk)  # token of (b, j); j >= n_b: never read
    last = g.node("Sub", [g.node("Shape", [pos], f"{p}/Shape", out_type=I64, out_shape=(1,)), g.const([1], I64)],
                  f"{p}/Sub_1", out_type=I64, out_shape=(1,))
    row = g.node("Min", [row, last], f"{p}/Min", out_type=I64, out_shape=qk)
    first = g.node("Gather", [start, row], f"{p}/Gather", out_type=I64, out_shape=qk)
    first = g.node("Unsqueeze", [first, g.const([2], I64)], f"{p}/Unsqueeze_1", out_type=I64, out_shape=qk + (1,))
    k = g.node("Range", [g.const(0, I64), kc, g.const(1, I64)], f"{p}/Range_1", out_type=I64,
               out_shape=("kv_capacity",))
    inside = g.node("GreaterOrEqual", [k, first], f"{p}/GreaterOrEqual", out_type=BOOL,
                    out_shape=qk + ("kv_capacity",))
    bias = g.node("Where", [inside, g.const(0.0, t), g.const(float(mask), t)], f"{p}/Where", out_type=t,
                  out_shape=qk + ("kv_capacity",))
    return g.node("Unsqueeze", [bias, g.const([1], I64)], p, outputs=[out], out_type=t,
                  out_shape=("batch_size", 1, "q_capacity", "kv_capacity"))
