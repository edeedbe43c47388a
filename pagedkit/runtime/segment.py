"""`Segment`: one onnxruntime session over a run of standard nodes (runtime/delegate.py builds them): torch tensors
in, torch tensors out, with the KV caches updated in place.

Two kinds of in-place cache outputs:
- `aliases` (output -> input): an output onnxruntime computes into the input's buffer (decompose(in_place=True):
  a cache output is a ScatterND on its cache input); the output is bound to that buffer;
- `written` (output -> input): an output onnxruntime does not produce at all: a pagedkit.cpu attention node
  (kernels/cpu) writes the cache input's buffer itself; the input is bound without a copy and returned as the
  output.
Every run reuses one IOBinding: a tensor bound before (same memory, shape and dtype: the caches, every step) is not
bound again; what changes per step (ids, lengths, block table) is bound anew, and the outputs onnxruntime
allocates are read back as numpy arrays, shared with torch (no copy).
"""

from __future__ import annotations

import torch


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
        self._binding = None
        self._bound: dict[str, tuple] = {}  # name -> ((data_ptr, shape, dtype), the bound array: kept alive)

    @property
    def ort_outputs(self) -> list[str]:
        return [o for o in self.outputs if o not in self.written]

    def run(self, ins: list[torch.Tensor]) -> list[torch.Tensor]:
        if not self.aliases and not self.written:
            feeds = {n: t.detach().contiguous().numpy() for n, t in zip(self.inputs, ins)}
            return [torch.from_numpy(a) for a in self.session.run(self.outputs, feeds)]
        import onnxruntime as ort

        if self._binding is None:
            self._binding = self.session.io_binding()
        bind, bound = self._binding, self._bound
        for n, t in zip(self.inputs, ins):
            key = (t.data_ptr(), tuple(t.shape), t.dtype) if t.is_contiguous() else None
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
        for o in self.outputs:
            if o in self.written:
                continue
            src = self.aliases.get(o)
            if src is None:  # bound anew every run: onnxruntime would otherwise reuse the last run's buffer
                bind.bind_output(o, "cpu")
                continue
            t = ins[self._pos[src]]
            if not t.is_contiguous():
                raise ValueError(f"input '{src}': a cache updated in place must be contiguous")
            key = ("out", t.data_ptr(), tuple(t.shape), t.dtype)
            if bound.get(o, (None,))[0] != key:
                a = t.detach().numpy()
                bind.bind_ortvalue_output(o, ort.OrtValue.ortvalue_from_numpy(a))
                bound[o] = (key, a)
        self.session.run_with_iobinding(bind)
        vals = iter(bind._iobinding.get_outputs())  # the C values: no Python wrapper for each (aliased) cache
        out = []
        for o in self.outputs:
            if o in self.written:
                out.append(ins[self._pos[self.written[o]]])
                continue
            v = next(vals)
            out.append(ins[self._pos[self.aliases[o]]] if o in self.aliases else torch.from_numpy(v.numpy()))
        return out


__all__ = ["Segment"]
