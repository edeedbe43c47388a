"""The execution plan's decode step on CUDA is capture-safe: run under torch's sync-debug mode set to "error",
every op of a decode step of an exported model (embedding Gather, norms, MatMul / Gemm, activations, residual
adds, Casts of an fp32 export) runs without a host synchronization or a host read of a device value, and so do
the attention nodes on the Triton kernels (triton_paged). A teeth check: an op that reads a device value on
the host (a patched Sigmoid calling .item()) makes the same step fail.

Runs on the H200 (`pytest -m gpu`).
"""

from __future__ import annotations

import pytest
import torch

from export_utils import export_tiny, tiny_model

pytestmark = pytest.mark.gpu

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _decode_step_under_sync_debug(gen, prompt, relax_attention: bool = False):
    """Prefill normally, then one decode step with sync-debug 'error' around every op (relax_attention: not
    around the attention nodes)."""
    sess = gen.session
    ops = sess._main.ops
    for op in ops:
        if op.step.call is not None and relax_attention:
            inner = op.run

            def relaxed(ins, inner=inner):
                mode = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode(0)
                try:
                    return inner(ins)
                finally:
                    torch.cuda.set_sync_debug_mode(mode)

            op.run = relaxed
    it = gen.greedy(prompt, 2, stop_at_eos=False)
    first = next(it)  # prefill (sync-debug off: the prologue of the step reads lengths on the host)
    torch.cuda.synchronize()
    state = gen.state
    feed = [first.token]
    plan = state.mgr.plan([(state.seq, feed)])
    from pagedkit.interface import names as N

    feeds = {state.renames.get(k, k): v for k, v in plan.feeds(query_positions=True).items()}
    feeds = {k: v for k, v in feeds.items() if k in state.input_names}
    feeds |= state.mgr.cache_feeds()
    feeds[gen.config.input(N.INPUT_IDS)] = torch.tensor(feed, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sess.run_torch(feeds, [gen.logits_name])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    state.mgr.abort(plan)
    return out[gen.logits_name]


@cuda
@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_decode_step_has_no_host_sync_outside_attention(tmp_path, dtype):
    from pagedkit.runtime.generate import Generator

    hf = tiny_model("LlamaConfig")
    export_tiny(hf, tmp_path / "m", dtype=dtype)
    gen = Generator(tmp_path / "m", device="cuda", max_seq_len=64)
    logits = _decode_step_under_sync_debug(gen, [3, 9, 4, 17, 5])
    assert set(gen.session.last_run_variants.values()) == {"triton_paged"}  # the decode step's kernels
    assert logits.is_cuda and torch.isfinite(logits).all()


@cuda
def test_a_host_read_in_the_step_is_caught(tmp_path, monkeypatch):
    from pagedkit.runtime.generate import Generator
    from pagedkit.runtime.ops import OPS

    hf = tiny_model("LlamaConfig")
    export_tiny(hf, tmp_path / "m")
    # the MLP's activation, fused (into SiluMul) or not
    for key in (("", "Sigmoid"), ("pagedkit.fused", "SiluMul")):
        real = OPS[key]

        def syncing(inputs, attrs, ctx, real=real):
            float(inputs[0].sum().item())  # a host read of a device value
            return real(inputs, attrs, ctx)

        monkeypatch.setitem(OPS, key, syncing)
    gen = Generator(tmp_path / "m", device="cuda", max_seq_len=64)
    with pytest.raises(RuntimeError, match="synchroniz"):
        _decode_step_under_sync_debug(gen, [3, 9, 4, 17, 5], relax_attention=True)
