"""The model folder's tokenizer for paged-serve: MODEL_DIR/tokenizer.json (+ tokenizer_config.json with
its special tokens and `chat_template`, or chat_template.jinja) through transformers' PreTrainedTokenizerFast.

`ServeTokenizer` wraps it with the three operations the server needs: `encode` (a completion prompt;
special tokens as the tokenizer's post-processor adds them, e.g. BOS), `decode` (generated tokens, special
tokens skipped), `token_text` (one token, for logprobs) and `chat` (messages rendered with the chat template and the assistant's generation
prompt, then tokenized without adding special tokens again: the template writes them).
"""

from __future__ import annotations

from pathlib import Path

from ...cli_errors import one_line
from .protocol import RequestError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def missing_tokenizer(model_dir: str | Path) -> str | None:
    """The one-line reason when MODEL_DIR has no tokenizer.json, else None."""
    path = Path(model_dir) / "tokenizer.json"
    if path.is_file():
        return None
    return (f"{path}: no such file (paged-serve needs the model folder's tokenizer; paged-export copies it "
            "from the checkpoint)")


def load_tokenizer(model_dir: str | Path):
    """PreTrainedTokenizerFast of MODEL_DIR (no hub access, no remote code); ValueError / OSError otherwise."""
    from ...interface.paths import inside_folder

    model_dir = Path(model_dir)
    problem = missing_tokenizer(model_dir)
    if problem:
        raise OSError(problem)
    for name in TOKENIZER_FILES:  # UnsafePathError: a symlink leading out of the folder
        if (model_dir / name).exists():
            inside_folder(model_dir, name)
    from transformers import PreTrainedTokenizerFast

    try:
        return PreTrainedTokenizerFast.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as exc:  # tokenizers / transformers raise their own exceptions for malformed files
        raise ValueError(f"{model_dir}: could not load the tokenizer ({type(exc).__name__}: "
                         f"{one_line(str(exc))})") from None


class ServeTokenizer:
    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._kept = None  # (keep, {special token id: its text}) of decode_keeping

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tok, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True) if ids else ""

    def token_text(self, token_id: int) -> str:
        """One token's text for logprobs (special tokens shown; a byte token alone may decode to U+FFFD)."""
        return self.tok.decode([token_id], skip_special_tokens=False)

    @property
    def chat_template(self) -> str | None:
        t = getattr(self.tok, "chat_template", None)
        return t if isinstance(t, str) else None if t is None else str(t)

    def decode_keeping(self, ids: list[int], keep: frozenset[str]) -> str:
        """decode(ids), but the special tokens whose text is in `keep` are kept (tool-call markers such as
        [TOOL_CALLS], that skip_special_tokens would drop)."""
        if not keep:
            return self.decode(ids)
        if self._kept is None or self._kept[0] != keep:
            special = {i: str(t) for i, t in self.tok.added_tokens_decoder.items() if getattr(t, "special", False)}
            self._kept = (keep, {i: t for i, t in special.items() if t in keep})
        kept, out, run = self._kept[1], [], []
        for t in ids:
            if t in kept:
                out += [self.decode(run), kept[t]]
                run = []
            else:
                run.append(t)
        return "".join(out) + self.decode(run)

    def chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        if not self.has_chat_template:
            raise RequestError("messages: this model folder has no chat template (expected \"chat_template\" in "
                               "tokenizer_config.json or a chat_template.jinja); use /v1/completions with a "
                               "prompt instead", "messages")
        try:
            extra = {"tools": tools} if tools else {}
            text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
        except Exception as exc:  # jinja errors, the template's raise_exception (e.g. roles out of order)
            raise RequestError(f"messages: the chat template refused them ({type(exc).__name__}: "
                               f"{one_line(str(exc))})", "messages") from None
        return list(self.tok.encode(text, add_special_tokens=False))


def as_serve_tokenizer(tokenizer) -> ServeTokenizer:
    return tokenizer if isinstance(tokenizer, ServeTokenizer) else ServeTokenizer(tokenizer)
