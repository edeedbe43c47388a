"""The execution plan: a compiled graph (graph.py) laid out as slots and calls, so a run does no per-op
name lookups.

Every value a graph reads or makes gets a slot index (constants, the graph's inputs, the free variables a
subgraph takes from its enclosing scope, node outputs; slot 0 holds None for absent optional inputs and
takes unrequested outputs). A run copies the template (constants in place), stores the feeds, then for each
op gathers its input slots into a list, calls the op and stores its outputs, clearing the slots whose last
reader it was (liveness). The call of an op is bound at creation: the attention call, or the op-table
implementation with its attributes and context; control-flow ops get their subgraphs' own plans.

`Program.run` never touches op names; a failing op is named afterwards from its index.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch

from .graph import Graph, Step

NONE_SLOT = 0  # always None: absent inputs read it, outputs nobody reads go to it


@dataclass
class Op:
    step: Step
    ins: tuple[int, ...]
    outs: tuple[int, ...]
    release: tuple[int, ...]
    run: Callable[[list], Any] | None = None  # bound by the session


@dataclass
class Program:
    graph: Graph
    slot: dict[str, int]  # value name -> slot
    template: list  # slot values at the start of a run (constants)
    inputs: list[int]  # slots of graph.inputs, in order
    outputs: list[int]  # slots of graph.outputs
    free: list[tuple[str, int]]  # (name, slot) read from the enclosing scope at the start of a run
    ops: list[Op] = field(default_factory=list)
    has_subgraphs: bool = False

    def env(self, vals: list, outer: Mapping | None) -> "SlotEnv":
        return SlotEnv(self.slot, vals, outer)


class SlotEnv(Mapping):
    """A run's values by name (for subgraphs reading the enclosing scope, and for run_torch's outputs)."""

    def __init__(self, slot: dict[str, int], vals: list, outer: Mapping | None):
        self._slot, self._vals, self._outer = slot, vals, outer

    def __getitem__(self, name: str) -> Any:
        j = self._slot.get(name)
        if j is not None:
            v = self._vals[j]
            if v is not None:
                return v
        if self._outer is not None:
            return self._outer[name]
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return iter(n for n, j in self._slot.items() if self._vals[j] is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def build(graph: Graph) -> Program:
    """Slots and op records of one graph (not its subgraphs: the session builds those as it binds)."""
    slot: dict[str, int] = {}
    template: list = [None]

    def at(name: str) -> int:
        if not name:
            return NONE_SLOT
        if name not in slot:
            slot[name] = len(template)
            template.append(None)
        return slot[name]

    for name, t in graph.consts.items():
        template[at(name)] = t
    inputs = [at(n) for n in graph.inputs]
    defined = set(graph.consts) | set(graph.inputs)
    free: dict[str, int] = {}
    ops = []
    for step in graph.steps:
        for n in list(step.inputs) + list(step.free_vars):
            if n and n not in defined and n not in free:
                free[n] = at(n)
        ins = tuple(at(n) for n in step.inputs)
        outs = tuple(at(n) if n else NONE_SLOT for n in step.outputs)
        defined.update(n for n in step.outputs if n)
        release = tuple(slot[n] for n in step.release if n in slot and n not in graph.consts)
        ops.append(Op(step, ins, outs, release))
    for n in graph.outputs:
        if n not in defined and n not in free:
            free[n] = at(n)
    outputs = [at(n) for n in graph.outputs]
    return Program(graph, slot, template, inputs, outputs, list(free.items()), ops,
                   any(op.step.has_subgraph for op in ops))


def start(prog: Program, feeds: Mapping[str, torch.Tensor], outer: Mapping | None) -> list:
    """The slot values of a new run: constants, feeds (by graph input name) and free variables."""
    vals = prog.template.copy()
    slot = prog.slot
    for name, t in feeds.items():
        vals[slot[name]] = t
    for name, j in prog.free:
        try:
            vals[j] = outer[name]
        except (KeyError, TypeError):
            raise RuntimeError(f"no value for {name!r} in the enclosing scope of a subgraph") from None
    return vals


def execute(prog: Program, vals: list, on_error: Callable[[Step, Exception], Exception]) -> list:
    """Run the ops over `vals` (from start); returns vals (outputs at prog.outputs). on_error(step, exc) makes
    the exception to raise for a failing op."""
    op = None
    try:
        for op in prog.ops:
            res = op.run([vals[j] for j in op.ins])
            for j, t in zip(op.outs, res):
                vals[j] = t
            vals[NONE_SLOT] = None
            for j in op.release:
                vals[j] = None
    except Exception as exc:
        if op is None:
            raise
        raise on_error(op.step, exc) from exc
    return vals

