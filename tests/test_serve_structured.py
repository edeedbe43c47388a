"""paged-serve's structured output (response_format json_schema / json_object, the grammar and regex extensions;
tool_choice "required" / named forced by the grammar) through the official `openai` client, against a real
uvicorn server and the REAL engine on examples/tiny-paged with random weights and a character tokenizer
(tests/char_model.py): the model has no idea of JSON, so only the grammar makes the output valid.

Oracles: `jsonschema` for the schemas, `json` for json_object, a recursive-descent checker written here for the
Lark grammar, Python's `re` for GBNF / regex. Teeth: the engine's mask not applied (constraint.apply patched to
leave the logits alone) makes outputs invalid; the library missing is a 400, not a 5xx.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from char_model import char_model
from pagedkit.apps.serve import create_app
from pagedkit.apps.serve import structured as S
from pagedkit.apps.serve.tokenizer import load_tokenizer
from pagedkit.engine import Engine
from pagedkit.engine import constraint as engine_constraint
from test_serve_helpers import FakeEngine, ServerThread, write_tokenizer

TEMPLATE = ("{% if tools %}T:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
            "{% for m in messages %}{{ m.role[0] }}:{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}a:{% endif %}")
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["x", "yy"]}, "maxItems": 2},
    "p": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}}, "required": ["x"],
          "additionalProperties": False},
    "n": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 0, "maximum": 9}]}},
    "required": ["name", "age", "ok", "tags", "p", "n"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return char_model(tmp_path_factory.mktemp("structured") / "tiny", TEMPLATE)


@pytest.fixture(scope="module")
def url(model_dir):
    engine = Engine(model_dir, max_batch_size=8, max_num_tokens=256)
    with ServerThread(create_app(engine, load_tokenizer(model_dir), "tiny")) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def _chat(client, i, **kw):
    sampled = {"temperature": 1.0, "seed": i} if i % 2 else {"temperature": 0}
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"json {i}"}],
                                          **sampled, **kw)


def _complete(client, i, **kw):
    sampled = {"temperature": 1.0, "seed": i} if i % 2 else {"temperature": 0}
    return client.completions.create(model="tiny", prompt=f"q{i}:", max_tokens=110, **sampled, **kw)


def _streamed_chat(client, i, **kw) -> tuple[str, str]:
    sampled = {"temperature": 1.0, "seed": i} if i % 2 else {"temperature": 0}
    text, reason = "", None
    for chunk in client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"json {i}"}],
                                                stream=True, **sampled, **kw):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


def _together(fn, items) -> list:
    """fn over items, concurrently (the engine batches them)."""
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(fn, items))


def schema_outputs(client, prompts=range(20)) -> list[tuple[str, str]]:
    def one(i):
        if i % 4 == 3:
            c = _complete(client, i, extra_body={"response_format": RESPONSE_FORMAT}).choices[0]
            return c.text, c.finish_reason
        c = _chat(client, i, response_format=RESPONSE_FORMAT).choices[0]
        return c.message.content, c.finish_reason

    return _together(one, prompts)


def test_json_schema_output_validates_on_20_prompts(client):
    outs = schema_outputs(client)
    for text, reason in outs:
        assert reason == "stop", (text, reason)
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len({t for t, _ in outs}) >= 10  # greedy and sampled, different prompts: not one canned answer
    for i in (4, 5):  # streamed: the same text as the same request not streamed (each alone: no batch effects)
        c = _chat(client, i, response_format=RESPONSE_FORMAT).choices[0]
        assert _streamed_chat(client, i, response_format=RESPONSE_FORMAT) == (c.message.content, c.finish_reason)


def test_without_the_mask_the_outputs_are_not_valid(client, monkeypatch):
    monkeypatch.setattr(engine_constraint, "apply", lambda logits, masks: logits)  # teeth: mask computed, not applied
    bad = 0
    for i in range(4):
        try:  # the grammar refuses the unmasked token: the request is aborted (an error), or the text is invalid
            (text, _), = schema_outputs(client, [i])
            jsonschema.validate(json.loads(text), SCHEMA)
        except (ValueError, jsonschema.ValidationError, openai.APIStatusError):
            bad += 1
    assert bad >= 3


def test_json_object_parses(client):
    outs = _together(lambda i: _complete(client, i, extra_body={"response_format": {"type": "json_object"}}).choices[0],
                     range(20))
    stopped = [c.text for c in outs if c.finish_reason == "stop"]
    assert len(stopped) >= 15  # the rest ran out of max_tokens inside a long string (a prefix of an object)
    for text in stopped:
        assert isinstance(json.loads(text), dict)
    for c in outs:
        assert c.text.startswith("{")


# -- the grammar extension ------------------------------------------------------------------------------------------

LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
"""


def _is_expr(text: str) -> bool:
    """Recursive descent over expr := term (('+'|'-') term)*, term := 1-3 digits | '(' expr ')'."""
    pos = 0

    def term():
        nonlocal pos
        if pos < len(text) and text[pos] == "(":
            pos += 1
            if not expr() or pos >= len(text) or text[pos] != ")":
                return False
            pos += 1
            return True
        m = re.match(r"[0-9]{1,3}(?![0-9])", text[pos:])
        if not m:
            return False
        pos += m.end()
        return True

    def expr():
        nonlocal pos
        if not term():
            return False
        while pos < len(text) and text[pos] in "+-":
            pos += 1
            if not term():
                return False
        return True

    return expr() and pos == len(text)


@pytest.mark.parametrize("fmt, check", [
    ({"type": "grammar", "grammar": LARK}, _is_expr),
    ({"type": "grammar", "grammar": 'root ::= ("yes" | "no") "," [a-z] [a-z]? [0-9]'},
     lambda t: re.fullmatch(r"(yes|no),[a-z][a-z]?[0-9]", t) is not None),
    ({"type": "regex", "regex": r"[a-c]{2}-[0-9]{1,4}"}, lambda t: re.fullmatch(r"[a-c]{2}-[0-9]{1,4}", t) is not None),
])
def test_grammar_and_regex_extensions(client, fmt, check):
    texts = []
    for c in _together(lambda i: _complete(client, i, extra_body={"response_format": fmt}).choices[0], range(8)):
        if c.finish_reason == "stop":
            assert check(c.text), c.text
            texts.append(c.text)
    assert len(texts) >= 6 and len(set(texts)) >= 2
    if fmt["type"] == "grammar" and "start" in fmt["grammar"]:
        assert not all(_is_expr(t) for t in ["1+", "(2", "1234", "(1)+(2-3"])  # the checker itself has teeth


# -- forced tool calls -----------------------------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "move", "parameters": {
    "type": "object", "properties": {"dx": {"type": "integer", "minimum": -9, "maximum": 9},
                                     "fast": {"type": "boolean"}}, "required": ["dx", "fast"],
    "additionalProperties": False}}},
         {"type": "function", "function": {"name": "say", "parameters": {
             "type": "object", "properties": {"w": {"enum": ["hi", "yo"]}}, "required": ["w"],
             "additionalProperties": False}}}]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "say"}}, "required"])
def test_required_and_named_tool_choice_force_valid_calls(client, choice):
    names = set()
    for i in range(6):
        r = _chat(client, i, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        assert len(c.message.tool_calls) == 1
        call = c.message.tool_calls[0]
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
        names.add(call.function.name)
    if isinstance(choice, dict):
        assert names == {"say"}


# -- refusals ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, words", [
    ({"response_format": {"type": "xml"}}, "response_format: expected"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "array", "uniqueItems": True}}}},
     "uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": []}}, "json_schema: expected an object"),
    ({"response_format": {"type": "grammar", "grammar": "start: nothing_defined"}}, "llguidance refused"),
    ({"response_format": {"type": "regex", "regex": ""}}, "non-empty string"),
    ({"guided_json": {"type": "object"}}, "use response_format"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_response_formats_are_400s_naming_the_field(url, body, words):
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]} | body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["param"] in body, err


def test_without_the_library_response_format_is_a_400(url, monkeypatch):
    monkeypatch.setattr(S, "have_library", lambda: False)
    for body in ({"response_format": {"type": "json_object"}}, {"tools": TOOLS, "tool_choice": "required"}):
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]} | body)
        assert r.status_code == 400 and "pip install" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                        "max_tokens": 3, "response_format": {"type": "text"}})
    assert r.status_code == 200


def test_a_tokenizer_llguidance_cannot_read_is_a_400(tmp_path):
    tok = write_tokenizer(tmp_path / "wordlevel")  # WordLevel without a decoder
    with ServerThread(create_app(FakeEngine(), load_tokenizer(tok), "fake")) as base:
        for _ in range(2):  # the failure is remembered, not retried (and never a 5xx)
            r = httpx.post(f"{base}/v1/completions", json={"prompt": "hello", "response_format": {"type": "json_object"}})
            assert r.status_code == 400 and "cannot use its tokenizer" in r.json()["error"]["message"], r.text


# -- junk in the new fields: never a 5xx ---------------------------------------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6) | st.sampled_from(
    ["json_object", "json_schema", "grammar", "regex", "function", "required", "auto", "\ud800", "start: \"a\""])
JUNK = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.sampled_from(["type", "json_schema", "schema", "grammar", "regex", "function", "name", "parameters",
                     "properties", "arguments", "id", "x"]), inner, max_size=3), max_leaves=10)
FIELDS = st.dictionaries(st.sampled_from(["response_format", "tools", "tool_choice", "parallel_tool_calls"]), JUNK,
                         min_size=1, max_size=3)
HISTORY = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool"])},
                                         optional={"content": st.text(max_size=5) | st.none(), "tool_calls": JUNK,
                                                   "tool_call_id": JUNK, "name": JUNK}), min_size=1, max_size=3)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(fields=FIELDS, history=HISTORY, chat=st.booleans())
def test_junk_in_the_structured_and_tool_fields_is_never_a_5xx(url, fields, history, chat):
    body = {"max_tokens": 4} | fields | ({"messages": history} if chat else {"prompt": "q"})
    r = httpx.post(f"{url}/v1/{'chat/completions' if chat else 'completions'}", content=json.dumps(body).encode(),
                   headers={"Content-Type": "application/json"}, timeout=60)  # ASCII JSON: surrogates escaped
    assert r.status_code < 500, (body, r.text)
    if r.status_code != 200:
        assert r.json()["error"]["param"], r.text
