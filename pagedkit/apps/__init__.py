"""pagedkit's applications, the top layer (above pagedkit.engine and pagedkit.runtime): one folder each.

    serve/   paged-serve: an OpenAI-compatible HTTP endpoint over the engine (docs/serve.md)
    bench/   paged-bench: the engine's decode tokens/s and time to first token against onnxruntime and the
             bandwidth floor (docs/bench.md)
    run/     paged-run: greedy generation over a model folder on the runtime, parity with Hugging Face
             (docs/runtime.md)

The CLIs of the lower layers stay in their layers (paged-validate in validators/, paged-export and paged-fetch
in exporters/, paged-rewrite in rewriters/).
"""
