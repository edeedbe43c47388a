"""The one-launch cache write on the GPU under contention: thousands of tokens of one call sharing a few
slots (through slot_mapping and through aliased block-table blocks) run concurrently, and each slot must
hold exactly the bytes of its highest-index writer (the claim / done chain of cache_write.py); also inside a
CUDA graph replayed several times (the epoch advances on the device, nothing is cleared between calls).
The expectation is computed with plain torch indexing (no pagedkit code). Run on the device:
`pytest -m gpu tests/test_triton_write_gpu.py`."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

HKV, D, BS, NB = 2, 64, 16, 32


def _fmt():
    from pagedkit.kernels.triton.common import FMT_FLOAT, SCALE_NONE, SideFormat

    return SideFormat(FMT_FLOAT, SCALE_NONE)


def _write(q, k, v, kc, vc, csl, past, bt, slot_mapping=None):
    from pagedkit.kernels.triton.cache_write import write_kv

    return write_kv(q, k, v, num_heads=HKV, kv_num_heads=HKV, head_size=D, cumulative_sequence_length=csl,
                    past_seqlens=past, block_table=bt, key_cache=kc, value_cache=vc, k_format=_fmt(),
                    v_format=_fmt(), slot_mapping=slot_mapping)


def _expect_last(slots: torch.Tensor, rows: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """cache [NB, BS, Hkv, D] after writing rows [N, Hkv*D] at slots [N] in token order (the last wins)."""
    out = cache.clone().view(NB * BS, HKV * D)
    for t in range(slots.numel()):  # host loop: the oracle
        s = int(slots[t])
        if 0 <= s < NB * BS:
            out[s] = rows[t]
    return out.view_as(cache)


@pytest.mark.parametrize("n,distinct", [(8192, 5), (4096, 64), (257, 1)])
def test_slot_mapping_contention_last_writer_wins(n, distinct):
    g = torch.Generator().manual_seed(n + distinct)
    pool = torch.randperm(NB * BS, generator=g)[:distinct]
    slots = pool[torch.randint(0, distinct, (n,), generator=g)].to(torch.int32)
    slots[torch.randint(0, n, (n // 50,), generator=g)] = -1
    k = torch.randn(n, HKV * D, generator=g).half()
    v = torch.randn(n, HKV * D, generator=g).half()
    kc = torch.full((NB, BS, HKV, D), float("nan")).half()
    vc = kc.clone()
    want_k, want_v = _expect_last(slots, k, kc), _expect_last(slots, v, vc)
    csl = torch.tensor([0, n], dtype=torch.int32).cuda()
    past = torch.zeros(1, dtype=torch.int32).cuda()
    bt = torch.zeros((1, 1), dtype=torch.int32).cuda()
    for _ in range(3):  # repeated calls: stale claims of earlier epochs must gate nothing
        kc_d, vc_d = kc.cuda(), vc.cuda()
        _write(k.cuda(), k.cuda(), v.cuda(), kc_d, vc_d, csl, past, bt, slots.cuda())
        assert torch.equal(kc_d.cpu().view(torch.int16), want_k.view(torch.int16))
        assert torch.equal(vc_d.cpu().view(torch.int16), want_v.view(torch.int16))


def test_aliased_blocks_and_cuda_graph_replays():
    """Eight sequences of 512 new tokens whose block tables all name the same 4 blocks (offsets collide
    across and within sequences); captured once, replayed 4 times with fresh K/V: each replay's caches equal
    the last-writer expectation."""
    nseq, qlen = 8, 512
    n = nseq * qlen
    g = torch.Generator().manual_seed(9)
    cols = qlen // BS
    bt = torch.tensor([[b % 4 for b in range(cols)] for _ in range(nseq)], dtype=torch.int32)
    past = torch.zeros(nseq, dtype=torch.int32)
    csl = torch.arange(0, n + 1, qlen, dtype=torch.int32)
    pos = torch.arange(n) % qlen
    seq = torch.arange(n) // qlen
    slots = (bt[seq, pos // BS].long() * BS + pos % BS).to(torch.int32)
    static_k = torch.zeros(n, HKV * D, dtype=torch.half, device="cuda")
    static_v = torch.zeros_like(static_k)
    kc = torch.zeros((NB, BS, HKV, D), dtype=torch.half, device="cuda")
    vc = torch.zeros_like(kc)
    dev = [t.cuda() for t in (csl, past, bt)]
    _write(static_k, static_k, static_v, kc.clone(), vc.clone(), *dev)  # warm-up (creates the state)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _write(static_k, static_k, static_v, kc, vc, *dev)
    for r in range(4):
        k = torch.randn(n, HKV * D, generator=g).half()
        v = torch.randn(n, HKV * D, generator=g).half()
        static_k.copy_(k.cuda())
        static_v.copy_(v.cuda())
        kc.fill_(float("nan"))
        vc.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        base = torch.full((NB, BS, HKV, D), float("nan")).half()
        assert torch.equal(kc.cpu().view(torch.int16), _expect_last(slots, k, base).view(torch.int16)), r
        assert torch.equal(vc.cpu().view(torch.int16), _expect_last(slots, v, base).view(torch.int16)), r
