"""Planning a tensor-parallel set: the collective traffic and the per-rank footprint of a model cut into N ranks,
and docs/distributed.md's table for every built-in at N = 1, 2, 4, 8.

    python -m pagedkit.exporters.tp.comm                 # the table on stdout
    python -m pagedkit.exporters.tp.comm --write-doc     # (re)write its section of docs/distributed.md
    python -m pagedkit.exporters.tp.comm --check         # exit 1 when that section is stale

Exact (arithmetic on the config, and plan.py's cut applied to the model's parameters built on the meta device):
- all-reduces per decode step: 2 per layer (after the attention block, after the feed-forward block) at any N > 1;
  each carries tokens x hidden values (2 bytes in an fp16 export; a bf16 export reduces in float32: 4);
- the LM head's all-gather, one per step: tokens x N x ceil(V / N) logits (2 bytes each in an fp16 export);
- the weights each rank holds (fp16: 2 bytes a parameter): its slices, plus what is replicated (embeddings, norms,
  routers, MLA's latent projections) and its vocabulary rows of the LM head;
- the KV cache per token per rank (fp16 caches): layers x the rank's KV heads x head size x 2 (K and V) x 2 bytes;
  MLA: (kv_lora_rank + qk_rope_head_dim) x 2 bytes per layer, the same on every rank (replicated latent).
  Sliding-window layers are counted at full context (an upper bound).

Predicted (stated as such: no multi-GPU machine has run these sets yet), for H200s, a decode step of batch B at
context C on each rank:
    t = (weights_rank + B x C x kv_rank) / HBM  +  2 L x (ALPHA + 2 (N - 1) / N x B x hidden x 2 / BUS)
        + (ALPHA + (N - 1) / N x B x V x 2 / BUS)
HBM = 4.4 TB/s (an H200's achievable HBM3e read, apps/bench/floor.py), BUS = 360 GB/s (NVLink 4: 450 GB/s each
way per GPU, at 80%), ALPHA = 10 us a small NCCL collective (decode all-reduces are latency-bound: 8 tokens x
4096 x 2 bytes = 64 KiB). Memory per rank = weights_rank + B x C x kv_rank, against 141 GB x 0.9.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

WORLDS = (1, 2, 4, 8)
BATCH, CONTEXT = 8, 4096
HBM = 4.4e12  # bytes / s (predicted read bandwidth)
BUS = 360e9  # bytes / s (predicted NCCL ring bus bandwidth over NVLink 4)
ALPHA = 10e-6  # s (predicted latency of one small NCCL collective)
GPU_BYTES = 141e9 * 0.9
BUILTIN = Path(__file__).resolve().parent.parent / "builtin"
DOC = Path(__file__).resolve().parents[3] / "docs" / "distributed.md"
BEGIN, END = "<!-- tp-table:begin -->\n", "<!-- tp-table:end -->\n"


@dataclass(frozen=True)
class Cut:
    """One model at N ranks. `refused`: why it cannot be cut so (then only the exact traffic columns hold)."""

    world: int
    weights: int = 0  # bytes of rank 0 (the one with the row-parallel biases), fp16
    kv_per_token: int = 0  # bytes per cached token on one rank, fp16 caches
    refused: str | None = None
    int4_weights: int = 0  # predicted: matrices as int4 blocks of 32 (0.5 + 2 / 32 bytes a weight), the rest fp16

    def memory(self, batch: int = BATCH, context: int = CONTEXT, int4: bool = False) -> float:
        return (self.int4_weights if int4 else self.weights) + batch * context * self.kv_per_token


@dataclass(frozen=True)
class Traffic:
    layers: int
    hidden: int
    vocab: int

    def all_reduces(self, world: int) -> int:
        return 0 if world == 1 else 2 * self.layers

    def reduce_bytes_per_token(self, world: int) -> int:
        """Bytes one token adds to a step's all-reduces (fp16 export), summed over the step's calls."""
        return self.all_reduces(world) * self.hidden * 2

    def gather_bytes_per_token(self, world: int) -> int:
        return 0 if world == 1 else world * math.ceil(self.vocab / world) * 2

    def seconds(self, world: int, batch: int = BATCH) -> float:
        """Predicted collective time of one decode step (module docstring)."""
        if world == 1:
            return 0.0
        ring = 2 * (world - 1) / world
        reduce = self.all_reduces(world) * (ALPHA + ring * batch * self.hidden * 2 / BUS)
        return reduce + ALPHA + (world - 1) / world * batch * self.gather_bytes_per_token(world) / BUS


def load_config(name: str):
    import transformers

    data = json.loads((BUILTIN / f"{name}.json").read_text(encoding="utf-8"))
    return transformers.AutoConfig.for_model(**data)


def meta_model(config):
    import torch
    import transformers

    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def cut(model, world: int) -> Cut:
    """Rank 0's fp16 weight bytes and KV bytes per token at `world` ranks (exact; plan.py's cut)."""
    from ..registry import family_for
    from .plan import _TOP, ShardError, make_plan, rule_for, shard

    config = model.config
    try:
        family = family_for(config)
        plan = make_plan(model, family, world) if world > 1 else None
    except (ShardError, NotImplementedError) as exc:
        return Cut(world, refused=" ".join(str(exc).split()))
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    total, matrices = 0, 0
    for name, p in model.named_parameters():
        if plan is None or name in _TOP:
            n = p.numel()
            if plan is not None and name.startswith("lm_head."):
                n = plan.vocab_per_rank * (p.numel() // p.shape[0])
        else:
            rule = rule_for(plan.family, name)
            n = p.numel() if rule is None or rule.rank0 else shard(plan, rule, p, 0).numel()
        total += n
        matrices += n if p.dim() >= 2 and "embed_tokens" not in name else 0
    if tied:  # a tied head: its own (sliced) copy once the weights are int4 / cut (quantize.py, build.py)
        extra = (plan.vocab_per_rank if plan is not None else config.vocab_size) * config.hidden_size
        total += extra if plan is not None else 0
        matrices += extra
    int4 = 2 * (total - matrices) + matrices * (0.5 + 2 / 32)
    return Cut(world, 2 * total, kv_bytes_per_token(config, world, plan), int4_weights=int(int4))


def kv_bytes_per_token(config, world: int, plan) -> int:
    layers = config.num_hidden_layers
    if getattr(config, "kv_lora_rank", None):  # MLA: the latent, replicated
        return layers * (config.kv_lora_rank + config.qk_rope_head_dim) * 2
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv = plan.kv_per_rank if plan is not None else config.num_key_value_heads
    return layers * kv * head_dim * 2 * 2


def rows(names: list[str] | None = None) -> list[tuple[str, str, Traffic, list[Cut]]]:
    """(name, model_type, traffic, cuts at WORLDS) for the built-ins (all by default)."""
    out = []
    for name in names or sorted(p.stem for p in BUILTIN.glob("*.json")):
        config = load_config(name)
        text = getattr(config, "get_text_config", lambda: config)()
        model = meta_model(config)
        traffic = Traffic(text.num_hidden_layers, text.hidden_size, text.vocab_size)
        out.append((name, config.model_type, traffic, [cut(model, n) for n in WORLDS]))
    return out


def _gb(x: float) -> str:
    return f"{x / 1e9:,.1f}"


def smallest(cuts: list[Cut], int4: bool) -> str:
    """The fewest ranks (of WORLDS) whose memory fits an H200 at BATCH x CONTEXT, or '> 8'."""
    for c in cuts:
        if not c.refused and c.memory(int4=int4) <= GPU_BYTES:
            return str(c.world)
    return "> 8" if not cuts[-1].refused else "-"


def table(names: list[str] | None = None) -> str:
    lines = ["| model | all-reduces / step | all-reduce bytes / token / step | all-gather bytes / token | "
             + " | ".join(f"TP {n}" for n in WORLDS) + " | fewest H200s (fp16 / int4) |",
             "|---|---|---|---|" + "---|" * len(WORLDS) + "---|"]
    notes: dict[str, int] = {}
    for name, model_type, t, cuts in rows(names):
        cells = []
        for c in cuts:
            if c.refused:
                key = ("its family is not cut yet (not in exporters/tp/plan.py SUPPORTED)"
                       if "is not supported" in c.refused else re.sub(r"^--tp( \d+)?: ", "", c.refused))
                notes.setdefault(key, len(notes) + 1)
                cells.append(f"not cut ({notes[key]})")
                continue
            step = c.memory() / HBM + t.seconds(c.world)
            cells.append(f"{_gb(c.weights)} GB, {c.kv_per_token / 1024:,.1f} KiB, {step * 1e3:,.2f} ms")
        lines.append(f"| {name} ({model_type}) | {t.all_reduces(2)} | {t.reduce_bytes_per_token(2):,} | "
                     f"{t.gather_bytes_per_token(2):,} | " + " | ".join(cells)
                     + f" | {smallest(cuts, False)} / {smallest(cuts, True)} |")
    lines.append("")
    lines += [f"({i}) {why}" for why, i in notes.items()]
    return "\n".join(lines) + "\n"


def _section(doc: str) -> tuple[int, int]:
    i, j = doc.find(BEGIN), doc.find(END)
    if i < 0 or j < i:
        raise ValueError(f"{DOC}: no {BEGIN.strip()} ... {END.strip()} section")
    return i + len(BEGIN), j


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pagedkit.exporters.tp.comm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--write-doc", action="store_true", help=f"rewrite the table in {DOC.name}")
    ap.add_argument("--check", action="store_true", help=f"exit 1 when the table in {DOC.name} is stale")
    args = ap.parse_args(argv)
    text = table()
    if not (args.write_doc or args.check):
        print(text, end="")
        return 0
    doc = DOC.read_text(encoding="utf-8")
    i, j = _section(doc)
    if args.check:
        if doc[i:j] != text:
            print(f"stale: {DOC}; regenerate with `python -m pagedkit.exporters.tp.comm --write-doc`", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(doc[:i] + text + doc[j:], encoding="utf-8")
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
