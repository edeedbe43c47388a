"""A model folder for paged-serve's structured-output and tool tests: examples/tiny-paged (vocab 128, random
weights) with a character-level byte-level BPE tokenizer that can spell any ASCII text (JSON included), which
llguidance can read (the word-level tokenizer of test_serve_helpers has no decoder: llguidance refuses it).

Vocabulary: <unk> 0, <s> 1, </s> 2 (eos), "\\n" and the 95 printable ASCII characters, a few merges (`":`,
`{"`, `true`, `null`...), then the extra special tokens asked for (tool-call markers), at most 128 in all.
`context`: genai_config's context_length overridden (for the scripted tests, whose network never runs).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from scripted_engine import TINY_PAGED

MERGES = [('"', ':'), ('"', ','), ('{', '"'), ('"', '}'), ('Ġ', '"'), ('t', 'r'), ('tr', 'u'), ('tru', 'e'),
          ('n', 'u'), ('nu', 'l'), ('nul', 'l')]


def _byte_chars() -> dict[int, str]:
    """GPT-2's bytes -> printable characters map (what the ByteLevel pre-tokenizer writes)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def write_char_tokenizer(folder: Path, chat_template: str | None = None, specials: tuple[str, ...] = (),
                         vocab_size: int = 128) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = _byte_chars()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in [10] + list(range(32, 127)):
        vocab[chars[b]] = len(vocab)
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(dict(vocab), MERGES, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<unk>", "<s>", "</s>", *specials])
    assert tok.get_vocab_size() <= vocab_size, tok.get_vocab_size()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "pad_token": "<unk>", "model_max_length": 4096}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return folder


def char_model(folder: Path, chat_template: str | None = None, specials: tuple[str, ...] = (),
               context: int | None = None) -> Path:
    """examples/tiny-paged copied to `folder` with the character tokenizer (and chat template) beside it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(TINY_PAGED / "model.onnx", folder / "model.onnx")
    config = json.loads((TINY_PAGED / "genai_config.json").read_text())
    if context is not None:
        config["model"]["context_length"] = context
    (folder / "genai_config.json").write_text(json.dumps(config, indent=1))
    return write_char_tokenizer(folder, chat_template, specials)
