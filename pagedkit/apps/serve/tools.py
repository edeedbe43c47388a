"""Tool calling for paged-serve's chat endpoint: `tools` / `tool_choice`, the tool calls parsed out of the
generated text, and tool calls / tool results carried into the history through the chat template.

The chat template receives `tools=` (OpenAI's tool objects) and the history as OpenAI sends it: an assistant
message's `tool_calls` (their `arguments` JSON strings turned into objects, which templates write with
`tojson`) and `tool` messages with their `tool_call_id` and `name` (by default the name of the call they answer). A template that never mentions `tools`
cannot take them: 400.

The model writes its calls in its own format; the parser is chosen from the chat template (`choose_parser`;
`--tool-call-parser` overrides it):

    hermes       (Hermes, Qwen 2.5 / 3...)  <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one or more;
                                            the template writes "<tool_call>"
    mistral      (Mistral, Mixtral...)      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...], or
                                            [TOOL_CALLS]name[ARGS]{...} (newer tokenizers); "[TOOL_CALLS]"
    llama3_json  (Llama 3.1 / 3.2 / 3.3)    the whole answer {"name": ..., "parameters": {...}} (calls separated
                                            by ";"), maybe after <|python_tag|>; the template writes
                                            "<|python_tag|>" or "parameters"
    otherwise hermes.

The text before the first call is the message's content; text after the calls is dropped. A call that does not
parse (broken JSON, no name) leaves the whole text as plain content, never an error. Markers that are special
tokens ([TOOL_CALLS], <|python_tag|>) are kept in the text the parser reads (`ToolOutput.keep`).

tool_choice "required" / a named function force the call with the grammar (llguidance, structured.py): the
answer is then JSON (the named function's arguments, or [{"name", "parameters"}, ...]) whatever the model's
format; "none" leaves the tools out of the prompt.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from .protocol import RequestError

PARSERS = ("hermes", "llama3_json", "mistral")
MARKERS = {"hermes": ("<tool_call>",), "mistral": ("[TOOL_CALLS]",), "llama3_json": ("<|python_tag|>",)}
KEEP = {"hermes": ("<tool_call>", "</tool_call>"), "mistral": ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"),
        "llama3_json": ("<|python_tag|>",)}
NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def choose_parser(template: str | None, override: str | None = None) -> str:
    """The tool-call format of a chat template (module docstring), or the override."""
    if override:
        if override not in PARSERS:
            raise ValueError(f"--tool-call-parser: expected one of {', '.join(PARSERS)}, got {override!r}")
        return override
    t = template or ""
    if "<tool_call>" in t:
        return "hermes"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or '"parameters"' in t:
        return "llama3_json"
    return "hermes"


def template_takes_tools(template: str | None) -> bool:
    return bool(template) and re.search(r"\btools\b", template) is not None


@dataclass
class Tools:
    """A request's tools: the OpenAI tool objects, tool_choice ("auto", "required" or "named" with `name`)."""

    tools: list[dict]
    choice: str
    name: str | None = None
    parallel: bool = True

    def forced_schema(self) -> dict | None:
        """The JSON schema forcing the answer for "required" / a named function, None for "auto"."""
        params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in self.tools}
        if self.choice == "named":
            return params[self.name]
        if self.choice != "required":
            return None
        call = [{"type": "object", "properties": {"name": {"const": n}, "parameters": p},
                 "required": ["name", "parameters"], "additionalProperties": False} for n, p in params.items()]
        return {"type": "array", "items": {"anyOf": call}, "minItems": 1} | ({} if self.parallel else {"maxItems": 1})


def parse_tools(body: dict) -> Tools | None:
    """tools / tool_choice / parallel_tool_calls of a chat request; None when no tool may be called."""
    if body.get("functions") is not None or body.get("function_call") is not None:
        name = "functions" if body.get("functions") is not None else "function_call"
        raise RequestError(f"{name}: the deprecated functions API is not supported; use tools and tool_choice", name)
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise RequestError(f"tool_choice: only allowed with tools, got {choice!r}"[:300], "tool_choice")
        return None
    if not isinstance(tools, list):
        raise RequestError(f"tools: expected a list of {{\"type\": \"function\", \"function\": {{...}}}}, got {tools!r}"[:300],
                           "tools")
    names = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict):
            raise RequestError(f"tools[{i}]: expected {{\"type\": \"function\", \"function\": {{\"name\", \"description\", "
                               f"\"parameters\"}}}}, got {t!r}"[:300], "tools")
        name = f.get("name")
        if not isinstance(name, str) or not NAME.match(name) or name in names:
            raise RequestError(f"tools[{i}].function.name: expected a unique name of 1-64 letters, digits, '_', '-' or "
                               f"'.', got {name!r}"[:300], "tools")
        if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
            raise RequestError(f"tools[{i}].function.parameters: expected a JSON schema (an object), got "
                               f"{f['parameters']!r}"[:300], "tools")
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise RequestError(f"tools[{i}].function.description: expected a string", "tools")
        names.append(name)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise RequestError(f"parallel_tool_calls: expected true or false, got {parallel!r}"[:300], "parallel_tool_calls")
    if choice is None or choice == "auto":
        return Tools(tools, "auto", parallel=parallel)
    if choice == "none":
        return None
    if choice == "required":
        return Tools(tools, "required", parallel=parallel)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if name is None:
        raise RequestError("tool_choice: expected \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                           f"\"function\": {{\"name\": ...}}}}, got {choice!r}"[:300], "tool_choice")
    if name not in names:
        raise RequestError(f"tool_choice: function {name!r} is not one of the tools ({', '.join(names)})"[:300],
                           "tool_choice")
    return Tools(tools, "named", name, parallel)


def history_fields(m: dict, where: str) -> dict:
    """The tool fields of one message for the chat template: an assistant's tool_calls (arguments as objects),
    a tool message's tool_call_id and name."""
    out = {}
    if m.get("role") == "assistant" and m.get("tool_calls") is not None:
        calls = m["tool_calls"]
        if not isinstance(calls, list):
            raise RequestError(f"{where}.tool_calls: expected a list of tool calls, got {calls!r}"[:300], "messages")
        out["tool_calls"] = []
        for j, c in enumerate(calls):
            f = c.get("function") if isinstance(c, dict) else None
            if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(f.get("arguments"), str):
                raise RequestError(f"{where}.tool_calls[{j}]: expected {{\"id\", \"type\": \"function\", \"function\": "
                                   f"{{\"name\", \"arguments\": a JSON string}}}}, got {c!r}"[:300], "messages")
            try:
                args = json.loads(f["arguments"])
            except (ValueError, RecursionError):  # not JSON, or nested too deep for json
                args = f["arguments"]  # kept as the string the client sent
            out["tool_calls"].append({"id": str(c.get("id", "")), "type": "function",
                                      "function": {"name": f["name"], "arguments": args}})
    if m.get("role") == "tool":
        tid = m.get("tool_call_id")
        if not isinstance(tid, str) or not tid:
            raise RequestError(f"{where}.tool_call_id: a tool message needs the id of the call it answers, got "
                               f"{tid!r}"[:300], "messages")
        out["tool_call_id"] = tid
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
    return out


def with_history_fields(messages: list[dict], raw: list) -> list[dict]:
    """protocol.chat_messages' messages with the tool fields of the request's messages (`raw`) added; a tool
    message without a `name` gets the name of the call it answers (Hermes-style templates require it)."""
    out, names = [], {}
    for i, (m, r) in enumerate(zip(messages, raw)):
        m = m | history_fields(r, f"messages[{i}]")
        for call in m.get("tool_calls", ()):
            names[call["id"]] = call["function"]["name"]
        if m["role"] == "tool" and "name" not in m and m.get("tool_call_id") in names:
            m["name"] = names[m["tool_call_id"]]
        out.append(m)
    return out


# -- parsers: text -> (content or None, [(name, arguments JSON string)]) ; no call found: (text, []) ---------------

def _call(obj, params_keys=("arguments", "parameters")) -> tuple[str, str]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ValueError("no name")
    args = next((obj[k] for k in params_keys if k in obj), {})
    if isinstance(args, str):
        args = json.loads(args)
    if not isinstance(args, dict):
        raise ValueError("arguments are not an object")
    return obj["name"], json.dumps(args, ensure_ascii=False)


def _content(text: str) -> str | None:
    return text if text.strip() else None


def _json_values(text: str, sep: str = ";") -> list:
    """The JSON values of `text` one after the other (separated by whitespace or `sep`)."""
    dec, i, out = json.JSONDecoder(), 0, []
    while True:
        while i < len(text) and (text[i].isspace() or text[i] == sep):
            i += 1
        if i == len(text):
            return out
        value, i = dec.raw_decode(text, i)
        out.append(value)


def parse_hermes(text: str):
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    dec, calls, i = json.JSONDecoder(), [], start
    while (i := text.find("<tool_call>", i)) >= 0:  # each call's JSON read whole: "</tool_call>" may be inside it
        i += len("<tool_call>")
        while i < len(text) and text[i].isspace():
            i += 1
        obj, i = dec.raw_decode(text, i)
        calls.append(_call(obj))
    return _content(text[:start]), calls


def parse_mistral(text: str):
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return text, []
    rest, calls = text[start + len("[TOOL_CALLS]"):], []
    if rest.lstrip().startswith("["):
        for value in _json_values(rest.lstrip(), ","):
            calls += [_call(v) for v in (value if isinstance(value, list) else [value])]
    else:
        for part in rest.split("[TOOL_CALLS]"):
            name, sep, args = part.partition("[ARGS]")
            name = name.split("[CALL_ID]")[0].strip()
            if not sep:
                raise ValueError("[ARGS] missing")
            calls.append(_call({"name": name, "arguments": json.loads(args)}))
    if not calls:
        raise ValueError("no call")
    return _content(text[:start]), calls


def parse_llama3_json(text: str):
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].strip()
    if not body.startswith("{"):
        return text, []
    return None, [_call(v) for v in _json_values(body)]


PARSE = {"hermes": parse_hermes, "mistral": parse_mistral, "llama3_json": parse_llama3_json}


def call_id(parser: str) -> str:
    if parser == "mistral":  # Mistral's templates take 9 letters and digits, nothing else
        return uuid.uuid4().hex[:9]
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_calls(parser: str, text: str) -> tuple[str | None, list[dict]]:
    """(content, OpenAI tool_calls) of a generated text; malformed calls: (text, [])."""
    try:
        content, calls = PARSE[parser](text)
    except (ValueError, TypeError, KeyError, RecursionError):
        return text, []
    return content, [{"id": call_id(parser), "type": "function", "function": {"name": n, "arguments": a}}
                     for n, a in calls]


class ToolOutput:
    """The shaping of one answer with tools: `feed(piece)` -> the content that may be shown now (text that could
    begin a call is held back; from a call's marker on, nothing is shown), `finish()` -> (the rest of the
    content, tool_calls). The pieces shown plus the rest equal the non-streamed content."""

    def __init__(self, parser: str, forced: Tools | None = None):
        self.parser, self.forced = parser, forced
        self.keep = frozenset(KEEP[parser]) if forced is None else frozenset()
        self.text, self.shown, self.held = "", 0, False

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.forced is not None or self.held:
            return ""
        t = self.text
        if any(m in t for m in MARKERS[self.parser]) or (self.parser == "llama3_json" and t.lstrip()[:1] == "{"):
            self.held = True
            return ""
        if not t.strip():  # a call may still come first: blank text waits
            return ""
        keep = max((k for m in MARKERS[self.parser] for k in range(len(m) - 1, 0, -1) if t.endswith(m[:k])), default=0)
        out = t[self.shown:len(t) - keep]
        self.shown += len(out)
        return out

    def result(self) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of the whole text."""
        if self.forced is None:
            return parse_calls(self.parser, self.text)
        try:
            value = json.loads(self.text)
            if self.forced.choice == "named":
                if not isinstance(value, dict):
                    raise ValueError("not an object")
                calls = [(self.forced.name, json.dumps(value, ensure_ascii=False))]
            else:
                calls = [_call(v, ("parameters", "arguments")) for v in value]
        except (ValueError, TypeError, RecursionError):
            return self.text, []
        return None, [{"id": call_id(self.parser), "type": "function", "function": {"name": n, "arguments": a}}
                      for n, a in calls]

    def finish(self) -> tuple[str, list[dict]]:
        """The content not shown yet and the tool calls (streaming)."""
        content, calls = self.result()
        content = content or ""
        return content[self.shown:] if content.startswith(self.text[:self.shown]) else "", calls
