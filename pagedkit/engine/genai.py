"""An onnxruntime-genai-style API over the Engine: Model, GeneratorParams, Generator.

    model = Model("examples/tiny-paged")                       # or Model(existing_engine)
    params = GeneratorParams(model)
    params.set_search_options(max_length=32, do_sample=False)  # max_length counts the prompt, as in genai
    gen = Generator(model, params)
    gen.append_tokens([1, 7, 9, 30])
    while not gen.is_done():
        gen.generate_next_token()
        print(gen.get_next_tokens()[0])
    gen.get_sequence(0)                                        # prompt + generated

Several Generators of one Model share its engine: each generate_next_token() steps the engine (every
active Generator's request advances in the same batch) until this one has a token; tokens other
Generators received meanwhile wait in their own queues. One token per call, as in onnxruntime-genai
(a step that made several visible, e.g. accepted drafts, hands them out one call at a time).
Supported search options: max_length, do_sample, temperature, top_k, top_p, random_seed; pagedkit's
own: num_draft_tokens, ignore_eos. Anything else is a ValueError naming it.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

from .engine import Engine
from .params import SamplingParams

_OPTIONS = ("max_length", "do_sample", "temperature", "top_k", "top_p", "random_seed", "num_draft_tokens",
            "ignore_eos")


class Model:
    def __init__(self, model: str | Path | Engine, **engine_kwargs):
        self.engine = model if isinstance(model, Engine) else Engine(model, **engine_kwargs)
        self._queues: dict[str, deque] = {}  # request id -> its outputs not yet taken

    def _pump(self) -> None:
        for o in self.engine.step():
            q = self._queues.get(o.request_id)
            if q is not None:
                q.append(o)


class GeneratorParams:
    def __init__(self, model: Model):
        self.model = model
        self.search: dict = {}

    def set_search_options(self, **options) -> None:
        unknown = sorted(set(options) - set(_OPTIONS))
        if unknown:
            raise ValueError(f"set_search_options: unsupported option(s) {unknown}; supported: {list(_OPTIONS)}")
        self.search.update(options)


class Generator:
    def __init__(self, model: Model, params: GeneratorParams):
        self.model, self.params = model, params
        self.prompt: list[int] = []
        self.tokens: list[int] = []  # generated tokens handed out by generate_next_token
        self._pending: deque[int] = deque()
        self._rid: str | None = None
        self._finished = False
        self.finish_reason: str | None = None

    def _sampling(self) -> SamplingParams:
        s, engine = self.params.search, self.model.engine
        max_length = s.get("max_length", engine.max_seq_len)
        if max_length <= len(self.prompt):
            raise ValueError(f"search option max_length {max_length} must exceed the prompt length {len(self.prompt)} "
                             "(it counts the prompt, as in onnxruntime-genai)")
        sample = bool(s.get("do_sample", False))
        return SamplingParams(max_new_tokens=max_length - len(self.prompt),
                              temperature=float(s.get("temperature", 1.0)) if sample else 0.0,
                              top_k=int(s.get("top_k", 0)), top_p=float(s.get("top_p", 1.0)),
                              seed=s.get("random_seed"), num_draft_tokens=int(s.get("num_draft_tokens", 0)),
                              ignore_eos=bool(s.get("ignore_eos", False)))

    def append_tokens(self, tokens) -> None:
        """Prompt tokens, before the first generate_next_token (appending later is not supported yet)."""
        if self._rid is not None:
            raise NotImplementedError("append_tokens after generation started (multi-turn continuation) is not "
                                      "supported yet; create a new Generator with the whole sequence")
        self.prompt += [int(t) for t in tokens]

    def generate_next_token(self) -> None:
        """Step the shared engine until this request has its next token (the call that sees the end of a
        request without a new token, after a stop sequence or an abort, adds none: is_done() is then True)."""
        if self._rid is None:
            self._rid = self.model.engine.add_request(self.prompt, self._sampling())
            self.model._queues[self._rid] = deque()
        if self.is_done():
            raise RuntimeError("generate_next_token: the generator is done (check is_done() first)")
        q = self.model._queues[self._rid]
        while not self._pending and not self._finished:
            while not q:
                self.model._pump()
            out = q.popleft()
            self._pending.extend(out.new_token_ids)
            if out.finished:
                self._finished, self.finish_reason = True, out.finish_reason
                self.model._queues.pop(self._rid, None)
        if self._pending:  # else the request ended without a new token (a stop sequence, abort): is_done()
            self.tokens.append(self._pending.popleft())

    def get_next_tokens(self) -> list[int]:
        """The token of the last generate_next_token call (one sequence: a list of one)."""
        if not self.tokens:
            raise RuntimeError("get_next_tokens: call generate_next_token first")
        return [self.tokens[-1]]

    def is_done(self) -> bool:
        return self._finished and not self._pending

    def get_sequence(self, index: int = 0) -> list[int]:
        if index != 0:
            raise ValueError(f"get_sequence: index must be 0 (one sequence per Generator), got {index}")
        return self.prompt + self.tokens

    def __del__(self):  # an abandoned generator's request is aborted
        try:
            if self._rid is not None and not self._finished:
                self.model.engine.abort(self._rid)
                self.model._queues.pop(self._rid, None)
        except Exception:
            pass
