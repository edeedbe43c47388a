"""Fusions the session applies to a compiled graph at creation (steps.py `Graph` of `Step`s), before constants
are prepacked: small rules (pattern / check / rewrite), each returning what it changed. They only ever
replace a chain of steps whose intermediate values nobody else reads (no other step, no graph output).

- `swiglu_mlp`: the gated MLP as exporters and onnxruntime-genai's builder write it,
      gate = MatMul(x, Wg [K, N]); up = MatMul(x, Wu [K, N]); s = Sigmoid(gate); a = Mul(gate, s); h = Mul(a, up)
  becomes one MatMul on the concatenated constant weight [K, 2N] and `pagedkit.fused::SiluMul` (h =
  silu(y[..., :N]) * y[..., N:]): two steps instead of five, and one weight read of twice the width (the
  GEMV of a decode step runs closer to the memory bandwidth). The concatenated weight replaces both originals
  (dropped when no other step reads them); prepacking then lays it out once.

- `logit_rows` (only with `fuse(graph, logits=NAME)`: the session passes the logits output when the model declares it
  2-D, [tokens, vocabulary]): the LM head (MatMul / Gemm / MatMulNBits, through row-wise ops: Cast, Tanh, Identity,
  Mul / Div / Add / Sub by a constant) reads `pagedkit.fused::SelectRows(hidden, pagedkit.logit_rows)`, a new
  optional graph input: absent or empty, every row (the hidden states themselves, no copy, no launch); fed, only
  the rows named, in that order. The engine feeds a prefill's last rows: the head's [T, K] x [K, V] product and its
  [T, V] logits shrink to the rows sampled (the CPU onnxruntime path does the same: kernels/cpu/logits.py).

`fuse(graph)` runs every rule and returns {rule: number of rewrites}; `FUSIONS` lists them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import onnx
import torch

from ..interface.names import LOGITS
from ..kernels.cpu.logits import BY_CONSTANT, HEADS, ROW_WISE, ROWS_INPUT
from .steps import Graph, Step, plain_step, value_readers
from .ops.registry import FUSED_DOMAIN, lookup


def swiglu_mlp(g: Graph) -> int:
    """MatMul gate / up + Sigmoid + Mul + Mul -> MatMul on [Wg | Wu] + SiluMul (see the module docstring)."""
    readers = value_readers(g)
    producer = {o: s for s in g.steps for o in s.outputs if o}
    done = 0
    gone: set[int] = set()  # id() of the steps a rewrite replaced (Steps compare by value: never `in` / index)
    placed: dict[int, list[Step]] = {}  # id(gate step) -> the steps that take its place
    for mul in g.steps:
        if not plain_step(mul, "Mul", 2) or id(mul) in gone:
            continue
        # h = Mul(a, up), either order; a = Mul(gate, s); s = Sigmoid(gate); gate / up = MatMul(x, const)
        for a_name, up_name in (mul.inputs, mul.inputs[::-1]):
            act, up = producer.get(a_name), producer.get(up_name)
            if act is None or up is None or not plain_step(act, "Mul", 2) or not plain_step(up, "MatMul", 2):
                continue
            match = None
            for gate_name, s_name in (act.inputs, act.inputs[::-1]):
                sig, gate = producer.get(s_name), producer.get(gate_name)
                if (sig is not None and gate is not None and plain_step(sig, "Sigmoid", 1)
                        and sig.inputs[0] == gate_name and plain_step(gate, "MatMul", 2)):
                    match = (gate, sig)
                    break
            if match is None:
                continue
            gate, sig = match
            x, wg_name, wu_name = gate.inputs[0], gate.inputs[1], up.inputs[1]
            wg, wu = g.consts.get(wg_name), g.consts.get(wu_name)
            if (up.inputs[0] != x or not isinstance(wg, torch.Tensor) or not isinstance(wu, torch.Tensor)
                    or wg.dim() != 2 or wg.shape != wu.shape or wg.dtype != wu.dtype):
                continue
            inner = {gate.outputs[0]: 2, sig.outputs[0]: 1, act.outputs[0]: 1, up.outputs[0]: 1}
            if any(readers.get(v, 0) != k for v, k in inner.items()):  # an intermediate read elsewhere
                continue
            if any(id(st) in gone for st in (gate, up, sig, act)):  # already part of another rewrite
                continue
            cat = f"{wg_name}::gate_up"
            g.consts[cat] = torch.cat((wg, wu), dim=1)  # [K, 2N]
            y = f"{gate.outputs[0]}::gate_up"
            fused_mm = replace(gate, name=f"{gate.name}+{up.name}", inputs=[x, cat], outputs=[y], release=[])
            silu = Step(f"{mul.name}::SiluMul", "SiluMul", FUSED_DOMAIN, [y], [mul.outputs[0]],
                        {"split": int(wg.shape[1])}, impl=lookup(FUSED_DOMAIN, "SiluMul", 1, mul.name),
                        ctx=replace(mul.ctx, node_name=mul.name, num_outputs=1, requested=(True,)))
            gone.update(id(st) for st in (gate, up, sig, act, mul))
            placed[id(gate)] = [fused_mm, silu]
            for w in (wg_name, wu_name):
                readers[w] -= 1
                if readers[w] == 0 and w not in g.outputs:
                    g.consts.pop(w, None)
            done += 1
            break
    if done:  # the fused pair takes the gate's place: x is ready there and nothing before reads h
        g.steps = [n for st in g.steps for n in placed.get(id(st), () if id(st) in gone else (st,))]
    return done


def _lm_head(g: Graph, logits: str) -> Step | None:
    """The step computing the LM head that `logits` comes from through row-wise steps, or None."""
    producer = {o: s for s in g.steps for o in s.outputs if o}
    name = logits
    for _ in range(8):
        s = producer.get(name)
        if s is None or s.has_subgraph or s.call is not None or not s.inputs or not s.inputs[0]:
            return None
        if s.domain in ("", "com.microsoft") and s.op_type in HEADS:
            if s.op_type == "Gemm" and (int(s.attrs.get("transA", 0)) or (len(s.inputs) > 2 and s.inputs[2] and (
                    not isinstance(g.consts.get(s.inputs[2]), torch.Tensor) or g.consts[s.inputs[2]].dim() > 1))):
                return None  # rows of A are not the tokens, or a bias C that is not one row broadcast to all
            return s
        if s.domain == "" and s.op_type in ROW_WISE and len(s.inputs) == 1:
            name = s.inputs[0]
        elif s.domain == "" and s.op_type in BY_CONSTANT and len(s.inputs) == 2 and s.inputs[1] in g.consts:
            name = s.inputs[0]
        else:
            return None
    return None


def token_logits(graph: onnx.GraphProto) -> str | None:
    """The model's output `logits` when declared [tokens, vocabulary] (rank 2: its rows are the step's tokens), else
    None (`logit_rows` is then not applied)."""
    out = next((o for o in graph.output if o.name == LOGITS), None)
    if out is None or not out.type.tensor_type.HasField("shape") or len(out.type.tensor_type.shape.dim) != 2:
        return None
    return out.name


def logit_rows(g: Graph, logits: str) -> int:
    """The LM head over the rows `pagedkit.logit_rows` names (see the module docstring); 1 if inserted, else 0."""
    if logits not in g.outputs or ROWS_INPUT in g.inputs:
        return 0
    head = _lm_head(g, logits)
    if head is None:
        return 0
    hidden = head.inputs[0]
    rows = f"{hidden}::rows"
    select = Step(f"{head.name}::SelectRows", "SelectRows", FUSED_DOMAIN, [hidden, ROWS_INPUT], [rows], {},
                  impl=lookup(FUSED_DOMAIN, "SelectRows", 1, head.name),
                  ctx=replace(head.ctx, node_name=head.name, num_outputs=1, requested=(True,)) if head.ctx else None)
    at = next(i for i, s in enumerate(g.steps) if s is head)
    head.inputs[0] = rows
    g.steps.insert(at, select)
    g.inputs.append(ROWS_INPUT)
    return 1


FUSIONS: dict[str, Callable[[Graph], int]] = {"swiglu_mlp": swiglu_mlp}


def fuse(g: Graph, logits: str | None = None, device: torch.device | None = None) -> dict[str, int]:
    """Every rule on this graph (not its subgraphs); {rule: rewrites} for the rules that changed something.
    logits: the model's [tokens, vocabulary] logits output, for `logit_rows` (None: not applied). device: where the
    session runs (CUDA sessions also get fuse_linear.py's `decode_linear` when PAGEDKIT_DECODE_LINEAR is on)."""
    from .fuse_linear import decode_linear

    out = {}
    for name, rule in FUSIONS.items():
        n = rule(g)
        if n:
            out[name] = n
    if logits is not None and logit_rows(g, logits):
        out["logit_rows"] = 1
    n = decode_linear(g, device or torch.device("cpu"))
    if n:
        out["decode_linear"] = n
    return out
