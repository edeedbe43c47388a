"""`Segment`: one onnxruntime session over a run of standard nodes (runtime/delegate.py builds them): torch tensors
in, torch tensors out, with the KV caches updated in place.

Two kinds of in-place cache outputs:
- `aliases` (output -> input): an output onnxruntime computes into the input's buffer (decompose(in_place=True):
  a cache output is a ScatterND on its cache input); the output is bound to that buffer;
- `written` (output -> input): an output onnxruntime does not produce at all: a pagedkit.cpu attention node
  (kernels/cpu) writes the cache input's buffer itself; the input is bound without a copy and returned as the
  output.
Every run reuses one IOBinding, and onnxruntime reads bound inputs in place: an input given as the same tensor
object as last run (the caches every step; a KV manager's persistent step buffers) is not looked at again, any
other is bound once per new memory, shape and dtype. The other outputs (the logits) are allocated by onnxruntime
(its arena: memory already mapped, no page faults a step) and handed to torch through DLPack, without a copy.
`run(..., keep=True)` instead writes them into buffers of the segment's own, one set per shape of the step's
inputs, bound once: nothing is bound or read back on a run whose inputs are the objects of the last one (a
decode step); the caller copies what it keeps before the next run (runtime/generate.py's direct path).
The host work of a run is a few calls, not its bytes: after onnxruntime streams the weights through the caches,
each distinct call costs tens of microseconds, so the fast paths touch as few as they can.
"""

from __future__ import annotations

import operator

import torch


def _has_dlpack() -> bool:
    try:
        from onnxruntime.capi.onnxruntime_pybind11_state import OrtValue
    except ImportError:
        return False
    return hasattr(OrtValue, "to_dlpack") and hasattr(torch, "from_dlpack")


_DLPACK = _has_dlpack()
_DLPACK_TYPES = frozenset(f"tensor({t})" for t in ("float", "float16", "double", "int64", "int32", "int8", "uint8"))
_NUMPY = {torch.float32: "float32", torch.float16: "float16", torch.float64: "float64", torch.int64: "int64",
          torch.int32: "int32", torch.int8: "int8", torch.uint8: "uint8", torch.bool: "bool"}


class Segment:
    """One onnxruntime session: `inputs` / `outputs` by name; `outputs` holds the `written` ones too (returned
    as their input tensors, never asked of onnxruntime)."""

    def __init__(self, key: str, inputs: list[str], outputs: list[str], nodes: int, session,
                 aliases: dict[str, str] | None = None, written: dict[str, str] | None = None):
        self.key, self.inputs, self.outputs, self.nodes, self.session = key, inputs, outputs, nodes, session
        self.aliases = dict(aliases or {})
        self.written = dict(written or {})
        self._pos = {n: i for i, n in enumerate(inputs)}
        self._zero_copy = set(self.written.values())  # inputs the session writes: bound as the torch memory
        self.source = None  # delegate(keep=True): the model and options its session was made from
        self._binding = None
        self._bound: dict[str, tuple] = {}  # name -> ((data_ptr, shape, dtype), the bound array: kept alive)
        self._last: list = [None] * len(inputs)  # the tensor objects bound last run
        self._src = {o: self._pos[i] for o, i in (self.aliases | self.written).items()}  # cache output -> input
        self._fresh = [o for o in self.outputs if o not in self._src]  # outputs that are no cache
        caches = set(self.aliases.values()) | self._zero_copy
        self._step_inputs = [i for i, n in enumerate(inputs) if n not in caches]  # what sizes the outputs
        self._kept: dict[tuple, dict[str, torch.Tensor]] = {}  # step input shapes -> keep-mode output buffers
        self._keep_sig = None  # the shapes whose buffers are bound now (keep mode), None: none bound
        self._keep_out: list | None = None  # the last keep-mode run's outputs (same inputs: the same list)

    @property
    def ort_outputs(self) -> list[str]:
        return [o for o in self.outputs if o not in self.written]

    def run(self, ins: list[torch.Tensor], keep: bool = False) -> list[torch.Tensor]:
        if not self.aliases and not self.written:
            feeds = {n: t.detach().contiguous().numpy() for n, t in zip(self.inputs, ins)}
            return [torch.from_numpy(a) for a in self.session.run(self.outputs, feeds)]
        if self._binding is None:
            self._binding = self.session.io_binding()
        same = all(map(operator.is_, ins, self._last))  # the last run's tensors (a decode step's, every one)
        if not same:
            self._bind_inputs(ins)
        if keep:
            if same and self._keep_out is not None:  # outputs still bound to this input shape's buffers
                self.session.run_with_iobinding(self._binding)
                return self._keep_out
            return self._run_keep(ins)
        self._keep_sig = self._keep_out = None
        self._bind_outputs(ins)
        self.session.run_with_iobinding(self._binding)
        return self._collect(ins, None)

    def _collect(self, ins: list[torch.Tensor], copy: dict | None) -> list[torch.Tensor]:
        """The run's outputs: caches as their inputs, the others from onnxruntime (DLPack; `copy` given: copied
        into new tensors of ours, by name)."""
        if not self._fresh:
            return [ins[self._src[o]] for o in self.outputs]
        vals = iter(self._binding._iobinding.get_outputs())  # the C values: no Python wrapper per (aliased) cache
        out = []
        for o in self.outputs:
            if o in self.written:
                out.append(ins[self._src[o]])
                continue
            v = next(vals)
            if o in self.aliases:
                out.append(ins[self._src[o]])
            elif copy is not None:
                t = copy[o] = torch.from_numpy(v.numpy())  # a copy: the buffer later runs write into
                out.append(t)
            elif _DLPACK and v.data_type() in _DLPACK_TYPES:
                out.append(torch.from_dlpack(v.to_dlpack()))  # onnxruntime's buffer, no copy
            else:
                out.append(torch.from_numpy(v.numpy()))
        return out

    def _run_keep(self, ins: list[torch.Tensor]) -> list[torch.Tensor]:
        sig = tuple(tuple(ins[i].shape) for i in self._step_inputs)
        bufs = self._kept.get(sig)
        if bufs is not None and all(t.dtype in _NUMPY for t in bufs.values()):
            try:
                if self._keep_sig != sig:
                    self._bind_outputs(ins, bufs)
                    self._keep_sig = sig
                self.session.run_with_iobinding(self._binding)
                self._keep_out = [bufs[o] if o in bufs else ins[self._src[o]] for o in self.outputs]
                return self._keep_out
            except Exception:  # an output's shape depends on more than the input shapes: onnxruntime allocates
                self._kept.pop(sig, None)
        self._keep_sig = self._keep_out = None
        self._bind_outputs(ins)
        self.session.run_with_iobinding(self._binding)
        copies: dict[str, torch.Tensor] = {}
        out = self._collect(ins, copies)
        self._kept[sig] = copies
        return out

    def _bind_inputs(self, ins: list[torch.Tensor]) -> None:
        import onnxruntime as ort

        bind, bound, last = self._binding, self._bound, self._last
        for i, (n, t) in enumerate(zip(self.inputs, ins)):
            if t is last[i]:
                continue  # the same tensor as last run: still bound to its memory
            key = (t.data_ptr(), tuple(t.shape), t.dtype) if t.is_contiguous() else None
            last[i] = t
            if key is not None and bound.get(n, (None,))[0] == key:
                continue
            if n in self._zero_copy:
                if key is None:
                    raise ValueError(f"input '{n}': a cache updated in place must be contiguous")
                a = t.detach().numpy()
                bind.bind_ortvalue_input(n, ort.OrtValue.ortvalue_from_numpy(a))  # its memory, not a copy
            else:
                a = t.detach().contiguous().numpy()
                bind.bind_cpu_input(n, a)
            bound[n] = (key, a)

    def _bind_outputs(self, ins: list[torch.Tensor], bufs: dict | None = None) -> None:
        """Bind every onnxruntime output: an aliased cache to its input's buffer, the others to `bufs` (by name)
        or for onnxruntime to allocate anew (it would otherwise reuse the last run's buffer, which the caller may
        still hold)."""
        import onnxruntime as ort

        bind, bound = self._binding, self._bound
        for o in self.outputs:
            if o in self.written:
                continue
            src = self.aliases.get(o)
            if src is None:
                if bufs is None:
                    bind.bind_output(o, "cpu")
                else:
                    t = bufs[o]
                    bind.bind_output(o, "cpu", 0, _NUMPY[t.dtype], list(t.shape), t.data_ptr())
                continue
            t = ins[self._pos[src]]
            if not t.is_contiguous():
                raise ValueError(f"input '{src}': a cache updated in place must be contiguous")
            key = ("out", t.data_ptr(), tuple(t.shape), t.dtype)
            if bound.get(o, (None,))[0] != key:
                a = t.detach().numpy()
                bind.bind_ortvalue_output(o, ort.OrtValue.ortvalue_from_numpy(a))
                bound[o] = (key, a)


__all__ = ["Segment"]
