"""paged-serve: an OpenAI-compatible HTTP endpoint over pagedkit's engine (starlette + uvicorn).

`create_app(engine, tokenizer, model_name)` builds the app; `paged-serve MODEL_DIR` (cli.py) runs it.
Needs the `serve` extra (starlette, uvicorn) and transformers (the `export` extra) for the tokenizer.
See docs/serve.md.
"""

from __future__ import annotations


def create_app(engine, tokenizer, model_name: str, **kwargs):
    from .app import create_app as _create_app

    return _create_app(engine, tokenizer, model_name, **kwargs)


__all__ = ["create_app"]
