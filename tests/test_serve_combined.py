"""paged-serve's `n`, logprobs and penalties together with structured output and tool calls (the real engine on
the character model of tests/test_serve_structured.py, random weights: only the grammar makes JSON):
- n = 4 with a json_schema: every choice validates (each engine request of the group has its own grammar state,
  the siblings' first token masked like the parent's), seeded choices differ, streamed n = 2 reassembles;
- n = 2 with tool_choice "required": every choice is a valid call (one ToolOutput per choice), streamed too;
- logprobs with a grammar: finite for every chosen token (the mask never drops the chosen token);
- penalties with a grammar: the output still validates.
Teeth: every choice sharing one grammar state (the constraint factory's product reused) breaks the choices.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from char_model import char_model
from pagedkit.apps.serve import create_app
from pagedkit.apps.serve.tokenizer import load_tokenizer
from pagedkit.engine import Engine
from pagedkit.engine import request as request_mod
from test_serve_helpers import ServerThread
from test_serve_structured import PARAMS, RESPONSE_FORMAT, SCHEMA, TEMPLATE, TOOLS


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    model_dir = char_model(tmp_path_factory.mktemp("combined") / "tiny", TEMPLATE)
    engine = Engine(model_dir, max_batch_size=8, max_num_tokens=256)
    with ServerThread(create_app(engine, load_tokenizer(model_dir), "tiny")) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
    assert engine.num_free_blocks() == engine.num_blocks() and engine.check_invariants() == []


def _msgs(i):
    return [{"role": "user", "content": f"json {i}"}]


def check_n_with_a_schema(client):
    for i, sampled in enumerate(({"temperature": 0}, {"temperature": 1.0, "seed": 3})):
        r = client.chat.completions.create(model="tiny", messages=_msgs(i), n=4, response_format=RESPONSE_FORMAT,
                                           **sampled)
        assert [c.index for c in r.choices] == [0, 1, 2, 3]
        for c in r.choices:
            assert c.finish_reason == "stop", c
            jsonschema.validate(json.loads(c.message.content), SCHEMA)
        texts = {c.message.content for c in r.choices}
        assert len(texts) == (1 if not sampled["temperature"] else 4), texts
    parts = {0: "", 1: ""}
    for chunk in client.chat.completions.create(model="tiny", messages=_msgs(7), n=2, response_format=RESPONSE_FORMAT,
                                                temperature=1.0, seed=9, stream=True):
        for c in chunk.choices:
            parts[c.index] += c.delta.content or ""
    for text in parts.values():
        jsonschema.validate(json.loads(text), SCHEMA)


def test_n_choices_each_follow_the_schema(client):
    check_n_with_a_schema(client)


def test_teeth_choices_sharing_one_grammar_state(client, monkeypatch):
    real, shared = request_mod.new_request, {}

    def one_state(prompt, params, *a, **kw):  # every request of a group gets the first one's grammar state
        r = real(prompt, params, *a, **kw)
        if r.constraint is not None:
            r.constraint = shared.setdefault(params.constraint, r.constraint)
        return r

    monkeypatch.setattr(request_mod, "new_request", one_state)
    import pagedkit.engine.engine as engine_mod
    monkeypatch.setattr(engine_mod, "new_request", one_state)
    with pytest.raises((AssertionError, ValueError, jsonschema.ValidationError, openai.APIStatusError)):
        check_n_with_a_schema(client)


def test_n_tool_calls_required(client):
    r = client.chat.completions.create(model="tiny", messages=_msgs(1), n=2, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, temperature=1.0, seed=4)
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None and len(c.message.tool_calls) == 1
        call = c.message.tool_calls[0]
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    calls, reasons = {0: [], 1: []}, {}
    for chunk in client.chat.completions.create(model="tiny", messages=_msgs(1), n=2, tools=TOOLS,
                                                tool_choice="required", parallel_tool_calls=False, temperature=1.0,
                                                seed=4, stream=True):
        for c in chunk.choices:
            calls[c.index] += c.delta.tool_calls or []
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
    assert reasons == {0: "tool_calls", 1: "tool_calls"}
    assert [(x[0].function.name, x[0].function.arguments) for x in calls.values()] == \
        [(c.message.tool_calls[0].function.name, c.message.tool_calls[0].function.arguments) for c in r.choices]


def test_logprobs_and_penalties_with_a_grammar(client):
    r = client.chat.completions.create(model="tiny", messages=_msgs(2), response_format=RESPONSE_FORMAT,
                                       temperature=0.7, seed=1, logprobs=True, top_logprobs=3, frequency_penalty=1.5,
                                       presence_penalty=0.5, extra_body={"repetition_penalty": 1.2})
    c = r.choices[0]
    jsonschema.validate(json.loads(c.message.content), SCHEMA)
    content = c.logprobs.content
    assert "".join(e.token for e in content) == c.message.content and len(content) == r.usage.completion_tokens
    assert all(-9999 < e.logprob <= 0 for e in content)  # the chosen token is never one the mask dropped
