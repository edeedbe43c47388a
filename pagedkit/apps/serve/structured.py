"""Structured output for paged-serve: `response_format` json_object / json_schema and the grammar extension,
through llguidance (docs/serve.md says why this library).

    {"type": "json_object"}                                  any JSON object
    {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}   JSON valid against the schema
    {"type": "grammar", "grammar": "<Lark or GBNF>"}         extension: text of a context-free grammar
    {"type": "regex", "regex": "<regex>"}                    extension: text matching the regular expression

`parse_response_format(body)` checks the field (400 naming it; 400 too when llguidance is not installed);
`Structured.guide(spec)` compiles it against the model's tokenizer (llguidance's LLTokenizer, built once per
server on first use, in the server's thread pool) into a `Guide`: the engine's `SamplingParams.constraint`
factory. Each request gets its own `GrammarConstraint` (a copy of the compiled matcher): `mask()` is the packed
bitmask of the tokens the grammar allows next (engine/constraint.py applies it to the logits), `accept(token)`
advances it (True once nothing more may follow), `rollback(n)` undoes speculative drafts. The end-of-sequence
tokens the grammar allows once it is complete are the engine's eos ids.

JSON is written with ", " and ": " separators and no other whitespace (llguidance's `whitespace_flexible`
off): a model cannot loop on blank space, and the text is what `json.dumps` writes.
"""

from __future__ import annotations

import importlib.util
import json
import threading
from dataclasses import dataclass

import torch

from ...cli_errors import one_line
from .protocol import RequestError

LIBRARY = "llguidance"
INSTALL = 'pip install "pagedkit[serve]" (or pip install llguidance)'
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# vLLM / SGLang request fields for the same thing: refused with a pointer to response_format, never ignored
FOREIGN_FIELDS = ("guided_json", "guided_regex", "guided_grammar", "guided_choice", "guided_decoding_backend",
                  "structured_outputs", "ebnf", "regex", "json_schema")


def have_library() -> bool:
    return importlib.util.find_spec(LIBRARY) is not None


@dataclass(frozen=True)
class Spec:
    """What a request's output must match: kind "json" (text: a JSON schema), "grammar" (Lark or GBNF) or
    "regex"; param: the request field it came from (for the 400s)."""

    kind: str
    text: str
    param: str = "response_format"


def json_spec(schema: dict, param: str = "response_format") -> Spec:
    return Spec("json", json.dumps(schema), param)


def parse_response_format(body: dict) -> Spec | None:
    """The request's response_format as a Spec, None for text output (absent, null or {"type": "text"})."""
    for name in FOREIGN_FIELDS:
        if body.get(name) is not None:
            raise RequestError(f"{name}: not a paged-serve field; use response_format ({{\"type\": \"json_schema\" | "
                               f"\"json_object\" | \"grammar\" | \"regex\", ...}}, docs/serve.md)", name)
    fmt = body.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        spec = json_spec({"type": "object"})
    elif kind == "json_schema":
        inner = fmt.get("json_schema")
        if not isinstance(inner, dict):
            raise RequestError(f"response_format.json_schema: expected an object {{\"name\", \"schema\", \"strict\"}}, "
                               f"got {inner!r}"[:300], "response_format")
        schema = inner.get("schema", {})
        if schema is True:  # JSON schema's "anything"
            schema = {}
        if not isinstance(schema, dict):
            raise RequestError(f"response_format.json_schema.schema: expected a JSON schema (an object), got "
                               f"{schema!r}"[:300], "response_format")
        spec = json_spec(schema)
    elif kind in ("grammar", "regex"):
        text = fmt.get(kind)
        if not isinstance(text, str) or not text.strip():
            raise RequestError(f"response_format.{kind}: expected a non-empty string"
                               f"{' (a Lark or GBNF grammar)' if kind == 'grammar' else ''}, got {text!r}"[:300],
                               "response_format")
        spec = Spec(kind, text)
    else:
        raise RequestError("response_format: expected {\"type\": \"text\"}, {\"type\": \"json_object\"}, {\"type\": "
                           "\"json_schema\", \"json_schema\": {...}} or the extensions {\"type\": \"grammar\", "
                           f"\"grammar\": ...}} / {{\"type\": \"regex\", \"regex\": ...}}, got {fmt!r}"[:400],
                           "response_format")
    require_library("response_format")
    return spec


def require_library(param: str, what: str = "structured output") -> None:
    if not have_library():
        raise RequestError(f"{param}: {what} needs the {LIBRARY} package, which this server does not have "
                           f"({INSTALL})", param)


class GrammarConstraint:
    """One request's grammar state (an llguidance LLMatcher): the engine's token constraint."""

    def __init__(self, matcher, words: int):
        self.matcher, self.words = matcher, words

    def _check(self) -> None:
        if self.matcher.is_error():
            raise RuntimeError(one_line(self.matcher.get_error())[:300])

    def mask(self) -> torch.Tensor:
        buf = torch.empty(self.words, dtype=torch.int32)
        self.matcher.unsafe_compute_mask_ptr(buf.data_ptr(), buf.numel() * 4)
        self._check()
        return buf

    def accept(self, token: int) -> bool:
        if not self.matcher.consume_token(token):
            self._check()
            raise RuntimeError(f"the grammar refused token {token}")
        return self.matcher.is_stopped()

    def rollback(self, n: int) -> None:
        self.matcher.rollback(n)
        self._check()


class Guide:
    """SamplingParams.constraint: each call gives a fresh GrammarConstraint of the compiled grammar."""

    def __init__(self, matcher, words: int, spec: Spec):
        self.template, self.words, self.spec = matcher, words, spec

    def __call__(self) -> GrammarConstraint:
        return GrammarConstraint(self.template.deep_copy(), self.words)


class Structured:
    """What structured output needs of one server: the model's tokenizer as llguidance's LLTokenizer (built
    once, on the first structured request: about a second for a 50k-token vocabulary), its size and eos ids."""

    def __init__(self, hf_tokenizer, vocab_size: int | None, eos_token_ids):
        self.hf = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos = [int(t) for t in eos_token_ids if vocab_size is None or 0 <= int(t) < vocab_size]
        self._lock = threading.Lock()
        self._tok = None
        self._problem: str | None = None

    def tokenizer(self, param: str):
        with self._lock:
            if self._tok is None and self._problem is None:
                import llguidance.hf

                try:
                    self._tok = llguidance.hf.from_tokenizer(self.hf, n_vocab=self.vocab_size,
                                                             eos_token=self.eos or None)
                except Exception as exc:  # a tokenizer llguidance cannot read (no decoder, not a fast one...)
                    self._problem = f"{type(exc).__name__}: {one_line(str(exc))}"[:300]
        if self._problem is not None:
            raise RequestError(f"{param}: structured output is not available for this model: {LIBRARY} cannot use "
                               f"its tokenizer ({self._problem})", param)
        return self._tok

    def guide(self, spec: Spec) -> Guide:
        """Compile spec against the tokenizer (call it off the event loop); RequestError for a bad grammar."""
        import llguidance

        tok = self.tokenizer(spec.param)
        try:
            if spec.kind == "json":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(spec.text, defaults=JSON_OPTIONS)
            elif spec.kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(spec.text)
            else:
                grammar = llguidance.grammar_from("grammar", spec.text)  # Lark, or GBNF converted to Lark
            matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        except Exception as exc:
            raise RequestError(f"{spec.param}: {LIBRARY} refused it ({one_line(str(exc))})"[:600], spec.param) from None
        if matcher.is_error():
            raise RequestError(f"{spec.param}: {LIBRARY} refused it ({one_line(matcher.get_error())})"[:600], spec.param)
        return Guide(matcher, (tok.vocab_size + 31) // 32, spec)
