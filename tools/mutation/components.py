"""The components a mutation campaign samples, as data: the source files mutated, the pytest selection that
must kill their mutants (the component's own tests, run with -x), a per-mutant timeout and a time box.

`sources` and `tests` are globs relative to the repository root (a test glob that matches nothing is left
out, so a selection can name files that are still to come; a source glob must match); pytest options in a
selection pass through ("-k", "not long_contexts": the slowest parametrizations left out of a mutant's run). `tests_by_source`
narrows the selection for some source files (first matching glob wins): the Triton kernels run in Triton's
interpreter on the CPU, where each kernel's own test file is what covers it. `exclude` drops source files
(or `path::function` names) whose code the CPU selection cannot reach, each with the reason (reported).
`timeout` is the default per-mutant limit in seconds (a mutant that runs longer is a timeout: counted as
killed, reported apart); `budget` the campaign's time box in seconds at --jobs 2 (no new mutant starts once it
is spent; the report says how many ran). Measured seconds per mutant (2 jobs, 2 cores) are in docs/testing.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Component:
    sources: tuple[str, ...]
    tests: tuple[str, ...]
    timeout: float
    budget: float
    tests_by_source: tuple[tuple[str, tuple[str, ...]], ...] = ()
    exclude: tuple[tuple[str, str], ...] = ()  # (glob or path::function, why)
    kernel_list: bool = False  # also the hand-written Triton mutation list (tools/mutation/kernels.py)
    notes: str = ""
    extra: dict = field(default_factory=dict)


COMPONENTS: dict[str, Component] = {
    "engine": Component(
        sources=("pagedkit/engine/*.py",),
        tests=("tests/test_engine_units.py", "tests/test_logit_rows.py", "tests/test_engine.py",
               "tests/test_engine_spec.py", "tests/test_engine_overlap.py", "tests/test_engine_genai.py",
               "tests/test_engine_windowed.py", "tests/test_engine_stress.py",
               "tests/test_engine_graphs.py", "tests/test_engine_pool.py", "tests/test_sampling*.py",
               "tests/test_engine_*oracle*.py", "tests/test_stop*.py", "tests/test_engine_logits.py",
               "tests/test_engine_group.py", "tests/test_engine_constraint.py", "tests/test_prefill_graphs.py"),
        timeout=120, budget=3600,
        notes="the continuous-batching Engine, sampling, speculative decoding, the genai-style wrapper"),
    "serve": Component(
        sources=("pagedkit/apps/serve/*.py",),
        tests=("tests/test_serve_units.py", "tests/test_serve.py", "tests/test_serve_engine.py",
               "tests/test_serve_helpers.py", "tests/test_example_serve.py", "tests/test_serve_*.py"),
        timeout=150, budget=3600,
        notes="paged-serve, the OpenAI-compatible server (the -m gpu serve test is not in the CPU selection)"),
    "kv": Component(
        sources=("pagedkit/runtime/kv/*.py",),
        tests=("tests/test_kv_edges.py", "tests/test_kv_cache.py", "tests/test_kv_cache_attention.py",
               "tests/test_kv_cache_props.py", "tests/test_block_size_rule.py", "tests/test_engine_pool.py",
               "tests/test_kv_*.py", "tests/test_prefill_graphs.py"),
        timeout=120, budget=3600,
        notes="the KV block manager (runtime/kv: config, pool, blocks, plan, staging, cache)"),
    "parity": Component(
        sources=("pagedkit/runtime/parity.py",),
        tests=("tests/test_parity_near_ties.py", "tests/test_parity*.py", "tests/test_cli_run.py",
               "tests/test_fetch.py"),
        timeout=90, budget=2400,
        notes="the parity checker (paged-run --parity): pagedkit's logits against Hugging Face eager"),
    "delegate": Component(
        sources=("pagedkit/runtime/delegate.py", "pagedkit/runtime/segment.py"),
        tests=("tests/test_delegate_units.py", "tests/test_delegate.py", "tests/test_cpu_attention.py"),
        timeout=120, budget=3600,
        notes="the onnxruntime CPU delegate (plan option: segments run by onnxruntime's CPU provider) and its "
              "Segment (one onnxruntime session, caches in place, the pagedkit.cpu attention node)"),
    "rewriters": Component(
        sources=("pagedkit/rewriters/*.py", "pagedkit/rewriters/node_rules/*.py"),
        tests=("tests/test_rewrite_nodes.py", "tests/test_decompose.py", "tests/test_paged_vs_gqa.py",
               "tests/test_rewrite_genai.py", "tests/test_rewrite_*.py"),
        timeout=180, budget=5400,
        notes="paged-rewrite: GQA <-> PagedAttention, PagedAttention decomposed into standard ONNX ops"),
    "exporters": Component(
        sources=("pagedkit/exporters/*.py", "pagedkit/exporters/families/*.py"),
        tests=("tests/test_export_units.py", "tests/test_export_units_quant.py",  # fast unit tests first (-x)
               "tests/test_export_llama.py", "tests/test_export_cli.py", "tests/test_export_builtin.py",
               "tests/test_export_checkpoint_forms.py", "tests/test_export_lazy.py", "tests/test_export_int4.py",
               "tests/test_export_kvquant.py", "tests/test_export_rope_scaling.py", "tests/test_export_fp32.py",
               "tests/test_export_int4_moe.py", "tests/test_export_qwen3_moe.py", "tests/test_export_gemma3.py",
               "tests/test_export_deepseek.py", "tests/test_export_gpt_oss.py"),
        tests_by_source=(
            ("pagedkit/exporters/families/base.py", ("tests/test_export_llama.py", "tests/test_export_fp32.py",
                                                     "tests/test_export_checkpoint_forms.py",
                                                     "tests/test_export_qwen3_moe.py", "tests/test_export_gemma3.py",
                                                     "tests/test_export_deepseek.py", "tests/test_export_gpt_oss.py")),
            ("pagedkit/exporters/families/*.py", ("tests/test_export_{stem}.py", "tests/test_export_fp32.py")),
            ("pagedkit/exporters/fetch.py", ("tests/test_fetch.py",)),
            ("pagedkit/exporters/*genai*.py", ("tests/test_export_via_genai.py",)),
            ("pagedkit/exporters/docs.py", ("tests/test_export_via_genai.py", "tests/test_export_cli.py")),
        ),
        timeout=300, budget=7200,
        notes="paged-export: HF checkpoint -> PagedAttention ONNX (the common path, quantization, RoPE, MoE, "
              "fetch, --via genai); a family module runs its own test file and the fp32 export of every family"),
    "kernels": Component(
        sources=("pagedkit/kernels/triton/*.py",),
        tests=("tests/test_triton_paged.py", "tests/test_triton_decode.py", "tests/test_int8_mma.py", "-k",
               "not query_chunk_lanes[40"),
        tests_by_source=(
            ("pagedkit/kernels/triton/argmax.py", ("tests/test_triton_argmax.py",)),
            ("pagedkit/kernels/triton/swiglu.py", ("tests/test_triton_swiglu.py",)),
            ("pagedkit/kernels/triton/norm.py", ("tests/test_triton_norm.py",)),
            ("pagedkit/kernels/triton/sdpa_prefill.py", ("tests/test_sdpa_prefill.py",)),
            ("pagedkit/kernels/triton/gqa*.py",
             ("tests/test_triton_gqa.py", "-k", "not long_contexts and not long_padded_first_prompt")),
            ("pagedkit/kernels/triton/*mla*.py", ("tests/test_triton_mla.py",)),
            ("pagedkit/kernels/triton/cache_write.py",
             ("tests/test_triton_cache_write.py", "tests/test_distinct_slots.py", "tests/test_window_edges.py",
              "-k", "not engine_tokens_through and not unfused_launches[16")),
            ("pagedkit/kernels/triton/_rope_quant.py", ("tests/test_triton_cache_write.py",)),
            ("pagedkit/kernels/triton/common.py", ("tests/test_pdl.py", "tests/test_triton_decode.py",
                                                   "-k", "not query_chunk_lanes[40")),
        ),
        timeout=300, budget=7200, kernel_list=True,
        notes="the Triton kernels, run in Triton's interpreter (TRITON_INTERPRET=1): cosmic-ray's operators "
              "reach the @triton.jit bodies too (they mutate source text), plus the hand-written kernel list; "
              "the slowest interpreter parametrizations (long contexts, 16 splits, the engine run) are left "
              "out of a mutant's selection"),
}
