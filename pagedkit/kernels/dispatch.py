"""Attention kernel dispatch: which kernel variants serve a node (session creation, static information
only) and which of them runs a call (per run, host-side plan information only); both are reported.

Variants declare themselves (`kernels/variant.py`: one `VARIANT = KernelVariant(...)` per module) and are
listed here as lazy "module:VARIANT" strings in priority order (`VARIANTS`), like the exporter families;
`register_variant("pkg.mod:VARIANT")` adds one more (a test, a plugin) without editing this file.

1. Creation (`bind`): the node's static facts become a `NodeInfo` (node_facts.py: the validator's
   `NodeView` over the model's value_info and, for PagedAttention, its `paged_dims`: head sizes, heads,
   block size, cache formats, T, present inputs, layout; never tensor values). Every variant of the op is asked
   (`KernelVariant.refusal`: op, device, T, features, then its own `supports`); those that accept form the
   node's serving list, the others' reasons are kept (`AttentionCall.refused`). A variant that runs on
   CPU copies (the loop-based reference) serves a non-CPU device only as the reference fallback
   (contract-decisions §9: allowed by default, with a one-time warning; refused with
   allow_reference_fallback=False). With `capturable=True` non-capturable variants are refused. No
   serving variant: NotImplementedError naming the node and every variant's reason.
2. Run (`AttentionCall.run(inputs, plan=None)`): the first serving variant whose `plans` include the
   run's plan hint ("decode", "prefill", "chunked_prefill"; None = "mixed") runs it; its name is
   `AttentionCall.last_variant`; with PAGEDKIT_KERNEL_DEBUG=1 the first call of each node on each
   variant prints `pagedkit: PagedAttention node 'n': kernel=triton_paged plan=mixed capturable`. Most variants serve "mixed"; triton_mla serves "decode" (LATENT decode steps) and sdpa_prefill "prefill"
   (first prompts, on torch's fused attention), so those hints pick them where they serve the node.

`AttentionCall` also holds the node's inputs / outputs by contract name, computed once, and the cache
aliasing the runtime promises: a cache output IS its cache input (same tensor, updated in place), as
onnxruntime does with shared past/present buffers. Calls run with `validate=False` (the session
validated the node at creation); a call that fails unvalidated is diagnosed by the full validator
(`check_inputs`), so a bad input still surfaces as a ValidationError listing every issue.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

import onnx
import torch

from .. import settings
from ..validators.checks import check_inputs
from ..validators.contract import CONTRACTS, get_contract
from ..validators.issues import ValidationError
from .node_facts import NodeInfo, node_info  # noqa: F401 (re-exported)
from .variant import FEATURES, OP_FEATURES, PLANS, KernelVariant  # noqa: F401 (re-exported)

# host-memory inputs and cache aliasing are contract facts (validators/contract.py)
HOST_INPUTS = {op: c.host_inputs for op, c in CONTRACTS.items()}
CACHE_ALIASES = {op: c.cache_aliases for op, c in CONTRACTS.items()}

# every variant, in priority order ("module:VARIANT"; "." modules are relative to pagedkit.kernels).
# A new variant is one new file plus one line here. The loop-based reference of each op comes last.
VARIANTS: list[str] = [
    ".triton.mla:VARIANT",
    ".triton.sdpa_prefill:VARIANT",
    ".triton.paged:VARIANT",
    ".paged.torch_planned:VARIANT",
    ".paged.torch_sdpa:VARIANT",
    ".paged.reference:VARIANT",
    ".triton.gqa:VARIANT",
    ".gqa.reference:VARIANT",
]
_extra: list[tuple[str, str | None]] = []  # register_variant(): (spec, name of the variant it goes before)
_loaded: dict[str, KernelVariant] = {}


def _load(spec: str) -> KernelVariant:
    if spec not in _loaded:
        module, _, attr = spec.partition(":")
        mod = importlib.import_module(module, __package__ if module.startswith(".") else None)
        variant = getattr(mod, attr or "VARIANT")
        if not isinstance(variant, KernelVariant):
            raise TypeError(f"{spec}: expected a KernelVariant, got {type(variant).__name__}")
        _loaded[spec] = variant
    return _loaded[spec]


def register_variant(spec: str, *, before: str | None = None) -> KernelVariant:
    """Add a variant ("module:VARIANT") to the priority list: before the variant named `before`, by default
    before the first variant of its op that runs on CPU copies (the reference stays the last resort)."""
    variant = _load(spec)
    specs = _specs()
    if spec in specs:
        return variant
    if any(_load(s).name == variant.name and _load(s).op == variant.op for s in specs):
        raise ValueError(f"a variant named {variant.name!r} is already registered")
    _extra.append((spec, before))
    return variant


def unregister_variant(spec: str) -> None:
    _extra[:] = [(s, b) for s, b in _extra if s != spec]


def _specs() -> list[str]:
    specs = list(VARIANTS)
    for spec, before in _extra:
        v = _load(spec)
        at = len(specs)
        for i, s in enumerate(specs):
            other = _load(s)
            if (before is not None and other.name == before) or \
               (before is None and other.op == v.op and other.stages_on_cpu):
                at = i
                break
        specs.insert(at, spec)
    return specs


def variants(op_type: str | None = None) -> list[KernelVariant]:
    """The declared variants (of one op), in priority order."""
    return [v for v in map(_load, _specs()) if op_type is None or v.op == op_type]


# ------------------------------------------------------------------------------------------------
# Creation: the serving variants of a node
# ------------------------------------------------------------------------------------------------

def serving_variants(info: NodeInfo, *, allow_reference_fallback: bool = True, capturable: bool = False
                     ) -> tuple[list[KernelVariant], dict[str, str]]:
    """(variants serving the node in priority order, {refused variant: reason})."""
    serving, refused = [], {}
    for v in variants(info.op_type):
        why = v.refusal(info)
        if why is None and v.stages_on_cpu and info.device.type != "cpu" and not allow_reference_fallback:
            why = (f"runs on CPU copies of the {info.device.type} tensors (the reference fallback); "
                   "the session was created with allow_reference_fallback=False")
        if why is None and capturable and not v.capturable:
            why = f"not CUDA-graph capturable ({v.not_capturable_because}); the session requires capturable=True"
        if why is None:
            serving.append(v)
        else:
            refused[v.name] = why
    return serving, refused


_warned: set[str] = set()

_reported: set[tuple[str, str, str | None]] = set()


def _debug(node_name: str, op_type: str, variant: KernelVariant, plan: str | None) -> None:
    """With PAGEDKIT_KERNEL_DEBUG=1, one stderr line the first time a node runs on a variant for a plan."""
    key = (node_name, variant.name, plan)
    if key in _reported or not settings.read("PAGEDKIT_KERNEL_DEBUG"):
        return
    _reported.add(key)
    print(f"pagedkit: {op_type} node '{node_name}': kernel={variant.name} plan={plan or 'mixed'}"
          f"{' capturable' if variant.capturable else ''}", file=sys.stderr, flush=True)


def _warn_fallback(node_name: str, variant: KernelVariant, device: torch.device, refused: dict[str, str]) -> None:
    """The one-time warning of the reference fallback on a non-CPU device (contract-decisions §9)."""
    if node_name in _warned:
        return
    _warned.add(node_name)
    reasons = "; ".join(f"{n}: {r}" for n, r in refused.items()) or "no GPU variant registered"
    warnings.warn(f"node '{node_name}' ({variant.op}) runs on the loop-based {variant.name} on {device} "
                  f"({reasons}); not CUDA-graph capturable")


def _no_variant(node_name: str, op_type: str, refused: dict[str, str], capturable: bool,
                allow_fallback: bool) -> NotImplementedError:
    reasons = "; ".join(f"{n}: {r}" for n, r in refused.items()) or "none registered"
    hint = []
    if capturable:
        hint.append("create the session without capturable=True")
    if not allow_fallback:
        hint.append("create the session with allow_reference_fallback=True to run it on the reference")
    return NotImplementedError(f"node '{node_name}' ({op_type}): no kernel variant serves it ({reasons})"
                               + (f"; {' or '.join(hint)}" if hint else ""))


def select_variant(node: onnx.NodeProto, model: onnx.ModelProto | None, device: torch.device,
                   allow_reference_fallback: bool = True, *, value_info: Mapping | None = None,
                   capturable: bool = False) -> KernelVariant:
    """The variant a run without a plan hint uses (the first serving one)."""
    info = node_info(node, device, value_info)
    serving, refused = serving_variants(info, allow_reference_fallback=allow_reference_fallback,
                                        capturable=capturable)
    if not serving:
        raise _no_variant(info.node_name, node.op_type, refused, capturable, allow_reference_fallback)
    return serving[0]


def _on(t: torch.Tensor, device: torch.device) -> bool:
    """Whether t lives on `device`; a device without an index ("cuda") takes any index of its type (comparing
    cuda:0 with cuda as devices says no, and a no-op `t.to(device)` per output then costs host time)."""
    d = t.device
    return d.type == device.type and (device.index is None or d.index == device.index)


@dataclass
class AttentionCall:
    """One attention node bound to the variants that serve it: positional inputs -> contract names -> outputs."""

    serving: list[KernelVariant]  # priority order; [0] runs a call without a plan hint
    refused: dict[str, str]  # variant name -> why it does not serve the node
    node_name: str
    in_names: list[str | None]  # contract name of each node input (None: absent)
    out_names: list[str | None]  # contract name of each node output (None: not requested)
    attrs: dict[str, Any]
    device: torch.device
    info: NodeInfo | None = None
    last_variant: str | None = None  # the variant that ran the last call
    _picks: dict = field(default_factory=dict, repr=False)  # plan hint -> the variant it picks

    @property
    def variant(self) -> KernelVariant:
        return self.serving[0]

    @property
    def name(self) -> str:
        """The variant a call without a plan hint runs (the first serving one that serves "mixed"; a node
        that only plan-specific variants serve names its first)."""
        try:
            return self.pick(None).name
        except ValueError:
            return self.variant.name

    @property
    def op_type(self) -> str:
        return self.variant.op

    def pick(self, plan: str | None = None) -> KernelVariant:
        """The first serving variant that serves this plan (host-side information only)."""
        picked = self._picks.get(plan)
        if picked is not None:
            return picked
        self._picks[plan] = picked = self._pick(plan)
        return picked

    def _pick(self, plan: str | None) -> KernelVariant:
        if plan is not None and plan not in PLANS:
            raise ValueError(f"plan {plan!r}: expected one of {list(PLANS)} or None")
        for v in self.serving:
            if v.serves_plan(plan):
                return v
        raise ValueError(f"node '{self.node_name}': no serving variant serves plan {plan!r} "
                                  f"(serving: {[v.name for v in self.serving]})")

    def run(self, inputs: list[torch.Tensor | None], *, plan: str | None = None,
            validate: bool = False) -> list[torch.Tensor | None]:
        """Run the node. validate=True re-checks the concrete inputs (check_inputs) before the kernel runs;
        with validate=False (the node was validated at creation) a failing call is diagnosed afterwards."""
        variant = self.pick(plan)
        feed = {n: t for n, t in zip(self.in_names, inputs) if n is not None and t is not None}
        requested = self.requested
        staged = feed
        if variant.stages_on_cpu and self.device.type != "cpu":
            staged = {n: t.cpu() for n, t in feed.items()}
            _warn_fallback(self.node_name, variant, self.device, self.refused)
        self.last_variant = variant.name
        _debug(self.node_name, variant.op, variant, plan)
        try:
            result = variant.load()(staged, outputs=requested, validate=validate, **self.attrs)
        except ValidationError:
            raise
        except Exception as exc:
            if validate:
                raise
            issues = check_inputs(feed, self.attrs, op_type=variant.op, outputs=requested, node_name=self.node_name)
            if issues:  # the kernel's guard tripped on an input the validator explains: say everything
                raise ValidationError(issues, f"{variant.op} inputs") from exc
            raise
        aliases = CACHE_ALIASES[variant.op]
        outs: list[torch.Tensor | None] = []
        for n in self.out_names:
            if n is None:
                outs.append(None)
                continue
            t = result[n]
            src = feed.get(aliases.get(n, ""))
            if src is not None and t is not src:
                if t.shape == src.shape and t.dtype == src.dtype:
                    src.copy_(t)  # the cache output is the cache input, updated in place
                    t = src
                else:  # a cache that grows (GQA without a shared buffer): a new tensor, like ORT
                    t = t.to(self.device)
            elif not _on(t, self.device):
                t = t.to(self.device)
            outs.append(t)
        return outs

    @property
    def requested(self) -> list[str]:
        """The contract names of the outputs the node asks for."""
        return [n for n in self.out_names if n is not None]

    def report(self) -> dict[str, Any]:
        """What creation decided: the serving variants (priority order) and why the others refused."""
        return {"serving": [v.name for v in self.serving], "refused": dict(self.refused)}


def bind(node: onnx.NodeProto, model: onnx.ModelProto | None, device: torch.device,
         allow_reference_fallback: bool = True, *, value_info: Mapping | None = None,
         capturable: bool = False) -> AttentionCall:
    """The serving variants of the node and its inputs / outputs bound to contract names (session creation).
    value_info: the model's tensor name -> (elem type, shape) after shape inference (static facts)."""
    contract = get_contract(node.op_type)
    if len(node.input) > len(contract.inputs) or len(node.output) > len(contract.outputs):
        raise ValueError(f"node '{node.name}' ({node.op_type}): {len(node.input)} inputs / {len(node.output)} outputs, "
                         f"the contract has {len(contract.inputs)} / {len(contract.outputs)}")
    info = node_info(node, device, value_info)
    serving, refused = serving_variants(info, allow_reference_fallback=allow_reference_fallback,
                                        capturable=capturable)
    if not serving:
        raise _no_variant(node.name, node.op_type, refused, capturable, allow_reference_fallback)
    if device.type != "cpu" and serving[0].stages_on_cpu:
        _warn_fallback(node.name, serving[0], device, refused)
    in_names = [contract.inputs[i].name if n else None for i, n in enumerate(node.input)]
    out_names = [contract.outputs[i].name if n else None for i, n in enumerate(node.output)]
    return AttentionCall(serving, refused, node.name, in_names, out_names, dict(info.attrs), device, info)


def host_input_indices(op_type: str) -> frozenset[int]:
    """Indices of the node inputs kept in host memory (onnxruntime's CPU-memory inputs)."""
    contract = get_contract(op_type)
    return frozenset(contract.input_index(n) for n in HOST_INPUTS.get(op_type, ()))


def cache_input_indices(op_type: str) -> frozenset[int]:
    """Indices of the cache inputs (persistent buffers updated in place)."""
    contract = get_contract(op_type)
    return frozenset(contract.input_index(n) for n in CACHE_ALIASES.get(op_type, {}).values())
