"""paged-serve's tool calling (apps/serve/tools.py): the Hermes / Qwen, Mistral and Llama 3.1+ parsers against
fixed texts (malformed calls are plain content, never an error), the parser chosen from the chat template, the
streaming shaping (content held back from a call's marker on), and a tool-call round trip through the official
`openai` client against a real server and the real Engine whose model is scripted (tests/scripted_engine.py):
templates written here that define tools, the model's calls in each format (markers as special tokens for
Mistral and Llama), the assistant's tool_calls and the tool result carried into the next prompt.

Teeth (in the tests): a parser that drops the arguments, a history without the tool fields, the markers decoded
away (skip_special_tokens) each fail.
"""

from __future__ import annotations

import json
import random

import openai
import pytest

from char_model import char_model
from pagedkit.apps.serve import create_app
from pagedkit.apps.serve import tools as T
from pagedkit.apps.serve.tokenizer import ServeTokenizer, load_tokenizer
from pagedkit.engine import Engine
from scripted_engine import ScriptedModel, one_hot
from test_serve_helpers import ServerThread

# -- the parsers -----------------------------------------------------------------------------------------------------

A = {"city": "Paris", "days": [1, 2], "opts": {"unit": "celsius", "note": "</tool_call> ;"}}
CASES = [  # (parser, text, content, [(name, arguments)])
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(A) + '}\n</tool_call>', None,
     [("get_weather", A)]),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
               '<tool_call>{"name": "b", "arguments": {}}</tool_call>', "Let me check.\n", [("a", {"x": 1}), ("b", {})]),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {"x": [1, 2]}}', None, [("a", {"x": [1, 2]})]),  # eos, no close
    ("hermes", "It is sunny.", "It is sunny.", []),
    ("hermes", '<tool_call>{"name": "a", "arguments": {"x": }}</tool_call>', None, []),  # broken JSON
    ("hermes", '<tool_call>{"arguments": {"x": 1}}</tool_call>', None, []),  # no name
    ("hermes", '<tool_call>{"name": "a", "arguments": [1]}</tool_call>', None, []),  # arguments not an object
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": ' + json.dumps(A) + '}]',
     None, [("a", {"x": 1}), ("b", A)]),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "a", "arguments": "{\\"x\\": 1}"}]', "Sure. ", [("a", {"x": 1})]),
    ("mistral", '[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[CALL_ID]abc123456[ARGS]' + json.dumps(A), None,
     [("a", {"x": 1}), ("b", A)]),
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}', None, []),  # cut short
    ("mistral", "[TOOL_CALLS]a{}", None, []),
    ("mistral", "No tools needed.", "No tools needed.", []),
    ("llama3_json", '{"name": "a", "parameters": ' + json.dumps(A) + '}', None, [("a", A)]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": "z"}}', None,
     [("a", {"x": 1}), ("b", {"y": "z"})]),
    ("llama3_json", ' \n{"name": "a", "parameters": {}}', None, [("a", {})]),
    ("llama3_json", 'The call would be {"name": "a"}', "The call would be {\"name\": \"a\"}", []),
    ("llama3_json", '{"name": "a", "parameters": {"x": 1}', None, []),  # cut short
    ("llama3_json", '{"title": "not a call"}', None, []),
]


def check_parsers():
    for parser, text, content, calls in CASES:
        got_content, got = T.parse_calls(parser, text)
        if not calls:  # no call, or a malformed one: the whole text is the content
            assert (got_content, got) == (text, []), (parser, text, got_content, got)
            continue
        assert got_content == content, (parser, text, got_content)
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls, (parser, text, got)
        assert all(c["type"] == "function" for c in got) and len({c["id"] for c in got}) == len(got)
        for c in got:
            assert (c["id"].isalnum() and len(c["id"]) == 9) if parser == "mistral" else c["id"].startswith("call_")


def test_parsers_on_fixed_texts():
    check_parsers()


def test_teeth_a_parser_dropping_the_arguments_fails(monkeypatch):
    real = T._call
    monkeypatch.setattr(T, "_call", lambda obj, keys=("arguments", "parameters"): (real(obj, keys)[0], "{}"))
    with pytest.raises(AssertionError):
        check_parsers()


def test_parser_chosen_from_the_template():
    assert T.choose_parser("{{ '<tool_call>' }}{{ tools }}") == "hermes"
    assert T.choose_parser("[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS]") == "mistral"
    assert T.choose_parser("<|python_tag|>{{ tools }}") == "llama3_json"
    assert T.choose_parser('{"name": function name, "parameters": dictionary}{{ tools }}') == "llama3_json"
    assert T.choose_parser("{{ tools }}") == T.choose_parser(None) == "hermes"
    assert T.choose_parser("<tool_call>", override="mistral") == "mistral"
    with pytest.raises(ValueError, match="tool-call-parser"):
        T.choose_parser("", override="json")
    assert T.template_takes_tools("{% if tools %}x{% endif %}") and not T.template_takes_tools("{{ messages }}")
    from pagedkit.apps.serve.cli import _parser

    assert _parser().parse_args(["m", "--tool-call-parser", "mistral"]).tool_call_parser == "mistral"


def test_streaming_shaping_equals_the_whole_answer():
    rng = random.Random(0)
    for parser, text, _, calls in CASES:
        whole = T.ToolOutput(parser)
        whole.feed(text)
        content, want_calls = whole.result()
        for _ in range(5):
            out, shown, i = T.ToolOutput(parser), "", 0
            while i < len(text):
                n = rng.randint(1, 6)
                shown += out.feed(text[i:i + n])
                i += n
            rest, got_calls = out.finish()
            assert shown + rest == (content or ""), (parser, text, shown, rest)
            assert [c["function"] for c in got_calls] == [c["function"] for c in want_calls]
            if calls:
                for marker in ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", '{"name"'):
                    assert marker not in shown


# -- the round trip through the server -------------------------------------------------------------------------------

SPECIALS = ("[TOOL_CALLS]", "[ARGS]", "<|python_tag|>")
HISTORY = ("{% for m in messages %}{% if m.role == 'tool' %}{TOOL_RESULT}"
           "{% elif m.role == 'assistant' and m.tool_calls %}assistant:{% for c in m.tool_calls %}{CALL}{% endfor %}\n"
           "{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
           "{% if add_generation_prompt %}assistant:{% endif %}")
TEMPLATES = {
    "hermes": "{% if tools %}Tools:{% for t in tools %} {{ t.function | tojson }}{% endfor %}\nCall them as "
              "<tool_call>{\"name\", \"arguments\"}</tool_call>\n{% endif %}" + HISTORY.replace(
                  "{TOOL_RESULT}", "{% if m.name is not defined %}{{ raise_exception('a tool message needs its name') }}"
                                   "{% endif %}<tool_response id=\"{{ m.tool_call_id }}\" name=\"{{ m.name }}\">"
                                   "{{ m.content }}</tool_response>\n").replace(
                  "{CALL}", "<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
                            "{{ c.function.arguments | tojson }}}</tool_call>"),
    "mistral": "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]\n{% endif %}" + HISTORY.replace(
        "{TOOL_RESULT}", "[TOOL_RESULTS]{\"call_id\": \"{{ m.tool_call_id }}\", \"content\": \"{{ m.content }}\"}"
                         "[/TOOL_RESULTS]\n").replace(
        "{CALL}", "[TOOL_CALLS][{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}, "
                  "\"id\": \"{{ c.id }}\"}]"),
    "llama3_json": "{% if tools %}Answer with {\"name\": function name, \"parameters\": ...} for one of: "
                   "{{ tools | map(attribute='function') | map(attribute='name') | join(', ') }}\n{% endif %}"
                   + HISTORY.replace("{TOOL_RESULT}", "ipython: {{ m.content }} (call {{ m.tool_call_id }})\n").replace(
                       "{CALL}", "<|python_tag|>{\"name\": \"{{ c.function.name }}\", \"parameters\": "
                                 "{{ c.function.arguments | tojson }}}"),
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather of a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "unit": {"enum": ["celsius", "kelvin"]}},
                                               "required": ["city"]}}}]
ARGS = {"city": "Paris", "unit": "celsius"}
CALL_TEXT = {  # what the scripted model writes (the markers of Mistral and Llama are special tokens)
    "hermes": 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(ARGS) + '}\n</tool_call>',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": ' + json.dumps(ARGS) + '}]',
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": ' + json.dumps(ARGS) + '}',
}
CONTENT = {"hermes": "Let me look.\n", "mistral": None, "llama3_json": None}
ANSWER = "It is 21 C in Paris."


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def served(request, tmp_path_factory):
    fmt = request.param
    folder = char_model(tmp_path_factory.mktemp("tools") / fmt, TEMPLATES[fmt], SPECIALS, context=2048)
    tok = load_tokenizer(folder)
    prompts = []  # (engine request, its prompt as text) of each request the model saw

    def next_logits(req, context):
        if not prompts or prompts[-1][0] is not req:
            prompts.append((req, tok.decode(req.prompt, skip_special_tokens=False)))
        prompt = prompts[-1][1]
        calls = "get_weather" in prompt and "Weather" in prompt  # tools offered, and a question for them
        text = ANSWER if "21 C" in prompt else CALL_TEXT[fmt] if calls else "No tools here."
        script = tok.encode(text, add_special_tokens=False) + [2]
        k = len(context) - len(req.prompt)
        return one_hot(script[k] if k < len(script) else 2)

    engine = Engine(folder, max_batch_size=4, max_num_tokens=4096)  # context 2048: the scripted model never runs it
    ScriptedModel(engine, next_logits)
    assert ServeTokenizer(tok).decode_keeping(tok.encode("[TOOL_CALLS]x"), frozenset(SPECIALS)) == "[TOOL_CALLS]x"
    with ServerThread(create_app(engine, tok, fmt)) as url:
        yield fmt, openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60), prompts


def _stream(client, fmt, **kw):
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(model=fmt, stream=True, **kw):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            c = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            c["id"] += d.id or ""
            c["name"] += d.function.name or ""
            c["arguments"] += d.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return content, [calls[k] for k in sorted(calls)], reason


def round_trip(fmt, client, prompts):
    user = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(model=fmt, messages=user, tools=TOOLS)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert c.message.content == CONTENT[fmt]
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == ARGS
    assert "get_weather" in prompts[-1][1] and "the weather of a city" in prompts[-1][1] or fmt == "llama3_json"

    content, calls, reason = _stream(client, fmt, messages=user, tools=TOOLS)
    assert reason == "tool_calls" and content == (CONTENT[fmt] or "")
    assert [(x["name"], json.loads(x["arguments"])) for x in calls] == [("get_weather", ARGS)] and calls[0]["id"]

    history = user + [c.message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "21 C"}]
    r2 = client.chat.completions.create(model=fmt, messages=history, tools=TOOLS)
    assert r2.choices[0].message.content == ANSWER and r2.choices[0].finish_reason == "stop"
    assert not r2.choices[0].message.tool_calls
    prompt = prompts[-1][1]
    assert "21 C" in prompt and call.id in prompt, prompt  # the tool result, with the id of its call
    assert fmt != "hermes" or 'name="get_weather"' in prompt  # and the name of the function (taken from the call)
    args = json.dumps(ARGS)  # the call, its arguments an object again (templates write them with tojson)
    assert {"hermes": f'<tool_call>{{"name": "get_weather", "arguments": {args}}}</tool_call>',
            "mistral": f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {args}, "id": "{call.id}"}}]',
            "llama3_json": f'<|python_tag|>{{"name": "get_weather", "parameters": {args}}}'}[fmt] in prompt, prompt


def test_tool_call_round_trip(served):
    round_trip(*served)


def test_teeth_history_without_the_tool_fields(served, monkeypatch):
    monkeypatch.setattr(T, "history_fields", lambda m, where: {})
    with pytest.raises((AssertionError, openai.APIStatusError)):
        round_trip(*served)


def test_teeth_markers_decoded_away(served, monkeypatch):
    if served[0] != "mistral":  # Hermes' markers are plain text; a Llama call parses without <|python_tag|>
        return
    monkeypatch.setattr(ServeTokenizer, "decode_keeping", lambda self, ids, keep: self.decode(ids))
    with pytest.raises(AssertionError):
        round_trip(*served)


def test_tool_choice_none_and_plain_answers(served):
    fmt, client, prompts = served
    user = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(model=fmt, messages=user, tools=TOOLS, tool_choice="none")
    assert "get_weather" not in prompts[-1][1]  # the tools were left out of the prompt
    assert r.choices[0].message.content == "No tools here." and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model=fmt, messages=user)
    assert r.choices[0].message.content == "No tools here." and not r.choices[0].message.tool_calls
    hello = [{"role": "user", "content": "hello"}]  # tools offered, none called: plain content, streamed too
    r = client.chat.completions.create(model=fmt, messages=hello, tools=TOOLS, tool_choice="auto")
    assert "get_weather" in prompts[-1][1]
    assert r.choices[0].message.content == "No tools here." and not r.choices[0].message.tool_calls
    content, calls, reason = _stream(client, fmt, messages=hello, tools=TOOLS, tool_choice="auto")
    assert (content, calls, reason) == ("No tools here.", [], "stop")


@pytest.mark.parametrize("body, param, words", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not one of"),
    ({"tool_choice": "auto"}, "tool_choice", "only allowed with tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "expected"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "unique name"),
    ({"functions": [TOOLS[0]["function"]]}, "functions", "use tools"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
    ({"messages": [{"role": "tool", "content": "21 C"}]}, "messages", "tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "x", "function": {"name": "f", "arguments": {}}}]}]},
     "messages", "arguments\": a JSON string"),
])
def test_bad_tool_fields_are_400s(served, body, param, words):
    fmt, client, _ = served
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**({"model": fmt, "messages": [{"role": "user", "content": "x"}]} | body))
    e = err.value.body
    assert e["param"] == param and words in e["message"], e


def test_history_arguments_that_are_not_json_objects_are_kept_as_text(served):
    """Arguments that do not parse (deep nesting json cannot read, a 1500-digit integer, plain text) reach the
    template as the strings the client sent: a 200, never a 5xx."""
    fmt, client, prompts = served
    for args in ("[" * 1500, "1" * 1500, "not json"):
        call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": args}}
        r = client.chat.completions.create(model=fmt, tools=TOOLS, messages=[
            {"role": "user", "content": "hello"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}, {"role": "user", "content": "hello"}])
        assert r.choices[0].finish_reason == "stop"
        assert args[:20] in prompts[-1][1]
