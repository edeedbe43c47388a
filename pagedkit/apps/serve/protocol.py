"""The OpenAI request fields paged-serve understands: parsing and checks, one error per bad field.

A bad field raises `RequestError` (HTTP 400 with OpenAI's error JSON `{"error": {"message", "type",
"param", "code"}}`); the message names the field, what was given and what is expected. Fields OpenAI
clients commonly send with their neutral value (`echo: false`, `best_of: 1`...) are accepted; a feature
paged-serve does not implement (best_of, echo, suffix...) is refused, never silently ignored. Unknown fields
(`user`, `metadata`...) are ignored. Sampling extensions (vLLM's names): top_k, min_p, repetition_penalty,
stop_token_ids, ignore_eos, max_time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_N = 128  # choices of one request (the engine refuses more than its batch holds)
MAX_LOGPROBS = 20  # top logprobs of one token (OpenAI's chat limit)


class RequestError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Sampling:
    """The sampling fields of a request, checked (max_tokens is resolved against the prompt later)."""

    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"  # the field max_tokens came from (chat: max_completion_tokens)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    constraint: object | None = None  # the engine's SamplingParams.constraint (structured output: structured.py)
    stream: bool = False
    include_usage: bool = False
    max_time: float | None = None  # seconds this request may run (the server's request timeout at most)
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_p: float = 0.0
    logprobs: int | None = None  # None: none; k: the sampled token's and the k most likely tokens'


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{name}: expected a number, got {value!r}", name)
    bound = f"{'>' if lo_open else '>='} {lo}"
    if value > hi or value < lo or (lo_open and value == lo):
        raise RequestError(f"{name}: expected a number {bound} and <= {hi}, got {value!r}", name)
    return float(value)


def _int(body: dict, name: str, lo: int | None = None, what: str | None = None, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name}: expected an integer{'' if lo is None else f' >= {lo}'}, got {value!r}", name)
    if lo is not None and value < lo:
        raise RequestError(f"{name}: expected an integer >= {lo}{what or ''}, got {value}", name)
    if hi is not None and value > hi:
        raise RequestError(f"{name}: expected an integer <= {hi}, got {value}", name)
    return value


def _bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{name}: expected true or false, got {value!r}", name)
    return value


def _unsupported(body: dict, name: str, neutral: tuple, what: str) -> None:
    if name in body and body[name] not in neutral:
        allowed = " or ".join("null" if v is None else repr(v).lower() if isinstance(v, bool) else repr(v)
                              for v in neutral)
        raise RequestError(f"{name}: {what} is not supported by paged-serve; expected {allowed}, "
                           f"got {body[name]!r}", name)


def check_common(body: Any, model_name: str) -> None:
    """The checks shared by both endpoints: a JSON object, the model, the refused features."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body should be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model is not None and model != model_name:
        raise RequestError(f"model: the model {model!r} does not exist; expected {model_name!r}", "model",
                           status=404, code="model_not_found")
    _unsupported(body, "best_of", (None, 1), "best_of > 1")


@dataclass(frozen=True)
class FieldLimits:
    """The request-field limits of a server (ServeLimits carries them; the defaults are its defaults)."""

    max_stop_strings: int = 16
    max_stop_length: int = 1024  # characters of one stop string
    request_timeout_s: float = 600.0  # 0: no deadline; a request's max_time may only lower it


SEED_MAX = 2 ** 63 - 1


def parse_sampling(body: dict, max_tokens_fields: tuple[str, ...] = ("max_tokens",),
                   limits: FieldLimits = FieldLimits()) -> Sampling:
    s = Sampling()
    for name in max_tokens_fields:
        value = _int(body, name, lo=1)
        if value is not None:
            s.max_tokens, s.max_tokens_param = value, name
            break
    s.temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    s.top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = _int(body, "top_k", lo=-1, what=" (0 or -1: no top-k)")
    s.top_k = 0 if top_k in (None, -1) else top_k
    s.seed = _int(body, "seed", lo=0, hi=SEED_MAX)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(x, str) and x for x in stop):
        raise RequestError(f"stop: expected a non-empty string or a list of non-empty strings, got {body['stop']!r}",
                           "stop")
    if len(stop) > limits.max_stop_strings:
        raise RequestError(f"stop: expected at most {limits.max_stop_strings} stop strings (the server's "
                           f"--max-stop-strings), got {len(stop)}", "stop")
    longest = max(stop, key=len, default="")
    if len(longest) > limits.max_stop_length:
        raise RequestError(f"stop: expected stop strings of at most {limits.max_stop_length} characters (the "
                           f"server's --max-stop-length), got one of {len(longest)}", "stop")
    s.stop = stop
    ids = body.get("stop_token_ids")
    if ids is not None and (not isinstance(ids, list)
                            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ids)):
        raise RequestError(f"stop_token_ids: expected a list of token ids (integers >= 0), got {ids!r}",
                           "stop_token_ids")
    s.stop_token_ids = list(ids or [])
    s.ignore_eos = _bool(body, "ignore_eos")
    s.stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise RequestError(f"stream_options: expected an object like {{\"include_usage\": true}}, "
                               f"got {opts!r}", "stream_options")
        if not s.stream:
            raise RequestError("stream_options: only allowed with stream: true", "stream_options")
        s.include_usage = _bool(opts, "include_usage")
    s.max_time = _max_time(body, limits.request_timeout_s)
    s.n = _int(body, "n", lo=1, hi=MAX_N) or 1
    s.presence_penalty = _number(body, "presence_penalty", 0.0, -2.0, 2.0)
    s.frequency_penalty = _number(body, "frequency_penalty", 0.0, -2.0, 2.0)
    s.repetition_penalty = _number(body, "repetition_penalty", 1.0, 0.0, 10.0, lo_open=True)
    s.min_p = _number(body, "min_p", 0.0, 0.0, 1.0)
    s.logit_bias = _logit_bias(body)
    return s


def _logit_bias(body: dict) -> dict[int, float]:
    """logit_bias: {"token id": bias in [-100, 100]} (JSON keys are strings); checked against the vocabulary later."""
    bias = body.get("logit_bias")
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise RequestError(f"logit_bias: expected an object mapping token ids to biases, got {bias!r}"[:300],
                           "logit_bias")
    out = {}
    for key, value in bias.items():
        try:
            tok = int(key)
        except ValueError:
            tok = -1
        if tok < 0 or str(tok) != key.strip().lstrip("+"):
            raise RequestError(f"logit_bias: keys should be token ids (integers >= 0), got {key!r}"[:300],
                               "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise RequestError(f"logit_bias[{key!r}]: expected a number in [-100, 100], got {value!r}"[:300],
                               "logit_bias")
        out[tok] = float(value)
    return out


def check_logit_bias(s: Sampling, vocab_size: int | None) -> None:
    bad = [t for t in s.logit_bias if vocab_size is not None and t >= vocab_size]
    if bad:
        raise RequestError(f"logit_bias: token ids should be < {vocab_size} (the vocabulary), got {bad[0]}",
                           "logit_bias")


def completion_logprobs(body: dict, s: Sampling) -> None:
    """/v1/completions' logprobs: an integer 0..MAX_LOGPROBS (the sampled token's logprob and that many top ones)."""
    s.logprobs = _int(body, "logprobs", lo=0, hi=MAX_LOGPROBS)


def chat_logprobs(body: dict, s: Sampling) -> None:
    """Chat's logprobs: true / false, with top_logprobs 0..MAX_LOGPROBS (only with logprobs: true)."""
    top = _int(body, "top_logprobs", lo=0, hi=MAX_LOGPROBS)
    if _bool(body, "logprobs"):
        s.logprobs = top or 0
    elif top:
        raise RequestError("top_logprobs: only allowed with logprobs: true", "top_logprobs")


def _max_time(body: dict, server_s: float) -> float | None:
    """max_time (extension, seconds, as transformers' generate): the request's deadline; the server's
    request timeout when absent, never more."""
    bound = f" and <= {server_s:g} (the server's --request-timeout)" if server_s else ""
    value = body.get("max_time")
    if value is None:
        return server_s or None
    number = not isinstance(value, bool) and isinstance(value, (int, float))
    if not number or not 0 < value < math.inf or (server_s and value > server_s):
        raise RequestError(f"max_time: expected a number of seconds > 0{bound}, got {value!r}", "max_time")
    return float(value)


def check_token_ids(ids: list, param: str, vocab_size: int | None) -> list[int]:
    if not ids:
        raise RequestError(f"{param}: expected at least one token, got an empty prompt", param)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
            bound = f" < {vocab_size}" if vocab_size is not None else ""
            raise RequestError(f"{param}: expected token ids (integers >= 0{bound}), got {t!r}", param)
    return list(ids)


def completion_prompt(body: dict, encode, vocab_size: int | None) -> list[int]:
    """prompt: a string (tokenized) or a list of token ids; a batch of one (a list holding one of those)."""
    if "prompt" not in body or body["prompt"] is None:
        raise RequestError("prompt: this field is required (a string or a list of token ids)", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return check_token_ids(encode(prompt), "prompt", vocab_size)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise RequestError(f"prompt: batched prompts are not supported; expected one string or one list of token "
                           f"ids, got a list of {len(prompt)} prompts", "prompt")
    if isinstance(prompt, list):
        return check_token_ids(prompt, "prompt", vocab_size)
    raise RequestError(f"prompt: expected a string or a list of token ids, got {type(prompt).__name__}", "prompt")


def check_completion_fields(body: dict) -> None:
    _unsupported(body, "echo", (None, False), "echo")
    _unsupported(body, "suffix", (None, ""), "suffix")


def chat_messages(body: dict) -> list[dict]:
    """messages: a non-empty list of {role, content}; content a string or a list of text parts (the tool fields
    of the history: tools.with_history_fields)."""
    messages = body.get("messages")
    if messages is None:
        raise RequestError("messages: this field is required (a list of {\"role\", \"content\"} objects)",
                           "messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"messages: expected a non-empty list of {{\"role\", \"content\"}} objects, "
                           f"got {messages!r}", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"{where}: expected an object with \"role\" and \"content\", got {m!r}", "messages")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise RequestError(f"{where}.role: expected a string (system, user, assistant...), got {role!r}",
                               "messages")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise RequestError(f"{where}.content: only text parts ({{\"type\": \"text\", \"text\": ...}}) are "
                                       f"supported, got {part!r}", "messages")
                texts.append(part["text"])
            content = "".join(texts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise RequestError(f"{where}.content: expected a string or a list of text parts, got {content!r}",
                               "messages")
        out.append({"role": role, "content": content})
    return out


def resolve_max_tokens(requested: int | None, default: int | None, prompt_len: int, max_seq_len: int,
                       prompt_param: str, param: str = "max_tokens", pool_tokens: int | None = None) -> int:
    """max_tokens within the model's context (prompt + max_tokens <= max_seq_len) and within what the KV
    cache pool can ever hold of one request, `pool_tokens` (prompt + max_tokens - 1 <= pool_tokens: the
    last token is never cached). Without max_tokens: the default, cut to both."""
    room = max_seq_len - prompt_len
    if room < 1:
        raise RequestError(f"{prompt_param}: the prompt has {prompt_len} tokens; expected at most "
                           f"{max_seq_len - 1} (the model's context is {max_seq_len} tokens)", prompt_param)
    pool_room = room if pool_tokens is None else pool_tokens + 1 - prompt_len
    if pool_room < 1:
        raise RequestError(f"{prompt_param}: the prompt has {prompt_len} tokens; the KV cache pool can hold at "
                           f"most {pool_tokens} tokens of one request (the server's --num-blocks)", prompt_param)
    if requested is None:
        return min(room if default is None else min(default, room), pool_room)
    if requested > room:
        raise RequestError(f"{param}: expected at most {room} (context {max_seq_len} tokens - prompt "
                           f"{prompt_len} tokens), got {requested}", param)
    if requested > pool_room:
        raise RequestError(f"{param}: expected at most {pool_room}: the KV cache pool can hold at most "
                           f"{pool_tokens} tokens of one request and the prompt has {prompt_len} tokens, got "
                           f"{requested}", param)
    return requested
