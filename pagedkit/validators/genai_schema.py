"""The schema of genai_config.json: every field pagedkit reads, with its JSON type and range, in one table.

`GENAI_FIELDS` is the one definition both readers use: `paged-validate` / `validate_model`
(validators/model.py) and the runtime's reader (`runtime/generate.py` `read_config`: paged-run, Generator,
Engine, paged-bench, paged-serve), and paged-rewrite for its source folder. `config_problems(config)`
returns one `ConfigProblem` per field that breaks its row (field, expected value, what was found);
`check_genai_config` raises them all at once as one `GenaiConfigError` (a ValueError whose text is one line:
the CLIs print it with exit status 2, pagedkit/cli_errors.py).

A field that is absent (or JSON null) is not read; only the rows marked required must be there: "always"
for every genai_config.json (the decoder section: without it the file describes no model), "runtime" for
pagedkit's runtime, which needs the layer count and head geometry (onnxruntime-genai derives some of them,
so paged-validate does not require them). Fields that are not in the table are not read by pagedkit and not
checked (onnxruntime-genai knows many more). The block sizes follow the operator's rule
(contract.block_size_error: a power of two >= 16).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from ..interface import names as N
from .contract import MIN_BLOCK_SIZE, block_size_error

# the key whose value may be JSON text of an object (pagedkit's writer stores its section so: interface/genai_config.py)
_JSON_TEXT_KEYS = ("pagedkit",)
_MAX_INT = 1 << 62  # larger integers are refused (they would overflow the int64 tensors they size)


@dataclass(frozen=True)
class Field:
    """One row of the schema. path: dotted keys, "[]" after a key = every item of that list
    ("pagedkit.layers[].layer"); kind: a key of _KINDS; minimum: of the integer kinds; required: "" (optional),
    "always" (every genai_config.json; inside a list item: every item) or "runtime" (pagedkit's runtime)."""

    path: str
    kind: str
    minimum: int = 1
    required: str = ""

    @property
    def expected(self) -> str:
        return _KINDS[self.kind][1].format(min=self.minimum, bs=MIN_BLOCK_SIZE, layer=N.LAYER)

    def accepts(self, value: Any) -> bool:
        return _KINDS[self.kind][0](value, self.minimum)


def _int(v: Any, minimum: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and minimum <= v < _MAX_INT


def _section(v: Any, _: int) -> bool:
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except (ValueError, RecursionError):
            return False
    return isinstance(v, Mapping)


# kind -> (test(value, minimum), expected value in words)
_KINDS = {
    "object": (lambda v, m: isinstance(v, Mapping), "an object"),
    "section": (_section, "an object (or its JSON text)"),
    "objects": (lambda v, m: isinstance(v, list) and all(isinstance(x, Mapping) for x in v), "a list of objects"),
    "string": (lambda v, m: isinstance(v, str) and v != "", "a non-empty string"),
    "int": (_int, "an integer >= {min}"),
    "ints": (lambda v, m: isinstance(v, list) and all(_int(x, m) for x in v), "a list of integers >= {min}"),
    "int or ints": (lambda v, m: _int(v, m) or (isinstance(v, list) and all(_int(x, m) for x in v)),
                    "an integer >= {min} or a list of them"),
    "names": (lambda v, m: isinstance(v, Mapping) and all(isinstance(x, str) for x in v.values()),
              "an object mapping names to graph input / output names (strings)"),
    # (a value that is no string at all is the "names" row's finding: reported once)
    "template": (lambda v, m: not isinstance(v, str) or N.template_error(v) is None,
                 "a name template with exactly one '{layer}' for the layer index"),
    "block size": (lambda v, m: block_size_error(v) is None, "a power of two >= {bs}"),
}

_DEC = "model.decoder"
GENAI_FIELDS: tuple[Field, ...] = (
    Field("model", "object", required="always"),
    Field(_DEC, "object", required="always"),
    Field(f"{_DEC}.filename", "string"),
    Field(f"{_DEC}.num_hidden_layers", "int", required="runtime"),
    Field(f"{_DEC}.num_attention_heads", "int", required="runtime"),
    Field(f"{_DEC}.num_key_value_heads", "int", required="runtime"),
    Field(f"{_DEC}.head_size", "int", required="runtime"),
    Field(f"{_DEC}.hidden_size", "int"),
    Field(f"{_DEC}.inputs", "names"),
    *(Field(f"{_DEC}.inputs.{N.past_names_key(k)}", "template") for k in N.CACHE_KINDS),
    Field(f"{_DEC}.outputs", "names"),
    *(Field(f"{_DEC}.outputs.{N.present_names_key(k)}", "template") for k in N.CACHE_KINDS),
    Field(f"{_DEC}.sliding_window", "object"),
    Field(f"{_DEC}.sliding_window.window_size", "int"),
    Field(f"{_DEC}.sliding_window.layers", "ints", minimum=0),
    Field(f"{_DEC}.sliding_window.cache_slack", "int", minimum=0),
    Field("model.context_length", "int"),
    Field("model.vocab_size", "int"),
    Field("model.eos_token_id", "int or ints", minimum=0),
    Field("search", "object"),
    Field("search.max_length", "int"),
    Field("search.chunk_size", "int"),
    Field("engine", "object"),
    Field("engine.dynamic_batching", "object"),
    Field("engine.dynamic_batching.block_size", "block size"),
    Field("pagedkit", "section"),
    Field("pagedkit.block_size", "block size"),
    Field("pagedkit.layers", "objects"),
    Field("pagedkit.layers[].layer", "int", minimum=0, required="always"),
    Field("pagedkit.layers[].head_size", "int"),
)
BLOCK_SIZE_FIELDS = tuple(f.path for f in GENAI_FIELDS if f.kind == "block size")


@dataclass(frozen=True)
class ConfigProblem:
    """One field that breaks its row: field as found ("pagedkit.layers[2].layer"), the row, the value
    (None when missing)."""

    field: str
    row: Field
    value: Any = None
    missing: bool = False

    @property
    def expected(self) -> str:
        return self.row.expected

    @property
    def got(self) -> str:
        return "nothing (the key is missing)" if self.missing else show(self.value)

    def __str__(self) -> str:
        if self.missing:
            return f"{self.field} is missing: expected {self.expected}"
        return f"{self.field} must be {self.expected}, got {self.got}"


class GenaiConfigError(ValueError):
    """A genai_config.json that breaks the schema; `problems` lists every field, the text is one line."""

    def __init__(self, problems: list[ConfigProblem], where: str = "genai_config.json"):
        self.problems = list(problems)
        super().__init__(f"{where}: " + "; ".join(map(str, self.problems)))


def show(value: Any, limit: int = 60) -> str:
    """repr(value), shortened (a config value may be huge)."""
    try:
        text = repr(value)
    except ValueError:  # an integer beyond Python's str conversion limit
        text = f"an integer of more than {_MAX_INT.bit_length()} bits"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _at(node: Any, keys: list[str], done: str) -> Iterator[tuple[str, Any, bool]]:
    """(field, value, present) for the path `keys` under `node` (reached as `done`); nothing where a parent
    is absent or of the wrong type (its own row reports that)."""
    key, rest = keys[0], keys[1:]
    each = key.endswith("[]")
    key = key[:-2] if each else key
    if not isinstance(node, Mapping):
        return
    field = f"{done}.{key}" if done else key
    value = node.get(key)
    if rest and key in _JSON_TEXT_KEYS and not done and isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            return  # the section's own row reports it
    if not rest:
        yield field, value, value is not None
    elif value is None:
        return
    elif each:
        if isinstance(value, list):
            for i, item in enumerate(value):
                yield from _at(item, rest, f"{field}[{i}]")
    else:
        yield from _at(value, rest, field)


def config_problems(config: Any, *, runtime: bool = False) -> list[ConfigProblem]:
    """Every field of `config` (a parsed genai_config.json) that breaks GENAI_FIELDS; runtime=True: the
    fields pagedkit's runtime requires must be there too. [] when it is fine."""
    if not isinstance(config, Mapping):
        return [ConfigProblem("genai_config.json", Field("", "object"), config)]
    out = []
    for row in GENAI_FIELDS:
        keys = row.path.split(".")
        if len(keys) > 1 and keys[0] in _JSON_TEXT_KEYS and not _section(config.get(keys[0], {}), 0):
            continue  # a section that is not an object: its own row reports it
        for field, value, present in _at(config, keys, ""):
            if not present:
                if row.required == "always" or (runtime and row.required == "runtime"):
                    out.append(ConfigProblem(field, row, missing=True))
            elif not row.accepts(value):
                out.append(ConfigProblem(field, row, value))
    return out


def check_genai_config(config: Any, where: str = "genai_config.json", *, runtime: bool = False) -> None:
    """Raise one GenaiConfigError listing every problem of config_problems(config); `where` names the file."""
    problems = config_problems(config, runtime=runtime)
    if problems:
        raise GenaiConfigError(problems, where)


def schema_markdown() -> str:
    """The table of GENAI_FIELDS as docs/validate.md shows it (tests/test_config_inputs.py keeps it current)."""
    need = {"": "", "always": "always", "runtime": "by paged-run, Generator, Engine"}
    rows = ["| field | expected | required |", "| --- | --- | --- |"]
    rows += [f"| `{f.path}` | {f.expected} | {'in each item' if '[]' in f.path and f.required else need[f.required]} |"
             for f in GENAI_FIELDS]
    return "\n".join(rows) + "\n"


__all__ = ["BLOCK_SIZE_FIELDS", "ConfigProblem", "Field", "GENAI_FIELDS", "GenaiConfigError", "check_genai_config",
           "config_problems", "schema_markdown", "show"]
