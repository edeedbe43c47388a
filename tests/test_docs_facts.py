"""The generated op pages (docs/ops/*.md) state the contract facts beyond the schema tables: in-place caches
(Param.aliases), host-memory inputs (Param.host), the cache formats with their stored width (CACHE_FORMATS)
and the block-size rule, all read from contract.py."""

from __future__ import annotations

import re

from pagedkit.validators.contract import (
    BLOCK_SIZE_RULE, CACHE_FORMATS, CONTRACTS, GROUP_QUERY_ATTENTION, PAGED_ATTENTION, block_size_error, cache_width,
)
from pagedkit.validators.docs import render


def _section(text: str, title: str) -> str:
    return text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def _rows(body: str) -> list[list[str]]:
    rows = [line for line in body.splitlines() if line.startswith("| ")][2:]
    return [[c.strip().strip("`") for c in re.split(r"(?<!\\)\|", r)[1:-1]] for r in rows]


def test_in_place_caches_and_host_inputs():
    for c in CONTRACTS.values():
        body = _section(render(c), "In-place caches and host inputs")
        assert {r[0]: r[1] for r in _rows(body)} == c.cache_aliases
        for p in c.inputs:
            assert (f"`{p.name}` (input {p.index})" in body) == p.host, p.name
    assert PAGED_ATTENTION.cache_aliases["key_cache_out"] == "key_cache"
    assert PAGED_ATTENTION.host_inputs == ("attention_metadata",)
    assert GROUP_QUERY_ATTENTION.host_inputs == ("total_sequence_length",)


def test_cache_formats_table_and_width_formula():
    body = _section(render(PAGED_ATTENTION), "Cache formats")
    rows = {r[0]: r for r in _rows(body)}
    assert list(rows) == list(CACHE_FORMATS)
    for name, f in CACHE_FORMATS.items():
        _, storage, quantized, per, width, qmax = rows[name]
        assert f"tensor({storage})" == f.storage
        assert (quantized == "yes") == f.quantized and int(per) == f.per_element
        assert (qmax == "—") == (f.qmax is None)
        for head_size in (8, 16, 64, 96, 128, 7):  # the documented formula gives the contract's width
            got = eval(width.replace("/", "//"), {"head_size": head_size})  # noqa: S307 (our own doc text)
            assert got == cache_width(name, head_size), (name, width, head_size)
    assert rows["int4"][1] == "uint8" and rows["int4"][4] == "(head_size + 1) / 2"


def test_block_size_rule_is_stated_on_the_paged_page_only():
    body = _section(render(PAGED_ATTENTION), "Block size")
    assert BLOCK_SIZE_RULE in body and block_size_error(8) in body
    gqa = render(GROUP_QUERY_ATTENTION)
    assert "## Block size" not in gqa and "## Cache formats" not in gqa
    assert "## In-place caches and host inputs" in gqa
