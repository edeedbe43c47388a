"""Shared by the paged-serve tests: a tiny word-level tokenizer written into a model folder, a fake engine
with the real engine's interface, and a real uvicorn server on a free port in a background thread."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from pagedkit.engine.params import RequestOutput, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
VOCAB_SIZE = 144  # tests/export_utils.py TINY: vocab 144, bos 1, eos 2, pad 0
WORDS = ["user", "assistant", "system", ":", "hello", "world", "the", "cat", "sat", "on", "mat", "a", "dog"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant :{% endif %}")


def vocab() -> dict[str, int]:
    v = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for w in WORDS:
        v[w] = len(v)
    while len(v) < VOCAB_SIZE:
        v[f"t{len(v)}"] = len(v)
    return v


def tiny_served_model(folder: Path) -> Path:
    """A tiny random Llama exported to `folder` with the word-level tokenizer beside it (the engine tests' model)."""
    from export_utils import export_tiny, tiny_model

    export_tiny(tiny_model("LlamaConfig"), folder)
    return write_tokenizer(folder)


def write_tokenizer(folder: Path, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """tokenizer.json (WordLevel over 144 tokens, whitespace pre-tokenizer) + tokenizer_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel(vocab(), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "pad_token": "<unk>", "model_max_length": 256}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return folder


# -- a fake engine (the interface of pagedkit.engine.Engine; its SamplingParams / RequestOutput) ---

def fake_continuation(prompt: list[int], n: int, eos: int | None = None, eos_at: int | None = None) -> list[int]:
    """The fake engine's tokens for a prompt: each a function of the sequence so far (batching-independent).
    eos_at: token eos_at is the eos id 2, which ends the tokens when `eos` is 2 (None: ignore_eos, go on)."""
    seq, out = list(prompt), []
    for i in range(n):
        tok = 2 if (eos_at is not None and i == eos_at) else 3 + (sum(seq) * 31 + len(seq) * 7) % (VOCAB_SIZE - 3)
        seq.append(tok)
        out.append(tok)
        if eos is not None and tok == eos:
            break
    return out


class FakeEngine:
    """max_pool_tokens: the most tokens one request's cache can hold (None: no pool limit, the attribute the
    server reads); a request above it is aborted at the next step with a reason, as the real engine does."""

    def __init__(self, delay: float = 0.001, eos_at: int | None = None, max_seq_len: int = 256, fail: bool = False,
                 fail_after: int | None = None, max_pool_tokens: int | None = None):
        self.eos_token_ids, self.vocab_size, self.max_seq_len = [2], VOCAB_SIZE, max_seq_len
        self.max_pool_tokens = max_pool_tokens
        self.delay, self.eos_at, self.fail, self.fail_after = delay, eos_at, fail, fail_after
        self._lock = threading.Lock()
        self._reqs: dict[str, dict] = {}
        self.params: dict[str, SamplingParams] = {}
        self.aborted: list[str] = []
        self.steps = 0
        self.max_batch = 0

    def add_request(self, prompt_token_ids, params=None, request_id=None, drafter=None) -> str:
        params = params or SamplingParams()
        with self._lock:
            self.params[request_id] = params
            self._reqs[request_id] = {"prompt": list(prompt_token_ids), "out": [], "params": params,
                                      "plan": fake_continuation(prompt_token_ids, params.max_new_tokens,
                                                                None if params.ignore_eos else 2, self.eos_at)}
        return request_id

    def abort(self, request_id) -> None:
        with self._lock:
            if self._reqs.pop(request_id, None) is not None:
                self.aborted.append(request_id)

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._reqs)

    def step(self):
        time.sleep(self.delay)
        if self.fail or (self.fail_after is not None and self.steps >= self.fail_after):
            raise RuntimeError("fake engine failure")
        outs = []
        with self._lock:
            self.steps += 1
            self.max_batch = max(self.max_batch, len(self._reqs))
            for rid, r in list(self._reqs.items()):
                longest = len(r["prompt"]) + r["params"].max_new_tokens - 1
                if self.max_pool_tokens is not None and longest > self.max_pool_tokens:
                    outs.append(RequestOutput(rid, [], [], True, "abort", f"the KV cache can never hold this "
                                              f"request: {longest} tokens, the pool has {self.max_pool_tokens}"))
                    del self._reqs[rid]
                    continue
                tok = r["plan"][len(r["out"])]
                r["out"].append(tok)
                stop = tok in r["params"].stop_token_ids or (tok == 2 and not r["params"].ignore_eos)
                done = stop or len(r["out"]) >= r["params"].max_new_tokens
                outs.append(RequestOutput(rid, [tok], r["prompt"] + r["out"], done,
                                          ("stop" if stop else "length") if done else None))
                if done:
                    del self._reqs[rid]
        return outs


# -- a real uvicorn server in a thread -----------------------------------------------------------------------

class ServerThread:
    """`with ServerThread(app) as base_url:` uvicorn on 127.0.0.1:<free port>, stopped on exit."""

    def __init__(self, app, limits=None):
        """limits: a ServeLimits: uvicorn configured by paged-serve's connections.uvicorn_config (timeouts...)."""
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        if limits is None:
            config = uvicorn.Config(app, log_level="warning", lifespan="on")
        else:
            from pagedkit.apps.serve.connections import uvicorn_config

            config = uvicorn_config(app, "127.0.0.1", self.port, limits, "warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(20)
        self.sock.close()


class ServeCommand:
    """`with ServeCommand(model_dir, *options) as base_url:` `paged-serve MODEL_DIR --port <free> *options` as a
    subprocess (python -m pagedkit.apps.serve.cli), once its /health answers (within `timeout` s); stopped on
    exit."""

    def __init__(self, model_dir: Path, *options: str, timeout: float = 60, env: dict | None = None,
                 log: Path | None = None):
        """env: variables added to the server's environment; log: a file for its stdout + stderr (else a pipe,
        read only when it fails to start: keep its output small)."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.argv = [sys.executable, "-m", "pagedkit.apps.serve.cli", str(model_dir), "--port", str(self.port),
                     *options]
        self.timeout, self.extra_env, self.log = timeout, env or {}, log

    def output(self) -> str:
        return Path(self.log).read_text() if self.log else self.proc.communicate()[0]

    def __enter__(self) -> str:
        import httpx

        env = os.environ | {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")} | self.extra_env
        out = open(self.log, "w") if self.log else subprocess.PIPE
        self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        if self.log:
            out.close()
        deadline = time.monotonic() + self.timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(self.output())
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1).status_code == 200:
                    return f"http://127.0.0.1:{self.port}"
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.__exit__()
                raise AssertionError(f"paged-serve did not come up: {' '.join(self.argv[2:])}")
            time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(30)


async def completion_text(client, body: dict, stream: bool) -> str:
    """The text of one /v1/completions request on an httpx.AsyncClient: the response's, or its SSE chunks' joined."""
    if not stream:
        return (await client.post("/v1/completions", json=body)).json()["choices"][0]["text"]
    text = ""
    async with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def sse_events(response) -> list:
    """The `data:` payloads of a Server-Sent Events response (httpx streaming), JSON-decoded; '[DONE]' kept."""
    events, buf = [], ""
    for text in response.iter_text():
        buf += text
        while "\n\n" in buf:
            event, buf = buf.split("\n\n", 1)
            assert event.startswith("data: "), event
            payload = event[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert buf == "", f"trailing bytes after the last event: {buf!r}"
    return events
