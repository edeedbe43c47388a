"""How a model is cut into N tensor-parallel ranks (Megatron-style), as data: one rule per Hugging Face parameter.

Units a rule splits by (each rank takes a contiguous range of them):
  q    query heads: rank r takes heads [r H/N, (r+1) H/N); a tensor of H x w rows (any per-head width w: the
       head size, DeepSeek's nope + rope or nope + dv) is cut at head boundaries;
  kv   KV heads: split when N divides them (rank r: [r Hkv/N, (r+1) Hkv/N)); when Hkv divides N, each rank keeps
       the one KV head its query heads read (head r Hkv / N: replicated on N / Hkv ranks); refused otherwise;
  i    intermediate features (dense MLP, shared experts, experts): [r I/N, (r+1) I/N);
  i2   interleaved gate / up pairs (GPT-OSS's fused experts [g0, u0, g1, u1, ...]): pairs [r I/N, (r+1) I/N).
A rule names the axis and its sections: a fused tensor of several parts along that axis ([q | k | v] rows,
[gate | up] rows) is cut part by part and the rank's pieces concatenated in the same order.

Column-parallel (q / k / v, gate / up, experts' fc1) rules cut output features; row-parallel ones (o, down,
experts' fc2: `row` True) cut the reduction (input) dimension, and their outputs are partial sums that an
AllReduce adds (build.py). A row-parallel bias is kept on rank 0 and zero elsewhere (added once by the sum).
Parameters no rule names are replicated when they are known to be (norms, routers, MLA's latent projections,
embeddings); anything else is refused, naming the parameter: a new family joins by adding its rules here.

With int4 weights (MatMulNBits / QMoE, blocks of `block` input features), every row-parallel shard must hold
whole blocks, so that each rank's blocks are exactly the unsharded model's: refused otherwise, naming the tensor.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

Q, KV, I, I2 = "q", "kv", "i", "i2"


@dataclass(frozen=True)
class Rule:
    """How to cut one parameter: along `axis`, in `sections` (one unit kind per fused part); `row`: the cut
    dimension is the one the product reduces (row-parallel). `rank0`: a bias kept on rank 0 only."""

    axis: int = 0
    sections: tuple[str, ...] = (Q,)
    row: bool = False
    rank0: bool = False


RANK0 = Rule(rank0=True)
REPLICATE = None

_L = r"^model\.layers\.\d+\."
# (pattern on the parameter name, rule); the first match wins; REPLICATE: kept whole on every rank
COMMON: tuple[tuple[str, Rule | None], ...] = (
    (_L + r"self_attn\.q_proj\.(weight|bias)$", Rule(0, (Q,))),
    (_L + r"self_attn\.[kv]_proj\.(weight|bias)$", Rule(0, (KV,))),
    (_L + r"self_attn\.qkv_proj\.(weight|bias)$", Rule(0, (Q, KV, KV))),
    (_L + r"self_attn\.o_proj\.weight$", Rule(1, (Q,), row=True)),
    (_L + r"self_attn\.o_proj\.bias$", RANK0),
    (_L + r"self_attn\.sinks$", Rule(0, (Q,))),
    (_L + r"self_attn\.(q_b_proj|kv_b_proj)\.weight$", Rule(0, (Q,))),  # MLA: per query head rows
    (_L + r"self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.(weight|bias)$", REPLICATE),  # MLA: the shared latent
    (_L + r"self_attn\.(q_a_layernorm|kv_a_layernorm)\.weight$", REPLICATE),
    (_L + r"mlp\.(shared_experts?\.)?(gate|up)_proj\.(weight|bias)$", Rule(0, (I,))),
    (_L + r"mlp\.(shared_experts?\.)?gate_up_proj\.weight$", Rule(0, (I, I))),  # Phi-3: rows [gate | up]
    (_L + r"mlp\.(shared_experts?\.)?down_proj\.weight$", Rule(1, (I,), row=True)),
    (_L + r"mlp\.(shared_experts?\.)?down_proj\.bias$", RANK0),
    (_L + r"mlp\.experts\.gate_up_proj$", Rule(1, (I, I))),  # transformers' fused experts [E, 2I, H]: [gate | up]
    (_L + r"mlp\.experts\.down_proj$", Rule(2, (I,), row=True)),  # [E, H, I]
    (_L + r"mlp\.(gate|router)\.(weight|bias)$", REPLICATE),  # routers: every rank routes every token
    (_L + r"mlp\.shared_expert_gate\.weight$", REPLICATE),
    (_L + r"(self_attn\.)?[a-z_]*norm\.(weight|bias)$", REPLICATE),  # norms (QK-norm: per head, checked)
)
# family name -> rules tried before COMMON
FAMILY: dict[str, tuple[tuple[str, Rule | None], ...]] = {
    "gpt_oss": (  # GptOssExperts: gate_up [E, H, 2I] interleaved along its last axis, down [E, I, H]
        (_L + r"mlp\.experts\.gate_up_proj$", Rule(2, (I2,))),
        (_L + r"mlp\.experts\.gate_up_proj_bias$", Rule(1, (I2,))),
        (_L + r"mlp\.experts\.down_proj$", Rule(1, (I,), row=True)),
        (_L + r"mlp\.experts\.down_proj_bias$", RANK0),
    ),
}
# families whose graphs are built entirely from the hooks these rules cover (tested: tests/test_tp_*.py)
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek",
             "gemma", "gemma2", "granite", "phi3")
_TOP = {"model.embed_tokens.weight", "model.norm.weight", "model.norm.bias", "lm_head.weight", "lm_head.bias"}


class ShardError(ValueError):
    """A model that cannot be cut into N ranks as asked; the message names the tensor or the count."""


@dataclass(frozen=True)
class ShardPlan:
    """The cut of one model into `world` ranks."""

    world: int
    family: str
    heads: int  # query heads
    kv_heads: int  # KV heads of the graph (MLA: query heads; its latent cache is replicated, not cut)
    vocab: int
    latent: bool = False
    block: int | None = None  # int4 weights: input features per quantization block

    @property
    def heads_per_rank(self) -> int:
        return self.heads // self.world

    @property
    def kv_split(self) -> bool:
        return self.kv_heads % self.world == 0

    @property
    def kv_per_rank(self) -> int:
        """KV heads each rank caches (LATENT: the one latent head, replicated)."""
        if self.latent:
            return 1
        return self.kv_heads // self.world if self.kv_split else 1

    @property
    def vocab_per_rank(self) -> int:
        return math.ceil(self.vocab / self.world)

    def units(self, kind: str, size: int) -> int:
        """How many units of `kind` a section of `size` rows holds."""
        return {Q: self.heads, KV: self.heads if self.latent else self.kv_heads, I: size, I2: size // 2}[kind]

    def unit_range(self, kind: str, units: int, rank: int) -> tuple[int, int]:
        if kind == KV and not self.latent and not self.kv_split:  # one KV head, the one rank r's queries read
            h = rank * self.kv_heads // self.world
            return h, h + 1
        per = units // self.world
        return rank * per, (rank + 1) * per

    def vocab_range(self, rank: int) -> tuple[int, int]:
        per = self.vocab_per_rank
        return min(rank * per, self.vocab), min((rank + 1) * per, self.vocab)

    def to_json(self) -> dict:
        return {"world_size": self.world, "num_heads_per_rank": self.heads_per_rank,
                "kv_num_heads_per_rank": self.kv_per_rank,
                "kv_heads": "latent (replicated)" if self.latent else ("split" if self.kv_split else
                                                                       f"replicated x{self.world // self.kv_heads}"),
                "vocab_per_rank": self.vocab_per_rank}


def rule_for(family: str, name: str) -> Rule | None:
    """The rule of parameter `name` (None: replicated); ShardError when no rule knows it."""
    for pattern, rule in FAMILY.get(family, ()) + COMMON:
        if re.search(pattern, name):
            return rule
    raise ShardError(f"--tp: the {family} family's parameter {name!r} has no tensor-parallel rule "
                     "(pagedkit/exporters/tp/plan.py)")


def make_plan(model, family, world: int, block: int | None = None) -> ShardPlan:
    """The plan of `model` (a Hugging Face causal LM) for `world` ranks, after checking every count and tensor."""
    config = model.config
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ShardError(f"--tp: expected a positive number of ranks, got {world!r}")
    if family.name not in SUPPORTED:
        raise ShardError(f"--tp: the {family.name} family is not supported with tensor parallelism yet; "
                         f"supported: {', '.join(SUPPORTED)}")
    latent = family.name == "deepseek"
    heads = int(config.num_attention_heads)
    kv = heads if latent else int(config.num_key_value_heads)
    plan = ShardPlan(world, family.name, heads, kv, int(config.vocab_size), latent, block)
    if heads % world:
        raise ShardError(f"--tp {world}: {heads} attention heads are not divisible by {world}")
    if not latent and kv % world and world % kv:
        raise ShardError(f"--tp {world}: {kv} KV heads neither divide into {world} ranks nor divide {world} "
                         "(a rank would need parts of two KV heads' query groups)")
    head_dim = family.head_size(family.layers(model)[0].self_attn, config)
    for name, p in model.named_parameters():
        if name in _TOP:
            continue
        if re.search(r"(q_norm|k_norm)\.weight$", name) and p.numel() != head_dim:
            raise ShardError(f"--tp: {name} {tuple(p.shape)} normalizes across heads (not per head of "
                             f"{head_dim}): a cross-rank reduction pagedkit does not export")
        rule = rule_for(family.name, name)
        if rule is not None and not rule.rank0:
            _check_cut(plan, name, tuple(p.shape), rule)
    return plan


def _check_cut(plan: ShardPlan, name: str, shape: tuple, rule: Rule) -> None:
    size = shape[rule.axis]
    parts = _parts(plan, size, rule)
    for kind, part in zip(rule.sections, parts):
        units = plan.units(kind, part)
        if units <= 0 or part % units or (not (kind == KV and not plan.kv_split) and units % plan.world):
            raise ShardError(f"--tp {plan.world}: {name} {shape}: {part} {kind!r} rows along axis {rule.axis} do "
                             f"not split into {plan.world} equal parts")
        lo, hi = plan.unit_range(kind, units, 0)
        width = (hi - lo) * (part // units)
        if rule.row and plan.block and width % plan.block:
            raise ShardError(f"--tp {plan.world} with int4 weights: {name} {shape}: each rank's {width} input "
                             f"features along axis {rule.axis} are not whole quantization blocks of {plan.block} "
                             "(a shard must start and end on block boundaries)")


def _parts(plan: ShardPlan, size: int, rule: Rule) -> list[int]:
    """Sizes of the sections of a fused axis of `size` rows."""
    if rule.sections == (Q, KV, KV):
        d = size // (plan.heads + 2 * plan.kv_heads)
        return [plan.heads * d, plan.kv_heads * d, plan.kv_heads * d]
    n = len(rule.sections)
    if size % n:
        raise ShardError(f"--tp: an axis of {size} rows does not hold {n} equal parts")
    return [size // n] * n


def shard(plan: ShardPlan, rule: Rule | None, value: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank `rank`'s piece of a parameter (a torch tensor or a LazyTensor: the cut is recorded lazily)."""
    if rule is None:
        return value
    if rule.rank0:
        return value if rank == 0 else torch.zeros_like(value)
    size = value.shape[rule.axis]
    pieces, start = [], 0
    for kind, part in zip(rule.sections, _parts(plan, size, rule)):
        units = plan.units(kind, part)
        w = part // units
        lo, hi = plan.unit_range(kind, units, rank)
        pieces.append(value.narrow(rule.axis, start + lo * w, (hi - lo) * w))
        start += part
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, rule.axis)
