"""Untrusted model folders (issue 9 items 1-3): malformed folders and models fed to paged-validate, paged-run
and pagedkit.InferenceSession must end in a clear pagedkit error (one line) or a documented exit status,
never an unhandled exception or a traceback, and nothing outside the folder is ever opened.

Every case starts from the bundled examples/tiny-paged folder and mutates it: the genai_config (paths leading
out of the folder, wrong JSON types, missing keys, negative / huge dims, malformed JSON), the model (random
bytes, truncated or bit-flipped protobuf, dangling node inputs, wrong cache dtypes and dims, bad attributes,
external data that dangles or leads out) and the folder (symlinks out, loops, directories where files should
be). A sentinel folder beside the cases holds the files the mutations point at (a valid model among them,
the worst case: opened, it would load); an audit hook on "open" (sys.addaudithook) records every open of a
path resolving into it, and no case may open one.

Exit statuses (pagedkit/cli_errors.py): 0 ok, 1 issues (validate) / parity failure (run) / invalid export,
2 bad input, 3 internal error (a pagedkit bug: never allowed here).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import onnx
import pytest
from onnx import TensorProto, helper

import pagedkit
EXIT_INTERNAL = 3  # pagedkit/cli_errors.py: an internal error (a bug)
from pagedkit.apps.run.cli import main as run_main
from pagedkit.validators.cli import main as validate_main

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-paged"
ERRORS = (ValueError, OSError, NotImplementedError)  # what InferenceSession may raise for a bad folder

# ---------------------------------------------------------------------------------------------------------
# the sentinel: paths resolving into WATCHED must never be opened
# ---------------------------------------------------------------------------------------------------------
WATCHED: list[str] = []
OPENED: list[str] = []


def _audit(event: str, args: tuple) -> None:
    if event != "open" or not WATCHED or not args or isinstance(args[0], int):
        return
    try:
        real = os.path.realpath(os.fsdecode(args[0]))
    except Exception:  # never let the hook break an open
        return
    if any(real == w or real.startswith(w + os.sep) for w in WATCHED):
        OPENED.append(real)


if not getattr(sys, "_pagedkit_untrusted_hook", False):
    sys.addaudithook(_audit)
    sys._pagedkit_untrusted_hook = True


@dataclass
class Root:
    cases: Path
    outside: Path  # the sentinel folder

    @property
    def sentinel_model(self) -> Path:
        return self.outside / "sentinel.onnx"

    @property
    def secret(self) -> Path:
        return self.outside / "secret.txt"

    @property
    def sentinel_data(self) -> Path:
        return self.outside / "sentinel.bin"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Root:
    base = tmp_path_factory.mktemp("untrusted")
    outside = base / "outside"
    outside.mkdir()
    shutil.copy(EXAMPLE / "model.onnx", outside / "sentinel.onnx")
    shutil.copy(EXAMPLE / "genai_config.json", outside / "genai_config.json")
    (outside / "secret.txt").write_text("secret\n")
    (outside / "sentinel.bin").write_bytes(bytes(1 << 16))
    (outside / "libevil.so").write_bytes(b"\x7fELF")
    (base / "cases").mkdir()
    WATCHED[:] = [str(outside.resolve())]
    yield Root(base / "cases", outside)
    WATCHED.clear()


# ---------------------------------------------------------------------------------------------------------
# mutations
# ---------------------------------------------------------------------------------------------------------
@dataclass
class Case:
    name: str
    mutate: Callable[[Path, Root], None]
    refuse: bool = False  # points outside the folder (or is otherwise unusable): must be refused
    prompt_text: bool = False  # paged-run with --prompt (reads tokenizer.json)
    validate_refuses: bool | None = None  # paged-validate must report it (default: refuse); False: it
    # reads nothing the case spoils (tokenizer.json, the weights' external-data ranges)
    session_refuses: bool | None = None  # InferenceSession must refuse it (default: refuse)

    def __post_init__(self):
        if self.validate_refuses is None:
            self.validate_refuses = self.refuse
        if self.session_refuses is None:
            self.session_refuses = self.refuse


def _config(folder: Path) -> dict:
    return json.loads((folder / "genai_config.json").read_text())


def _write_config(folder: Path, cfg) -> None:
    (folder / "genai_config.json").write_text(json.dumps(cfg))


def _set(cfg: dict, path: tuple, value) -> None:
    d = cfg
    for k in path[:-1]:
        d = d.setdefault(k, {}) if isinstance(d, dict) else d[k]
    d[path[-1]] = value


def _rel(folder: Path, target: Path) -> str:
    return os.path.relpath(target, folder)


def config_case(name: str, path: tuple, value, refuse: bool = False) -> Case:
    """Set cfg[path] = value (value may be a function of (folder, root))."""

    def mutate(folder: Path, r: Root) -> None:
        cfg = _config(folder)
        _set(cfg, path, value(folder, r) if callable(value) else value)
        _write_config(folder, cfg)

    return Case(name, mutate, refuse)


def model_case(name: str, edit: Callable[[onnx.ModelProto], None], refuse: bool = False) -> Case:
    def mutate(folder: Path, r: Root) -> None:
        m = onnx.load(str(folder / "model.onnx"))
        edit(m)
        (folder / "model.onnx").write_bytes(m.SerializeToString())

    return Case(name, mutate, refuse)


def bytes_case(name: str, make: Callable[[bytes], bytes]) -> Case:
    def mutate(folder: Path, r: Root) -> None:
        p = folder / "model.onnx"
        p.write_bytes(make(p.read_bytes()))

    return Case(name, mutate)


def _symlink(link: Path, target: Path) -> None:
    if link.exists() or link.is_symlink():
        if link.is_dir() and not link.is_symlink():
            shutil.rmtree(link)
        else:
            link.unlink()
    link.symlink_to(target)


def _external(folder: Path, m: onnx.ModelProto, location: str, *, offset: int = 0, length: int | None = None,
              write: bool = True) -> None:
    """Move lm_head.weight to external data at `location` (written into the folder when `write`)."""
    t = next(t for t in m.graph.initializer if t.name == "lm_head.weight")
    raw = t.raw_data or onnx.numpy_helper.to_array(t).tobytes()
    if write:
        (folder / location).write_bytes(raw)
    t.ClearField("raw_data")
    t.ClearField("float_data")
    t.ClearField("int32_data")
    t.data_location = TensorProto.EXTERNAL
    del t.external_data[:]
    entries = {"location": location, "offset": str(offset), "length": str(len(raw) if length is None else length)}
    for k, v in entries.items():
        t.external_data.add(key=k, value=v)


def external_case(name: str, location: Callable[[Path, Root], str], *, write: bool = False, refuse: bool = True,
                  validate_refuses: bool | None = None, **kw) -> Case:
    def mutate(folder: Path, r: Root) -> None:
        m = onnx.load(str(folder / "model.onnx"))
        _external(folder, m, location(folder, r), write=write, **kw)
        (folder / "model.onnx").write_bytes(m.SerializeToString())

    return Case(name, mutate, refuse, validate_refuses=validate_refuses)


def _outside_cases() -> list[Case]:
    """Every way a folder can name a file outside itself: all must be refused, nothing outside opened."""
    dec = ("model", "decoder", "filename")
    cases = [
        config_case("filename-absolute-sentinel", dec, lambda f, r: str(r.sentinel_model), True),
        config_case("filename-dotdot-sentinel", dec, lambda f, r: _rel(f, r.sentinel_model), True),
        config_case("filename-etc-passwd", dec, "../../../../../../../../../../etc/passwd", True),
        config_case("filename-absolute-own-model", dec, lambda f, r: str(f / "model.onnx"), True),
        config_case("filename-sub-dotdot", dec, lambda f, r: "sub/../" + _rel(f, r.sentinel_model), True),
        config_case("filename-secret", dec, lambda f, r: _rel(f, r.secret), True),
        config_case("filename-windows-drive", dec, "C:\\Windows\\model.onnx", True),
        config_case("filename-backslash-dotdot", dec, "..\\..\\outside\\sentinel.onnx", True),
        config_case("filename-folder-itself", dec, ".", True),
        config_case("filename-root", dec, "/", True),
        config_case("filename-empty", dec, "", True),
        config_case("filename-nul", dec, "model.onnx\x00.txt", True),
        config_case("filename-int", dec, 5, True),
        config_case("filename-list", dec, ["model.onnx"], True),
        config_case("filename-object", dec, {"path": "model.onnx"}, True),
        config_case("embedding-filename-absolute", ("model", "embedding", "filename"),
                    lambda f, r: str(r.sentinel_model), True),
        config_case("vision-config-filename-dotdot", ("model", "vision", "config_filename"),
                    lambda f, r: _rel(f, r.secret), True),
        config_case("custom-ops-library-absolute", ("model", "decoder", "session_options", "custom_ops_library"),
                    lambda f, r: str(r.outside / "libevil.so"), True),
        config_case("adapter-filenames-list", ("model", "decoder", "adapter_filenames"),
                    lambda f, r: ["model.onnx", str(r.sentinel_model)], True),
    ]

    def link_model(folder: Path, r: Root) -> None:
        _symlink(folder / "model.onnx", r.sentinel_model)

    def link_named(folder: Path, r: Root) -> None:
        (folder / "link.onnx").symlink_to(r.sentinel_model)
        cfg = _config(folder)
        cfg["model"]["decoder"]["filename"] = "link.onnx"
        _write_config(folder, cfg)

    def link_dir(folder: Path, r: Root) -> None:
        (folder / "linkdir").symlink_to(r.outside, target_is_directory=True)
        cfg = _config(folder)
        cfg["model"]["decoder"]["filename"] = "linkdir/sentinel.onnx"
        _write_config(folder, cfg)

    def link_config(folder: Path, r: Root) -> None:
        _symlink(folder / "genai_config.json", r.outside / "genai_config.json")

    def link_default(folder: Path, r: Root) -> None:
        cfg = _config(folder)
        del cfg["model"]["decoder"]["filename"]
        _write_config(folder, cfg)
        _symlink(folder / "model.onnx", r.sentinel_model)

    def link_tokenizer(folder: Path, r: Root) -> None:
        (folder / "tokenizer.json").symlink_to(r.secret)

    cases += [
        Case("model-symlink-out", link_model, True),
        Case("filename-symlink-out", link_named, True),
        Case("filename-through-dir-symlink", link_dir, True),
        Case("config-symlink-out", link_config, True),
        Case("default-model-symlink-out", link_default, True),
        Case("tokenizer-symlink-out", link_tokenizer, True, prompt_text=True, validate_refuses=False,
             session_refuses=False),
        external_case("external-absolute", lambda f, r: str(r.sentinel_data)),
        external_case("external-dotdot", lambda f, r: _rel(f, r.sentinel_data)),
        external_case("external-missing", lambda f, r: "missing.bin"),
        external_case("external-empty-location", lambda f, r: ""),
        external_case("external-offset-beyond", lambda f, r: "w.bin", write=True, offset=1 << 20,
                      validate_refuses=False),
        external_case("external-length-beyond", lambda f, r: "w.bin", write=True, length=1 << 30,
                      validate_refuses=False),
        external_case("external-negative-offset", lambda f, r: "w.bin", write=True, offset=-8,
                      validate_refuses=False),
        external_case("external-ok", lambda f, r: "w.bin", write=True, refuse=False),
    ]

    def external_symlink(folder: Path, r: Root) -> None:
        m = onnx.load(str(folder / "model.onnx"))
        _external(folder, m, "w.bin", write=False)
        (folder / "w.bin").symlink_to(r.sentinel_data)
        (folder / "model.onnx").write_bytes(m.SerializeToString())

    cases.append(Case("external-symlink-out", external_symlink, True))
    return cases


_BAD_VALUES = [None, True, -1, 0, 3, 10**12, -10**12, 10**30, 1.5, float("nan"), "x", "", "%d", "../x",
               [], [1, "a"], {}, {"a": 1}]


def _key_paths(d, prefix=()) -> list[tuple]:
    out = []
    if isinstance(d, dict):
        for k, v in d.items():
            out.append(prefix + (k,))
            out += _key_paths(v, prefix + (k,))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            out.append(prefix + (i,))
            out += _key_paths(v, prefix + (i,))
    return out


def _config_cases(rng: random.Random, n_random: int) -> list[Case]:
    base = json.loads((EXAMPLE / "genai_config.json").read_text())
    paths = _key_paths(base)
    dec = ("model", "decoder")
    cases = []
    targeted = {
        dec + ("num_hidden_layers",): [-1, 0, 3, 10**9, "2", 2.5, None],
        dec + ("num_attention_heads",): [0, -4, 3, 10**9],
        dec + ("num_key_value_heads",): [0, -2, 3, 10**9],
        dec + ("head_size",): [0, -16, 15, 10**6],
        ("model", "context_length"): [-1, 0, 1, 10**12, "128"],
        ("model", "vocab_size"): [-1, 0, 10**12],
        ("model", "eos_token_id"): ["x", [[1]], 10**30, -1],
        ("engine", "dynamic_batching", "block_size"): [0, -16, 3, 10**9, "16"],
        ("search", "max_length"): [-1, 10**12],
        ("search", "chunk_size"): [0, -1, "x"],
        dec + ("inputs", "past_key_names"): ["x", "%d%d", "%s", 5, "past_key_values.%d.value"],
        dec + ("inputs", "block_table"): [None, 5, "nothing"],
        dec + ("outputs", "logits"): ["nothing", 5],
        dec + ("state_groups",): [5, [5], [{"kind": "paged_kv", "layer_ids": "x"}]],
        dec + ("sliding_window",): [{"window_size": -1, "layers": [0]}, {"window_size": 8, "layers": "x"},
                                    {"window_size": "x", "layers": [5]}, 5],
        ("pagedkit",): ["not json", "[1, 2]", '{"layers": [{"layer": "x"}]}', '{"block_size": -1}',
                        {"layers": 5}, {"layers": [{"layer": 0, "head_size": -1}]}, 5],
    }
    for path, values in targeted.items():
        for v in values:
            cases.append(config_case(f"cfg-{'.'.join(map(str, path))}={v!r}"[:80], path, v))
    for path in [dec, dec + ("inputs",), dec + ("outputs",), ("model",), dec + ("num_hidden_layers",),
                 dec + ("head_size",), dec + ("inputs", "past_key_names")]:
        def drop(folder: Path, r: Root, path=path) -> None:
            cfg = _config(folder)
            d = cfg
            for k in path[:-1]:
                d = d[k]
            del d[path[-1]]
            _write_config(folder, cfg)

        cases.append(Case(f"cfg-missing-{'.'.join(path)}", drop))
    for i in range(n_random):  # a random key: deleted or given a value of a wrong type / range
        path = rng.choice(paths)
        value = rng.choice(_BAD_VALUES + ["<delete>"])
        if value == "<delete>":
            def drop(folder: Path, r: Root, path=path) -> None:
                cfg = _config(folder)
                d = cfg
                for k in path[:-1]:
                    d = d[k]
                del d[path[-1]]
                _write_config(folder, cfg)

            cases.append(Case(f"cfg-rand{i}-del-{'.'.join(map(str, path))}", drop))
        else:
            cases.append(config_case(f"cfg-rand{i}-{'.'.join(map(str, path))}={value!r}"[:80], path, value))

    def text(name: str, content: bytes) -> Case:
        return Case(name, lambda f, r: (f / "genai_config.json").write_bytes(content))

    good = (EXAMPLE / "genai_config.json").read_bytes()
    cases += [
        text("cfg-empty", b""), text("cfg-truncated", good[: len(good) // 2]), text("cfg-open-brace", b"{"),
        text("cfg-not-utf8", b"\xff\xfe\x00garbage"), text("cfg-list", b"[]"), text("cfg-null", b"null"),
        text("cfg-number", b"1"), text("cfg-string", b'"model"'), text("cfg-bom", b"\xef\xbb\xbf" + good),
        text("cfg-deep-nesting", b"[" * 100_000 + b"]" * 100_000),
        text("cfg-deep-object", b'{"model": ' * 50_000 + b"1" + b"}" * 50_000),
        text("cfg-nan", good.replace(b'"vocab_size": 128', b'"vocab_size": NaN')),
        text("cfg-huge-int", good.replace(b'"vocab_size": 128', b'"vocab_size": ' + b"9" * 5000)),
    ]

    def cfg_dir(folder: Path, r: Root) -> None:
        (folder / "genai_config.json").unlink()
        (folder / "genai_config.json").mkdir()

    def cfg_missing(folder: Path, r: Root) -> None:
        (folder / "genai_config.json").unlink()

    def cfg_loop(folder: Path, r: Root) -> None:
        (folder / "genai_config.json").unlink()
        (folder / "genai_config.json").symlink_to(folder / "loop2")
        (folder / "loop2").symlink_to(folder / "genai_config.json")

    cases += [Case("cfg-is-directory", cfg_dir), Case("cfg-missing", cfg_missing), Case("cfg-symlink-loop", cfg_loop)]
    return cases


def _paged_nodes(m: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in m.graph.node if n.op_type == "PagedAttention"]


def _set_attr(name: str, value) -> Callable[[onnx.ModelProto], None]:
    def edit(m: onnx.ModelProto) -> None:
        node = _paged_nodes(m)[0]
        kept = [a for a in node.attribute if a.name != name]
        del node.attribute[:]
        node.attribute.extend(kept)
        if value is not None:
            node.attribute.append(helper.make_attribute(name, value))

    return edit


def _input(m: onnx.ModelProto, name: str) -> onnx.ValueInfoProto:
    return next(v for v in list(m.graph.input) + list(m.graph.output) if v.name == name)


def _model_cases(rng: random.Random, n_flip: int, n_trunc: int) -> list[Case]:
    cases = []
    for n in (0, 1, 7, 100, 4096):
        data = bytes(rng.getrandbits(8) for _ in range(n))
        cases.append(bytes_case(f"model-random-{n}-bytes", lambda b, data=data: data))
    size = (EXAMPLE / "model.onnx").stat().st_size
    for i in range(n_trunc):
        cut = rng.randrange(1, size)
        cases.append(bytes_case(f"model-truncated-at-{cut}", lambda b, cut=cut: b[:cut]))
    for i in range(n_flip):
        spots = [(rng.randrange(size), rng.getrandbits(8)) for _ in range(rng.randint(1, 6))]

        def flip(b: bytes, spots=spots) -> bytes:
            a = bytearray(b)
            for pos, x in spots:
                a[pos] ^= x or 1
            return bytes(a)

        cases.append(bytes_case(f"model-bitflip-{i}", flip))
    cases.append(bytes_case("model-text", lambda b: b"ir_version: 8\ngraph { }\n"))

    def missing(folder: Path, r: Root) -> None:
        (folder / "model.onnx").unlink()

    def directory(folder: Path, r: Root) -> None:
        (folder / "model.onnx").unlink()
        (folder / "model.onnx").mkdir()

    def loop(folder: Path, r: Root) -> None:
        (folder / "model.onnx").unlink()
        (folder / "model.onnx").symlink_to(folder / "m2.onnx")
        (folder / "m2.onnx").symlink_to(folder / "model.onnx")

    def dangling(folder: Path, r: Root) -> None:
        (folder / "model.onnx").unlink()
        (folder / "model.onnx").symlink_to(folder / "nowhere.onnx")

    cases += [Case("model-missing", missing), Case("model-is-directory", directory),
              Case("model-symlink-loop", loop), Case("model-dangling-symlink", dangling)]

    # graph structure
    def dangling_input(k: int, j: int) -> Callable:
        def edit(m: onnx.ModelProto) -> None:
            node = m.graph.node[k % len(m.graph.node)]
            node.input[j % len(node.input)] = "nothing_produces_this"

        return edit

    for k, j in [(0, 0), (1, 1), (2, 0), (3, 0), (3, 3), (3, 5), (3, 16), (8, 7), (12, 1), (5, 1)]:
        cases.append(model_case(f"node{k}-input{j}-dangling", dangling_input(k, j)))
    for k in (0, 3, 6, 12):
        cases.append(model_case(f"node{k}-removed", lambda m, k=k: m.graph.node.remove(m.graph.node[k])))
    for name in ("attention_metadata", "input_ids", "past_key_values.0.key", "block_table"):
        cases.append(model_case(f"input-removed-{name}", lambda m, name=name: m.graph.input.remove(_input(m, name))))
    for name in ("logits", "present.1.value"):
        cases.append(model_case(f"output-removed-{name}", lambda m, name=name: m.graph.output.remove(_input(m, name))))

    # cache / input types and dims
    def retype(name: str, elem: int) -> Callable:
        def edit(m: onnx.ModelProto) -> None:
            _input(m, name).type.tensor_type.elem_type = elem

        return edit

    for elem in (TensorProto.INT32, TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.BOOL, TensorProto.STRING,
                 TensorProto.UINT8, TensorProto.INT8, TensorProto.FLOAT8E4M3FN, TensorProto.UNDEFINED, 999):
        cases.append(model_case(f"cache-dtype-{elem}", retype("past_key_values.0.key", elem)))
    for name, elem in [("input_ids", TensorProto.FLOAT), ("block_table", TensorProto.INT64),
                       ("attention_metadata", TensorProto.FLOAT), ("present.0.key", TensorProto.INT8),
                       ("logits", TensorProto.INT64), ("cumulative_sequence_lengths", TensorProto.STRING)]:
        cases.append(model_case(f"dtype-{name}-{elem}", retype(name, elem)))

    def redim(name: str, axis: int, value) -> Callable:
        def edit(m: onnx.ModelProto) -> None:
            dims = _input(m, name).type.tensor_type.shape.dim
            if axis >= len(dims):
                dims.add().dim_value = value
                return
            d = dims[axis]
            if isinstance(value, str):
                d.dim_param = value
            else:
                d.dim_value = value

        return edit

    for name, axis, value in [("past_key_values.0.key", 1, 3), ("past_key_values.0.key", 1, -16),
                              ("past_key_values.0.key", 1, 10**12), ("past_key_values.0.key", 2, 0),
                              ("past_key_values.0.key", 3, 15), ("past_key_values.0.key", 3, -1),
                              ("past_key_values.0.key", 4, 2), ("past_key_values.1.value", 1, 32),
                              ("past_key_values.0.key", 2, "kv_heads"), ("attention_metadata", 0, 5),
                              ("attention_metadata", 0, -3), ("block_table", 1, 0), ("input_ids", 0, 10**15),
                              ("logits", 1, 127)]:
        cases.append(model_case(f"dims-{name}-{axis}={value}", redim(name, axis, value)))

    # attributes of the first PagedAttention node
    for name, value in [("num_heads", 0), ("num_heads", -1), ("num_heads", 3), ("num_heads", 10**9),
                        ("num_heads", None), ("kv_num_heads", 0), ("kv_num_heads", 3), ("kv_num_heads", -2),
                        ("kv_num_heads", None), ("scale", float("nan")), ("scale", -1.0), ("do_rotary", 5),
                        ("local_window_size", -5), ("local_window_size", 10**12), ("softcap", -1.0),
                        ("num_heads", "four"), ("kv_num_heads", [2, 2]), ("rotary_interleaved", 7),
                        ("unknown_attribute", 1), ("k_cache_dtype", "int3"), ("kv_cache_layout", "WEIRD")]:
        cases.append(model_case(f"attr-{name}={value!r}", _set_attr(name, value)))

    def domain(value: str) -> Callable:
        def edit(m: onnx.ModelProto) -> None:
            _paged_nodes(m)[0].domain = value

        return edit

    cases += [model_case("domain-empty", domain("")), model_case("domain-evil", domain("evil.domain"))]

    def ir(value: int) -> Callable:
        def edit(m: onnx.ModelProto) -> None:
            m.ir_version = value

        return edit

    def no_opsets(m: onnx.ModelProto) -> None:
        del m.opset_import[:]

    def unknown_op(m: onnx.ModelProto) -> None:
        m.graph.node[1].op_type = "NoSuchOperator"

    def unknown_domain_op(m: onnx.ModelProto) -> None:
        m.graph.node[1].domain = "com.example"

    def init_dims(m: onnx.ModelProto) -> None:
        t = next(t for t in m.graph.initializer if t.name == "lm_head.weight")
        del t.dims[:]
        t.dims.extend([1000, 1000])

    def init_neg_dims(m: onnx.ModelProto) -> None:
        t = next(t for t in m.graph.initializer if t.name == "cos_cache")
        del t.dims[:]
        t.dims.extend([-128, 8])

    def init_type(value: int) -> Callable:
        def edit(m: onnx.ModelProto) -> None:
            next(t for t in m.graph.initializer if t.name == "layers.0.norm.weight").data_type = value

        return edit

    def duplicate_output(m: onnx.ModelProto) -> None:
        m.graph.node[2].output[0] = m.graph.node[0].output[0]

    def cycle(m: onnx.ModelProto) -> None:
        m.graph.node[0].input[1] = m.graph.node[2].output[0]

    def no_graph(m: onnx.ModelProto) -> None:
        m.ClearField("graph")

    def attention_metadata_initializer(m: onnx.ModelProto) -> None:
        m.graph.initializer.append(helper.make_tensor("attention_metadata", TensorProto.INT32, [3], [1, 1, 0]))

    cases += [model_case("ir-version-0", ir(0)), model_case("ir-version-huge", ir(10**6)),
              model_case("ir-version-negative", ir(-5)), model_case("no-opset-import", no_opsets),
              model_case("unknown-op", unknown_op), model_case("unknown-domain-op", unknown_domain_op),
              model_case("initializer-dims-mismatch", init_dims),
              model_case("initializer-negative-dims", init_neg_dims),
              model_case("initializer-type-undefined", init_type(TensorProto.UNDEFINED)),
              model_case("initializer-type-string", init_type(TensorProto.STRING)),
              model_case("initializer-type-999", init_type(999)),
              model_case("duplicate-output-name", duplicate_output), model_case("graph-cycle", cycle),
              model_case("no-graph", no_graph),
              model_case("attention-metadata-initializer", attention_metadata_initializer)]
    return cases


def _tokenizer_cases() -> list[Case]:
    def garbage(folder: Path, r: Root) -> None:
        (folder / "tokenizer.json").write_bytes(b"{not a tokenizer")

    def wrong(folder: Path, r: Root) -> None:
        (folder / "tokenizer.json").write_text(json.dumps({"model": {"type": "Nope"}}))

    def directory(folder: Path, r: Root) -> None:
        (folder / "tokenizer.json").mkdir()

    return [Case("tokenizer-garbage", garbage, prompt_text=True), Case("tokenizer-wrong", wrong, prompt_text=True),
            Case("tokenizer-directory", directory, prompt_text=True)]


def all_cases() -> list[Case]:
    rng = random.Random(20260901)
    cases = (_outside_cases() + _config_cases(rng, n_random=40) + _model_cases(rng, n_flip=20, n_trunc=10)
             + _tokenizer_cases())
    names = [c.name for c in cases]
    assert len(set(names)) == len(names), sorted(n for n in names if names.count(n) > 1)
    return cases


CASES = all_cases()


def test_enough_cases():
    assert len(CASES) >= 200, len(CASES)


# ---------------------------------------------------------------------------------------------------------
# the checks
# ---------------------------------------------------------------------------------------------------------
def _call(main, argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exc:  # argparse
            rc = exc.code
    return rc, out.getvalue(), err.getvalue()


def _one_line(text: str, prog: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one {prog} error line on stderr, got:\n{text}"
    assert "Traceback" not in text and lines[0].startswith(f"{prog}: "), text
    return lines[0]


def _build(root: Root, case: Case) -> Path:
    folder = root.cases / case.name.replace("/", "_")
    if folder.exists() or folder.is_symlink():
        shutil.rmtree(folder)
    shutil.copytree(EXAMPLE, folder)
    case.mutate(folder, root)
    return folder


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_untrusted_folder(root, case: Case):
    folder = _build(root, case)
    OPENED.clear()

    # paged-validate
    rc, out, err = _call(validate_main, [str(folder)])
    assert rc in (0, 1, 2), (rc, out, err)
    if rc == 2:
        _one_line(err, "paged-validate")
    if case.validate_refuses:
        assert rc in (1, 2), (out, err)
    assert not OPENED, f"paged-validate opened {OPENED}"

    # pagedkit.InferenceSession on the folder
    try:
        pagedkit.InferenceSession(str(folder))
        loaded = True
    except ERRORS as exc:
        loaded = False
        # a library error may list several problems on several lines (the CLIs join them into one)
        assert str(exc).strip(), f"{type(exc).__name__} without a message"
    assert not (case.session_refuses and loaded), "a folder naming a file outside itself was loaded"
    assert not OPENED, f"InferenceSession opened {OPENED}"

    # paged-run
    prompt = ["--prompt", "hello"] if case.prompt_text else ["--prompt-ids", "1,2"]
    rc, out, err = _call(run_main, [str(folder), *prompt, "--max-new-tokens", "2", "--ignore-eos"])
    assert rc in (0, 2), (rc, out, err)
    assert rc != EXIT_INTERNAL
    if rc == 2:
        _one_line(err, "paged-run")
    if case.refuse:
        assert rc == 2, (out, err)
    assert not OPENED, f"paged-run opened {OPENED}"


@pytest.mark.parametrize("n", [1, 9, 300])
def test_session_from_bad_bytes(n):
    """InferenceSession(bytes) of random or truncated bytes: a ModelLoadError (ValueError), not protobuf's
    DecodeError."""
    rng = random.Random(n)
    good = (EXAMPLE / "model.onnx").read_bytes()
    for data in (bytes(rng.getrandbits(8) for _ in range(n)), good[: len(good) * n // 301]):
        try:
            pagedkit.InferenceSession(data)
        except ValueError as exc:
            assert "not an ONNX model" in str(exc) or str(exc).strip()


def test_outside_refusals_name_the_field(root):
    """The refusal is one line naming the config file and the field (item 1's wording)."""
    case = next(c for c in CASES if c.name == "filename-dotdot-sentinel")
    folder = _build(root, case)
    for main, prog in ((validate_main, "paged-validate"), (run_main, "paged-run")):
        argv = [str(folder)] + (["--prompt-ids", "1"] if prog == "paged-run" else [])
        rc, out, err = _call(main, argv)
        line = _one_line(err, prog)
        assert rc == 2 and "genai_config.json: model.decoder.filename" in line and "outside the model folder" in line


def test_debug_env_reraises(root, monkeypatch):
    """PAGEDKIT_DEBUG=1: the CLIs re-raise (CI and bug reports see the traceback)."""
    folder = _build(root, next(c for c in CASES if c.name == "model-random-100-bytes"))
    monkeypatch.setenv("PAGEDKIT_DEBUG", "1")
    with pytest.raises(ValueError, match="model.onnx"):
        validate_main([str(folder)])


# ---------------------------------------------------------------------------------------------------------
# a few as the installed user runs them: subprocesses, with the audit hook installed by sitecustomize
# ---------------------------------------------------------------------------------------------------------
_SITE = """
import os, sys
_W = os.environ.get("PAGEDKIT_TEST_WATCH")
_BLOCK = set(filter(None, os.environ.get("PAGEDKIT_TEST_BLOCK", "").split(",")))
def _hook(event, args):
    if _W and event == "open" and args and not isinstance(args[0], int):
        try:
            real = os.path.realpath(os.fsdecode(args[0]))
        except Exception:
            return
        if real == _W or real.startswith(_W + os.sep):
            os.write(2, ("SENTINEL-OPENED " + real + "\\n").encode())
sys.addaudithook(_hook)
class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in _BLOCK:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _Blocker())
"""


def _subprocess(root: Root, module: str, argv: list[str], block: str = "") -> subprocess.CompletedProcess:
    site = root.cases.parent / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(textwrap.dedent(_SITE))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
               PAGEDKIT_TEST_WATCH=str(root.outside.resolve()), PAGEDKIT_TEST_BLOCK=block)
    env.pop("PAGEDKIT_DEBUG", None)
    return subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.mark.parametrize("case_name", ["filename-absolute-sentinel", "filename-etc-passwd", "model-random-100-bytes"])
def test_subprocess_validate_and_run(root, case_name):
    folder = _build(root, next(c for c in CASES if c.name == case_name))
    for module, prog, extra in (("pagedkit.validators.cli", "paged-validate", []),
                                ("pagedkit.apps.run.cli", "paged-run", ["--prompt-ids", "1,2"])):
        proc = _subprocess(root, module, [str(folder), *extra])
        assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
        line = _one_line(proc.stderr, prog)
        assert "SENTINEL" not in proc.stderr and ("outside the model folder" in line or "model.onnx" in line), line


def test_subprocess_export_without_extra(root, tmp_path):
    """paged-export without transformers (simulated): which extra to install, one line, status 2."""
    proc = _subprocess(root, "pagedkit.exporters.cli",
                       ["--model", "llama-3.1-8b", "--num-layers", "1", "--output", str(tmp_path / "out")],
                       block="transformers")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    line = _one_line(proc.stderr, "paged-export")
    assert 'pip install "pagedkit[export]"' in line and "transformers" in line


# ---------------------------------------------------------------------------------------------------------
# paged-export: exit statuses and the random-weights warning
# ---------------------------------------------------------------------------------------------------------
def test_export_bad_input_is_status_2(tmp_path):
    """Bad input is status 2 for paged-export too (as for paged-validate / paged-run), one line."""
    from pagedkit.exporters.cli import main as export_main

    rc, out, err = _call(export_main, ["--model", str(tmp_path / "no-such-checkpoint"),
                                       "--output", str(tmp_path / "o")])
    assert rc == 2, (rc, out, err)
    _one_line(err, "paged-export")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{not json")
    rc, out, err = _call(export_main, ["--model", str(tmp_path / "ckpt"), "--output", str(tmp_path / "o")])
    assert rc == 2, (rc, out, err)
    _one_line(err, "paged-export")
    with pytest.raises(SystemExit, match="share one dtype") as exc:  # conflicting flags: argparse's status
        export_main(["--model", "llama-3.1-8b", "--output", str(tmp_path / "o"), "--k-cache", "int8",
                     "--v-cache", "fp16"])
    assert exc.value.code == 2


def test_random_weights_warning_printed_once(root, tmp_path):
    """A config-only checkpoint exports random weights: the warning is printed once (the banner), not a
    second time by the warnings module."""
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=1, vocab_size=64).to_json_file(tmp_path / "config.json")
    code = f"from pagedkit.exporters.weights import load_model; load_model({str(tmp_path)!r}, num_layers=1)"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("RANDOM weights") == 1, proc.stderr
