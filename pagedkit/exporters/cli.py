"""`paged-export`: Hugging Face checkpoint (local folder, GGUF file or built-in name) -> PagedAttention
ONNX model + genai_config.json, validated before success is declared.

    paged-export --model llama-3.1-8b --num-layers 2 --output /tmp/llama2l
    paged-export --model ./my-checkpoint --output out --kv-cache int8 --kv-quant PER_TOKEN
    paged-export --model ./my-checkpoint --output out32 --dtype fp32        # CPU: float32, fp16 caches

Exit status: 0 exported and validated, 1 the exported model failed the ONNX checker / pagedkit's validator,
2 bad arguments or input (missing / malformed checkpoint, unsupported model, the `export` extra not
installed), 3 an internal error; errors are one line on stderr (PAGEDKIT_DEBUG=1 re-raises them).
"""

from __future__ import annotations

import argparse
import functools
import sys
import warnings

from .. import settings
from ..cli_errors import EXIT_BAD_INPUT, EXIT_FAILED, cli_main, one_line
from ..validators.contract import CACHE_FORMATS

settings.stay_offline("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")  # never the network

CACHE_CHOICES = {"fp16": "float16", "bf16": "bfloat16", "int8": "int8", "fp8": "float8e4m3fn", "int4": "int4"}
QUANT_CHOICES = ("NONE", "PER_TENSOR", "PER_CHANNEL", "PER_TOKEN")


def build_parser() -> argparse.ArgumentParser:
    from .weights import builtin_names

    p = argparse.ArgumentParser(
        prog="paged-export",
        description="Export a Hugging Face causal LM to an ONNX graph with com.microsoft::PagedAttention "
                    "(onnxruntime-genai's paged layout). Never downloads: NAME_OR_PATH is a local checkpoint "
                    "folder (config.json + *.safetensors), a local .gguf file, or a built-in name "
                    f"({', '.join(builtin_names())}); without local weights it exports random weights and "
                    "says so.")
    p.add_argument("--model", "-m", help="local checkpoint folder, .gguf file, built-in name, or a model "
                                         "fetched by paged-fetch (smollm2-135m)")
    p.add_argument("--output", "-o", help="output folder (model.onnx, genai_config.json, tokenizer files)")
    p.add_argument("--dtype", choices=("fp16", "bf16", "fp32"), default="fp16",
                   help="activation / weight dtype (fp16). fp32: float32 everywhere except inside each "
                        "PagedAttention node (its T is fp16 / bf16 only): Casts around the node, fp16 caches by "
                        "default, float32 logits")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size written to the config: a power of two >= 16 (16)")
    p.add_argument("--kv-cache", choices=tuple(CACHE_CHOICES),
                   help="K and V cache dtype (default: --dtype; fp16 with --dtype fp32)")
    p.add_argument("--k-cache", choices=tuple(CACHE_CHOICES), help="K cache dtype (overrides --kv-cache)")
    p.add_argument("--v-cache", choices=tuple(CACHE_CHOICES), help="V cache dtype (overrides --kv-cache)")
    p.add_argument("--kv-quant", choices=QUANT_CHOICES, type=str.upper,
                   help="quantization granularity of quantized caches (PER_TOKEN when not given)")
    p.add_argument("--k-quant", choices=QUANT_CHOICES, type=str.upper, help="K granularity (overrides --kv-quant)")
    p.add_argument("--v-quant", choices=QUANT_CHOICES, type=str.upper, help="V granularity (overrides --kv-quant)")
    p.add_argument("--rotate-kv", action="store_true",
                   help="Walsh-Hadamard rotation of Q/K and V per head (qk_rotation / v_rotation)")
    p.add_argument("--weights", choices=("fp16", "int4"), default="fp16",
                   help="fp16: float weights of --dtype; int4: MatMul weights to MatMulNBits with onnxruntime's "
                        "quantizer (block 32, symmetric), the LM head included (a tied embedding then reads its "
                        "int4 weight through GatherBlockQuantized), as onnxruntime-genai's int4 models")
    p.add_argument("--int4-lm-head", action=argparse.BooleanOptionalAction, default=None,
                   help="with --weights int4: quantize the LM head (default) or keep it (and a tied embedding "
                        "table) float (--no-int4-lm-head)")
    p.add_argument("--int4-accuracy-level", type=int, choices=range(5), default=None, metavar="{0..4}",
                   help="with --weights int4: MatMulNBits accuracy_level (4, onnxruntime-genai's CPU default: "
                        "activations may be computed in lower precision; 0 = the activations' own type)")
    p.add_argument("--calibration", metavar="TEXT_FILE",
                   help="text for PER_TENSOR / PER_CHANNEL scale calibration (default: a text shipped with pagedkit)")
    p.add_argument("--calibration-percentile", type=float, default=100.0,
                   help="percentile of |x| taken as the calibrated maximum (100 = max-abs)")
    p.add_argument("--num-layers", type=int, help="keep only the first N decoder layers")
    p.add_argument("--num-experts", type=int, help="keep only N routed experts (MoE models; quick runs)")
    p.add_argument("--max-seq-len", type=int, help="context length (rotary table rows); default: the config's")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor parallelism: one graph per rank (OUTPUT/rank_<r>/model.onnx) and one genai_config.json "
                        "for the set, Megatron-style cut with com.microsoft AllReduce / AllGather "
                        "(docs/distributed.md); run it with paged-run / paged-serve / paged-bench --tp N")
    p.add_argument("--extra-inputs", default="",
                   help="comma list of optional pagedkit graph inputs: slot_mapping, query_positions")
    p.add_argument("--max-shard-size", metavar="SIZE",
                   help="split the external weight data into files of at most SIZE (e.g. 4GB, 500MB; default: "
                        "one model.onnx.data): model.onnx.data, model.onnx.data.1, ... (one location per tensor)")
    p.add_argument("--no-stream", dest="stream", action="store_false",
                   help="load a safetensors checkpoint whole with from_pretrained before exporting (default: read "
                        "tensor by tensor while the weights are written, peak memory about the largest tensor)")
    p.add_argument("--seed", type=int, default=0, help="seed of random weights (no local weights)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--via", choices=("genai",),
                   help="genai: run onnxruntime-genai's model builder on the local checkpoint folder, then rewrite "
                        "its GroupQueryAttention model to PagedAttention (architectures with no native family; "
                        "--list shows which)")
    p.add_argument("--list", action="store_true",
                   help="list every supported model_type with its route(s) and features, and the built-in names")
    return p


class UsageExit(SystemExit):
    """A bad combination of flags: exit status 2 (as argparse's errors), str() is the message."""

    def __init__(self, message: str):
        super().__init__(EXIT_BAD_INPUT)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _usage_error(message: str) -> UsageExit:
    print(f"paged-export: error: {message}", file=sys.stderr)
    return UsageExit(message)


def kv_options(args):
    """The KVOptions of the --k-* / --v-* / --kv-* flags."""
    from .families.base import KVOptions

    kv_default = args.kv_cache
    k = CACHE_CHOICES.get(args.k_cache or kv_default or "", "")
    v = CACHE_CHOICES.get(args.v_cache or kv_default or "", "")
    quantized = tuple(n for n, f in CACHE_FORMATS.items() if f.quantized)  # int8, float8e4m3fn, int4

    def quant(side_dtype: str, side_quant: str | None) -> str:
        q = side_quant or args.kv_quant
        if side_dtype in quantized:
            return q or "PER_TOKEN"
        if q not in (None, "NONE"):
            raise _usage_error(f"--*-quant {q} needs a quantized cache (--kv-cache int8|fp8|int4)")
        return "NONE"

    if k != v:
        raise _usage_error(f"K and V caches must share one dtype (the operator binds both to T_CACHE), "
                           f"got --k-cache {args.k_cache or kv_default} and --v-cache {args.v_cache or kv_default}")
    return KVOptions(k_dtype=k, v_dtype=v, k_quant=quant(k, args.k_quant), v_quant=quant(v, args.v_quant),
                     rotate=args.rotate_kv)


@cli_main("paged-export")  # errors: one stderr line; 2 bad input, 3 internal error (pagedkit/cli_errors.py)
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ..validators.contract import block_size_error

    if block_size_error(args.block_size):  # refused before any loading or writing
        print(f"paged-export: error: --block-size: {block_size_error(args.block_size)}", file=sys.stderr)
        return 2
    if args.list:
        from .docs import listing

        print(listing())
        return 0
    if not args.model or not args.output:
        build_parser().error("--model and --output are required")
    if args.tp < 1:
        build_parser().error(f"--tp: expected a number of ranks >= 1, got {args.tp}")
    if args.via and args.tp > 1:
        build_parser().error("--tp with --via genai: the tensor-parallel cut is built on pagedkit's own families")
    if args.via:
        from .via_genai import main_via_genai

        return main_via_genai(args, kv_options(args))
    from .export import ExportError, export
    from .families.base import ExportOptions
    from .quantize import INT4_ACCURACY_LEVEL
    from .weights import RandomWeightsWarning

    if args.max_shard_size is not None:
        from .external import parse_size

        try:
            parse_size(args.max_shard_size)
        except ValueError as exc:
            build_parser().error(f"--max-shard-size: {exc}")
    if args.weights != "int4" and (args.int4_lm_head is not None or args.int4_accuracy_level is not None):
        build_parser().error("--int4-lm-head / --no-int4-lm-head / --int4-accuracy-level need --weights int4")
    extras = {e.strip() for e in args.extra_inputs.split(",") if e.strip()}
    unknown = extras - {"slot_mapping", "query_positions"}
    if unknown:
        build_parser().error(f"--extra-inputs: unknown {sorted(unknown)}; expected slot_mapping, query_positions")
    opts = ExportOptions(dtype=args.dtype, block_size=args.block_size, max_seq_len=args.max_seq_len,
                         kv=kv_options(args), slot_mapping="slot_mapping" in extras,
                         query_positions="query_positions" in extras, progress=not args.quiet)
    try:
        with warnings.catch_warnings():  # the random-weights banner is printed already: not a second time
            warnings.simplefilter("ignore", RandomWeightsWarning)
            if args.tp > 1:  # tensor-parallel set (exporters/tp/)
                from .tp.export import export_tp as export
                export = functools.partial(export, tp=args.tp)
            result = export(args.model, args.output, opts, num_layers=args.num_layers, num_experts=args.num_experts,
                            seed=args.seed, weights=args.weights, calibration=args.calibration,
                            percentile=args.calibration_percentile,
                            int4_lm_head=args.int4_lm_head is not False,
                            max_shard_size=args.max_shard_size, stream=args.stream,
                            int4_accuracy_level=(INT4_ACCURACY_LEVEL if args.int4_accuracy_level is None
                                                 else args.int4_accuracy_level))
    except ExportError as exc:  # the export ran, its result failed the checker / validator
        print(f"paged-export: error: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_FAILED
    # any other error (bad checkpoint, unsupported model, missing extra): cli_main, status 2
    print(result.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
