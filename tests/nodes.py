"""Builders of valid PagedAttention / GroupQueryAttention nodes for the design doc's configurations.

A `Case` holds one call: attributes, runtime inputs (torch tensors with fresh seeded random values,
keyed by contract input name) and the requested outputs. From it:
  case.node(symbolic=...)    -> (onnx.NodeProto, value_info)  static form (tensor name = contract name)
  case.constants()           -> integer inputs as numpy (static value rules)
  case.model()               -> single-node ModelProto (the form ORT's own tests use)
  case.runtime_issues() / case.static_issues(...) -> validator issues
Configurations: PAGED_CONFIGS / GQA_CONFIGS map a name to builder kwargs; paged_case(name) /
gqa_case(name) build them. Reuse them anywhere a valid node is needed.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import numpy as np
import onnx
import torch
from onnx import helper

from pagedkit.validators import check_inputs, get_contract, validate_node
from pagedkit.validators.nodeview import onnx_dtype_of

# axes that are dynamic in a real model (token / batch / sequence extents), per tensor
DYNAMIC_AXES = {
    "PagedAttention": {
        "query": (0,), "key": (0,), "value": (0,), "cumulative_sequence_length": (0,), "past_seqlens": (0,),
        "block_table": (0, 1), "slot_mapping": (0,), "query_positions": (0,), "attention_bias": (0, 2, 3),
        "key_cache": (0,), "value_cache": (0,), "k_scale_cache": (0,), "v_scale_cache": (0,), "output": (0,),
        "key_cache_out": (0,), "value_cache_out": (0,), "k_scale_cache_out": (0,), "v_scale_cache_out": (0,),
        "output_qk": (1, 2),
    },
    "GroupQueryAttention": {
        "query": (0, 1), "key": (0, 1), "value": (0, 1), "past_key": (0, 2), "past_value": (0, 2),
        "seqlens_k": (0,), "position_ids": (0, 1), "attention_bias": (0, 2, 3), "query_seqlens": (0,),
        "output": (0, 1), "present_key": (0, 2), "present_value": (0, 2), "output_qk": (0, 2, 3),
    },
}


@dataclass
class Case:
    op_type: str
    attrs: dict
    inputs: dict  # contract input name -> torch.Tensor
    outputs: list  # requested contract output names
    out_info: dict = field(default_factory=dict)  # output name -> (onnx dtype, shape), static form
    name: str = ""
    node_hook: object = None  # callable(node) applied to the static node (e.g. to add surplus inputs)

    def copy(self) -> "Case":
        return Case(self.op_type, copy.deepcopy(self.attrs), dict(self.inputs), list(self.outputs),
                    dict(self.out_info), self.name, self.node_hook)

    @property
    def contract(self):
        return get_contract(self.op_type)

    def _names(self, params, present) -> list[str]:
        names = [p.name if p.name in present else "" for p in params]
        while names and not names[-1]:
            names.pop()
        return names

    def node(self, symbolic: str | None = None) -> tuple[onnx.NodeProto, dict]:
        """symbolic: None (all dims known), "dynamic" (token/batch/sequence axes symbolic), "all"."""
        c = self.contract
        node = helper.make_node(self.op_type, self._names(c.inputs, self.inputs),
                                self._names(c.outputs, self.outputs), name=f"{self.op_type}_0",
                                domain="com.microsoft", **self.attrs)
        info = {n: (onnx_dtype_of(t), tuple(t.shape)) for n, t in self.inputs.items()}
        info.update({n: self.out_info[n] for n in self.outputs if n in self.out_info})
        if symbolic:
            dyn = DYNAMIC_AXES[self.op_type]
            info = {n: (dt, tuple(f"{n}_d{i}" if symbolic == "all" or i in dyn.get(n, ()) else d
                                  for i, d in enumerate(shape)))
                    for n, (dt, shape) in info.items()}
        if self.node_hook is not None:
            self.node_hook(node)
        return node, info

    def constants(self) -> dict:
        return {n: t.numpy() for n, t in self.inputs.items() if t.dtype in (torch.int32, torch.int64)}

    def static_issues(self, symbolic: str | None = None, with_values: bool = False):
        node, info = self.node(symbolic)
        return validate_node(node, info, self.constants() if with_values else None)

    def runtime_issues(self, outputs: bool = True):
        return check_inputs(self.inputs, self.attrs, op_type=self.op_type,
                            outputs=self.outputs if outputs else None, node_name=f"{self.op_type}_0")

    def model(self) -> onnx.ModelProto:
        """Single-node model: every present input is a graph input, every output a graph output."""
        node, info = self.node()
        ins = [helper.make_tensor_value_info(n, *info[n]) for n in node.input if n]
        outs = [helper.make_tensor_value_info(n, *info[n]) for n in node.output if n]
        graph = helper.make_graph([node], f"{self.op_type}_single_node", ins, outs)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                       helper.make_opsetid("com.microsoft", 1)])


# ------------------------------------------------------------------------------------------------
# mutations (in place on a Case copy): used by the negative tests and the fuzz test
# ------------------------------------------------------------------------------------------------


def random_like(shape, dtype, seed=1):
    """A fresh random tensor (never all zeros) of the given shape and dtype."""
    g = _gen(seed)
    if dtype in (torch.int32, torch.int64, torch.int16):
        return torch.randint(1, 5, tuple(shape), generator=g, dtype=dtype)
    if dtype in (torch.uint8, torch.int8, torch.float8_e4m3fn):
        return _codes(g, tuple(shape), dtype)
    if dtype == torch.bool:
        return torch.rand(tuple(shape), generator=g) > 0.5
    return (torch.rand(tuple(shape), generator=g) + 0.5).to(dtype)


def with_shape(case: Case, name: str, shape, seed=1) -> None:
    case.inputs[name] = random_like(shape, case.inputs[name].dtype, seed)


def with_dtype(case: Case, name: str, dtype) -> None:
    t = case.inputs[name]
    case.inputs[name] = t.to(dtype) if t.is_floating_point() or dtype.is_floating_point else t.to(dtype)


def with_values(case: Case, name: str, values) -> None:
    case.inputs[name] = torch.tensor(values, dtype=case.inputs[name].dtype)


def add_input(case: Case, name: str, shape, dtype, seed=2) -> None:
    case.inputs[name] = random_like(shape, dtype, seed)


def drop(case: Case, *names: str) -> None:
    for n in names:
        case.inputs.pop(n, None)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(g, shape, dtype, scale=1.0):
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def _codes(g, shape, dtype):
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.int32).to(torch.uint8)
    if dtype == torch.int8:
        return torch.randint(-127, 128, shape, generator=g, dtype=torch.int32).to(torch.int8)
    return torch.randn(shape, generator=g).to(dtype)  # float8e4m3fn or a float cache


_CACHE = {"float": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn, "int4": torch.uint8}

# ------------------------------------------------------------------------------------------------
# PagedAttention
# ------------------------------------------------------------------------------------------------


def make_paged_case(*, num_heads=32, kv_num_heads=8, head_size=128, block_size=16, num_blocks=None,
                    past=(0, 5, 20), q_lens=(3, 1, 2), dtype=torch.float16, packed=False, rotary=True,
                    rotary_dim=None, latent=False, v_head_size=0, rotary_offset=0, scale=None, cache="float",
                    quant="NONE", rotation=False, slot_mapping=False, head_sink=False, qk_norm=False,
                    metadata=False, query_positions=False, bias=False, qk_output=0, scale_cache_dtype=torch.float16,
                    extra_blocks=1, cache_dtype_attr=None, seed=0, name="") -> Case:
    g = _gen(seed)
    past, q_lens = np.array(past, np.int64), np.array(q_lens, np.int64)
    batch, tokens = len(past), int(q_lens.sum())
    ext = past + q_lens
    need = -(-ext // block_size)
    max_blocks = int(need.max()) + extra_blocks
    num_blocks = num_blocks or int(need.sum()) + 3
    kv_hidden = kv_num_heads * head_size
    attrs = {"num_heads": num_heads, "kv_num_heads": kv_num_heads}
    inputs: dict[str, torch.Tensor] = {}
    if packed:
        inputs["query"] = _randn(g, (tokens, (num_heads + 2 * kv_num_heads) * head_size), dtype)
    else:
        inputs["query"] = _randn(g, (tokens, num_heads * head_size), dtype)
        inputs["key"] = _randn(g, (tokens, kv_hidden), dtype)
        if not latent:
            inputs["value"] = _randn(g, (tokens, kv_hidden), dtype)
    cdt = _CACHE[cache] or dtype
    chs = (head_size + 1) // 2 if cache == "int4" else head_size
    cshape = (num_blocks, block_size, kv_num_heads, chs)
    inputs["key_cache"] = _codes(g, cshape, cdt)
    if not latent:
        inputs["value_cache"] = _codes(g, cshape, cdt)
    csl = np.concatenate([[0], np.cumsum(q_lens)])
    inputs["cumulative_sequence_length"] = torch.tensor(csl, dtype=torch.int32)
    inputs["past_seqlens"] = torch.tensor(past, dtype=torch.int32)
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.full((batch, max_blocks), -1, dtype=torch.int32)
    used = 0
    for b in range(batch):
        table[b, : need[b]] = perm[used: used + need[b]].to(torch.int32)
        used += int(need[b])
    inputs["block_table"] = table
    max_pos = int(ext.max()) + 7
    if rotary:
        rd = rotary_dim or head_size - rotary_offset
        angle = torch.rand((max_pos, rd // 2), generator=g) * 6.28
        inputs["cos_cache"], inputs["sin_cache"] = angle.cos().to(dtype), angle.sin().to(dtype)
        attrs["do_rotary"] = 1
    if slot_mapping:
        slots = []
        for b in range(batch):
            for j in range(int(q_lens[b])):
                p = int(past[b]) + j
                slots.append(int(table[b, p // block_size]) * block_size + p % block_size)
        inputs["slot_mapping"] = torch.tensor(slots, dtype=torch.int32)
    if head_sink:
        inputs["head_sink"] = _randn(g, (num_heads,), dtype)
    if qk_norm:
        inputs["q_norm_weight"] = (1 + 0.1 * torch.randn((head_size,), generator=g)).to(dtype)
        inputs["k_norm_weight"] = (1 + 0.1 * torch.randn((head_size,), generator=g)).to(dtype)
    sides = ("k",) if latent else ("k", "v")
    if quant != "NONE":
        for s in sides:
            attrs[f"{s}_quant_type"] = quant
            if cache_dtype_attr is not None or cache == "int4":
                attrs[f"{s}_cache_dtype"] = cache_dtype_attr if cache_dtype_attr is not None else "int4"
            if quant == "PER_TENSOR":
                inputs[f"{s}_scale"] = (torch.rand((1,), generator=g) * 0.05 + 0.01).float()
            elif quant == "PER_CHANNEL":
                inputs[f"{s}_scale"] = (torch.rand((kv_num_heads, 1, head_size), generator=g) * 0.05 + 0.01).float()
            elif quant == "PER_TOKEN":
                inputs[f"{s}_scale_cache"] = (torch.rand((num_blocks, block_size, kv_num_heads), generator=g)
                                              * 0.05 + 0.01).to(scale_cache_dtype)
    if metadata:
        inputs["attention_metadata"] = torch.tensor([int(q_lens.max()), int(ext.max()), int(ext.min())],
                                                    dtype=torch.int32)
    if query_positions:
        pos = [int(past[b]) + j for b in range(batch) for j in range(int(q_lens[b]))]
        inputs["query_positions"] = torch.tensor(pos, dtype=torch.int32)
    if bias:
        inputs["attention_bias"] = _randn(g, (batch, num_heads, int(q_lens.max()), int(ext.max())), dtype)
    if rotation:
        attrs["qk_rotation"] = 1
        if not latent:
            attrs["v_rotation"] = 1
    if latent:
        attrs["kv_cache_layout"] = "LATENT"
    for k, v in (("v_head_size", v_head_size), ("rotary_offset", rotary_offset), ("qk_output", qk_output)):
        if v:
            attrs[k] = v
    if scale is not None:
        attrs["scale"] = float(scale)
    eff_v = v_head_size if latent and v_head_size else head_size
    tdt = onnx_dtype_of(inputs["query"])
    out_info = {"output": (tdt, (tokens, num_heads * eff_v)),
                "output_qk": (onnx.TensorProto.FLOAT, (num_heads, tokens, max_blocks * block_size))}
    outputs = ["output", "key_cache_out"] + ([] if latent else ["value_cache_out"])
    for s, iname in (("k", "key_cache"), ("v", "value_cache"), ("k", "k_scale_cache"), ("v", "v_scale_cache")):
        if iname in inputs:
            oname = iname + "_out"
            out_info[oname] = (onnx_dtype_of(inputs[iname]), tuple(inputs[iname].shape))
            if iname.endswith("scale_cache"):
                outputs.append(oname)
    if qk_output:
        outputs.append("output_qk")
    return Case("PagedAttention", attrs, inputs, outputs, out_info, name)


PAGED_CONFIGS = {
    "llama_gqa": {},
    "packed_qkv": {"packed": True},
    "mla_deepseek_v3": {"latent": True, "num_heads": 16, "kv_num_heads": 1, "head_size": 576, "v_head_size": 512,
                        "rotary_offset": 512, "rotary_dim": 64, "scale": 1 / math.sqrt(192)},
    "int8_per_tensor": {"cache": "int8", "quant": "PER_TENSOR"},
    "int8_per_channel": {"cache": "int8", "quant": "PER_CHANNEL", "dtype": torch.bfloat16},
    "fp8_per_tensor": {"cache": "fp8", "quant": "PER_TENSOR"},
    "fp8_per_channel": {"cache": "fp8", "quant": "PER_CHANNEL", "cache_dtype_attr": "float8e4m3fn"},
    "int4_per_tensor": {"cache": "int4", "quant": "PER_TENSOR"},
    "int4_per_channel": {"cache": "int4", "quant": "PER_CHANNEL"},
    "int4_per_token_rotation": {"cache": "int4", "quant": "PER_TOKEN", "rotation": True},
    "int8_per_token_f32_scales": {"cache": "int8", "quant": "PER_TOKEN", "scale_cache_dtype": torch.float32},
    "bias_output_qk": {"bias": True, "qk_output": 1},
    "query_positions": {"query_positions": True},
    "all_features": {"dtype": torch.bfloat16, "slot_mapping": True, "head_sink": True, "qk_norm": True,
                     "metadata": True, "query_positions": True, "bias": True, "qk_output": 2},
    "mla_int8_per_tensor": {"latent": True, "num_heads": 16, "kv_num_heads": 1, "head_size": 576,
                            "v_head_size": 512, "rotary_offset": 512, "rotary_dim": 64, "scale": 0.07,
                            "cache": "int8", "quant": "PER_TENSOR"},
    "mla_int4_per_token": {"latent": True, "num_heads": 16, "kv_num_heads": 1, "head_size": 576,
                           "v_head_size": 512, "rotary_offset": 512, "rotary_dim": 64, "scale": 0.07,
                           "cache": "int4", "quant": "PER_TOKEN"},
    "small_block_32_window": {"num_heads": 8, "kv_num_heads": 2, "head_size": 64, "block_size": 32,
                              "past": (40, 0), "q_lens": (1, 9), "attrs": {"local_window_size": 16, "softcap": 30.0}},
    "no_rotary_decode": {"rotary": False, "q_lens": (1, 1, 1), "past": (17, 3, 64)},
}


def paged_case(config: str = "llama_gqa", seed: int = 0, **overrides) -> Case:
    kw = {**PAGED_CONFIGS[config], **overrides}
    extra_attrs = kw.pop("attrs", {})
    case = make_paged_case(seed=seed, name=config, **kw)
    case.attrs.update(extra_attrs)
    return case


# ------------------------------------------------------------------------------------------------
# GroupQueryAttention
# ------------------------------------------------------------------------------------------------


def make_gqa_case(*, batch=2, seq=1, capacity=5, past_lens=(5, 3), num_heads=4, kv_num_heads=2, head_size=16,
                  dtype=torch.float32, past=True, packed=False, rotary=False, position_ids=False, bias=False,
                  head_sink=False, qk_norm=False, quant="NONE", bits=8, cache="float", qk_output=0,
                  query_seqlens=None, present=True, seed=0, name="") -> Case:
    """past_lens: cached tokens per batch entry before the step; seq new tokens each (or query_seqlens)."""
    g = _gen(seed)
    q_valid = np.array(query_seqlens if query_seqlens is not None else [seq] * batch, np.int64)
    total_b = np.array(past_lens, np.int64)[:batch] + q_valid if past else np.full(batch, seq)
    seqlens_k = total_b - 1
    total = int(total_b.max())
    attrs = {"num_heads": num_heads, "kv_num_heads": kv_num_heads}
    kvh = kv_num_heads * head_size
    inputs = {}
    if packed:
        inputs["query"] = _randn(g, (batch, seq, (num_heads + 2 * kv_num_heads) * head_size), dtype)
    else:
        inputs["query"] = _randn(g, (batch, seq, num_heads * head_size), dtype)
        inputs["key"] = _randn(g, (batch, seq, kvh), dtype)
        inputs["value"] = _randn(g, (batch, seq, kvh), dtype)
    cdt = _CACHE[cache] or dtype
    chs = (head_size + 1) // 2 if cache == "int4" else head_size
    if past:
        inputs["past_key"] = _codes(g, (batch, kv_num_heads, capacity, chs), cdt)
        inputs["past_value"] = _codes(g, (batch, kv_num_heads, capacity, chs), cdt)
    inputs["seqlens_k"] = torch.tensor(seqlens_k, dtype=torch.int32)
    inputs["total_sequence_length"] = torch.tensor(total, dtype=torch.int32)
    if rotary:
        angle = torch.rand((total + 8, head_size // 2), generator=g) * 6.28
        inputs["cos_cache"], inputs["sin_cache"] = angle.cos().to(dtype), angle.sin().to(dtype)
        attrs["do_rotary"] = 1
        if position_ids:
            start = total_b - q_valid
            inputs["position_ids"] = torch.tensor(np.stack([start + j for j in range(seq)], 1), dtype=torch.int64)
    if bias:
        inputs["attention_bias"] = _randn(g, (batch, num_heads, seq, total), dtype)
    if head_sink:
        inputs["head_sink"] = _randn(g, (num_heads,), dtype)
    if quant != "NONE":
        attrs.update(k_quant_type=quant, v_quant_type=quant, kv_cache_bit_width=bits)
        shape = (1,) if quant == "PER_TENSOR" else (kv_num_heads, 1, head_size)
        inputs["k_scale"] = (torch.rand(shape, generator=g) * 0.05 + 0.01).float()
        inputs["v_scale"] = (torch.rand(shape, generator=g) * 0.05 + 0.01).float()
    if qk_norm:
        inputs["q_norm_weight"] = (1 + 0.1 * torch.randn((head_size,), generator=g)).to(dtype)
        inputs["k_norm_weight"] = (1 + 0.1 * torch.randn((head_size,), generator=g)).to(dtype)
    if query_seqlens is not None:
        inputs["query_seqlens"] = torch.tensor(q_valid, dtype=torch.int32)
    if qk_output:
        attrs["qk_output"] = qk_output
    tdt = onnx_dtype_of(inputs["query"])
    pres = max(total, capacity) if past else total
    cache_t = onnx_dtype_of(inputs["past_key"]) if past else tdt
    out_info = {"output": (tdt, (batch, seq, num_heads * head_size)),
                "present_key": (cache_t, (batch, kv_num_heads, pres, chs)),
                "present_value": (cache_t, (batch, kv_num_heads, pres, chs)),
                "output_qk": (tdt, (batch, num_heads, seq, total))}
    outputs = ["output"] + (["present_key", "present_value"] if present else []) + (["output_qk"] if qk_output else [])
    return Case("GroupQueryAttention", attrs, inputs, outputs, out_info, name)


GQA_CONFIGS = {
    "decode": {},
    "prompt_no_past": {"seq": 4, "past": False},
    "packed_decode": {"packed": True},
    "rotary_position_ids": {"rotary": True, "position_ids": True},
    "int8_per_tensor": {"cache": "int8", "quant": "PER_TENSOR", "bits": 8},
    "int8_per_channel": {"cache": "int8", "quant": "PER_CHANNEL", "bits": 8},
    "int4_per_tensor": {"cache": "int4", "quant": "PER_TENSOR", "bits": 4},
    "int4_per_channel": {"cache": "int4", "quant": "PER_CHANNEL", "bits": 4},
    "bias_output_qk": {"bias": True, "qk_output": 1},
    "head_sink_softcap": {"head_sink": True, "attrs": {"softcap": 20.0, "smooth_softmax": 1}},
    "sliding_window_cache": {"capacity": 4, "past_lens": (4, 4), "attrs": {"local_window_size": 4,
                                                                            "sliding_window_cache": 1}},
    "query_seqlens_chunk": {"seq": 3, "capacity": 4, "past_lens": (4, 1), "query_seqlens": (3, 2)},
    "qk_norm_fp16": {"dtype": torch.float16, "qk_norm": True, "rotary": True},
    "bidirectional_prompt": {"seq": 3, "past": False, "attrs": {"causal": 0}},
}

# configurations ORT's CPU GroupQueryAttention kernel can run (fp32, no QK-norm): an independent oracle
GQA_ORT_CPU = [n for n in GQA_CONFIGS if n != "qk_norm_fp16"]


def gqa_case(config: str = "decode", seed: int = 0, **overrides) -> Case:
    kw = {**GQA_CONFIGS[config], **overrides}
    extra_attrs = kw.pop("attrs", {})
    case = make_gqa_case(seed=seed, name=config, **kw)
    case.attrs.update(extra_attrs)
    if case.attrs.get("sliding_window_cache") and "past_key" in case.inputs:  # present keeps the window capacity
        for n in ("present_key", "present_value"):
            dt, shape = case.out_info[n]
            case.out_info[n] = (dt, shape[:2] + (case.inputs["past_key"].shape[2],) + shape[3:])
    return case


def run_ort_cpu(case: Case):
    """Run a GQA case on onnxruntime's CPU kernel; returns the outputs (raises on rejection)."""
    import onnxruntime as ort

    sess = ort.InferenceSession(case.model().SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {n: t.numpy() for n, t in case.inputs.items()}
    return sess.run(None, feeds)


# ---- mutation combinators for the negative tests: each returns f(case) that edits the case ----

def attrs(**kw):
    return lambda c: c.attrs.update(kw)



def unset(*names):
    return lambda c: [c.attrs.pop(n, None) for n in names]



def seq(*fs):
    return lambda c: [f(c) for f in fs]



def shape(name, *s):
    return lambda c: with_shape(c, name, s)



def dtype(name, dt):
    return lambda c: with_dtype(c, name, dt)



def vals(name, v):
    return lambda c: with_values(c, name, v)



def rm(*names):
    return lambda c: drop(c, *names)



def out_add(name):
    return lambda c: c.outputs.append(name)



def out_rm(name):
    return lambda c: c.outputs.remove(name)

