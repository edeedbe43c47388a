"""End-to-end checks of the KV block manager through the PagedAttention reference kernel: ring-window,
prefix-cached, forked (copy-on-write) and speculative runs give the same attention outputs as plain
full-cache runs of the same tokens (design §9.3.5: bit-identical).

Each token's Q/K/V is a fixed random function of (token id, position), so two runs that see the same
tokens must produce the same outputs whatever blocks the manager chose.
"""

from __future__ import annotations

import pytest
import torch

from pagedkit.kernels.paged.reference import paged_attention
from pagedkit.runtime.kv.cache import KVCacheManager
from pagedkit.runtime.kv.config import GroupConfig, KVCacheConfig, LayerCacheSpec

H, HKV, D, BS, VOCAB, MAX_LEN = 4, 2, 16, 16, 11, 96


def tables(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {name: (torch.randn(VOCAB, MAX_LEN, width, generator=g) * 2).half()
            for name, width in (("query", H * D), ("key", HKV * D), ("value", HKV * D))}


class Runner:
    """Drives one manager (one attention layer, group `group`) through the reference kernel."""

    def __init__(self, *, window=None, ring=False, prefix=False, quant=False, explicit_slots=True,
                 num_blocks=48, chunk=16):
        layer = LayerCacheSpec(0, HKV, D, cache_dtype="int8" if quant else "float16",
                               key_scale_dtype="float16" if quant else None,
                               value_scale_dtype="float16" if quant else None)
        self.group = "win" if ring else "full"
        grp = GroupConfig(self.group, num_blocks, BS, (layer,), window=window if ring else None, chunk_tokens=chunk)
        self.m = KVCacheManager(KVCacheConfig((grp,), max_batch_size=4, max_num_tokens=128, max_seq_len=MAX_LEN,
                                              prefix_caching=prefix))
        self.window, self.quant, self.explicit = window, quant, explicit_slots
        self.emb = tables()
        self.tokens: dict[str, list[int]] = {}
        self.out: dict[tuple[str, int], torch.Tensor] = {}  # (seq, position) -> output row [H * D]

    def add(self, seq, prompt):
        self.tokens[seq] = list(prompt)
        return self.m.add_sequence(seq, list(prompt))

    def step(self, batch, commit=True):
        """batch = [(seq, new token ids)]; runs the kernel; records outputs per (seq, position)."""
        plan = self.m.plan([(s, ids) for s, ids in batch])
        rows = {k: [] for k in self.emb}
        for (s, ids), past in zip(batch, plan.past_lens):
            known = self.tokens[s]
            del known[past:]
            known += ids
            for j, t in enumerate(ids):
                for k in rows:
                    rows[k].append(self.emb[k][t, past + j])
        caches = self.m.caches[0]
        inputs = {k: torch.stack(v) for k, v in rows.items()} | {
            "key_cache": caches["key"], "value_cache": caches["value"],
            "cumulative_sequence_length": plan.cumulative_sequence_length, "past_seqlens": plan.past_seqlens,
            "block_table": plan.block_tables[self.group], "attention_metadata": plan.attention_metadata,
        }
        if self.explicit:
            inputs["slot_mapping"] = plan.slot_mappings[self.group]
        attrs = dict(num_heads=H, kv_num_heads=HKV)
        if self.window:
            attrs["local_window_size"] = self.window
        if self.quant:
            inputs |= {"k_scale_cache": caches["key_scale"], "v_scale_cache": caches["value_scale"]}
            attrs |= dict(k_quant_type="PER_TOKEN", v_quant_type="PER_TOKEN")
        outs = ["output", "key_cache_out", "value_cache_out"] + (["k_scale_cache_out", "v_scale_cache_out"] if self.quant else [])
        out = paged_attention(inputs, outputs=outs, **attrs)
        assert out["key_cache_out"] is caches["key"]  # updated in place
        t = 0
        for (s, ids), past in zip(batch, plan.past_lens):
            for j in range(len(ids)):
                self.out[(s, past + j)] = out["output"][t].float()
                t += 1
        if commit:
            self.m.commit(plan)
        return plan

    def prefill(self, seqs, hits=None):
        """Feed every remaining prompt token, chunked to what the ring admits."""
        hits = hits or {}
        pos = {s: hits.get(s, self.m.length(s)) for s in seqs}
        while any(pos[s] < len(self.tokens[s]) for s in seqs):
            batch = []
            for s in seqs:
                n = min(len(self.tokens[s]) - pos[s], self.m.max_step_tokens(s))
                if n > 0:
                    batch.append((s, self.tokens[s][pos[s] : pos[s] + n]))
                    pos[s] += n
            self.step(batch)


def assert_same(ref: Runner, run: Runner, keys):
    """Outputs agree exactly (norm-relative bound with tolerance 0): same tokens, same math."""
    assert keys
    for key in keys:
        a, b = ref.out[key], run.out[key]
        assert (a - b).abs().max() <= 0.0 * a.abs().max(), f"{key}: max diff {(a - b).abs().max()}"


def random_ids(gen, n):
    return torch.randint(0, VOCAB, (n,), generator=gen).tolist()


@pytest.mark.parametrize("window, quant, explicit", [
    (20, False, True),  # ring wraps many times: leading block_table entries -1, slots recycled
    (20, True, False),  # int8 PER_TOKEN caches, derived slots (no slot_mapping input)
    (96, False, True),  # W >= L: the ring never evicts and must equal full attention
])
def test_ring_window_matches_full_cache(window, quant, explicit):
    gen = torch.Generator().manual_seed(1)
    prompts = {"a": random_ids(gen, 5), "b": random_ids(gen, 37), "c": random_ids(gen, 50)}
    full = Runner(window=window if window < MAX_LEN else None, quant=quant, num_blocks=24)
    ring = Runner(window=window, ring=True, quant=quant, explicit_slots=explicit, num_blocks=24, chunk=16)
    for r in (full, ring):
        for s, p in prompts.items():
            r.add(s, p)
    ring.prefill(list(prompts))
    for s, p in prompts.items():  # the full-cache run follows the same step schedule
        full.tokens[s] = list(p)
    full.prefill(list(prompts))
    for step in range(30):
        batch = [(s, random_ids(gen, 1)) for s in prompts if step % 3 or s != "a"]  # mixed batches
        ring.step(batch)
        full.step(batch)
    assert_same(full, ring, list(full.out))
    n_ring = ring.m.config.group("win").ring_blocks
    for s in prompts:  # O(W) memory per sequence
        assert len(ring.m.seqs[s].groups["win"].held()) <= n_ring
    assert full.m.num_free_blocks("full") == 24 - sum(-(-len(t) // BS) for t in full.tokens.values())
    if window < MAX_LEN:
        row = ring.m.block_table_row("c", "win")
        assert row[:2] == [-1, -1] and row[-1] >= 0 and len(row) == -(-len(ring.tokens["c"]) // BS)


@pytest.mark.parametrize("quant", [False, True])
def test_prefix_cached_and_forked_runs_match_plain_runs(quant):
    gen = torch.Generator().manual_seed(2)
    shared = random_ids(gen, 35)
    a_prompt, b_prompt = shared + random_ids(gen, 5), shared + random_ids(gen, 10)
    cached = Runner(prefix=True, quant=quant)
    cached.add("a", a_prompt)
    cached.prefill(["a"])
    for _ in range(3):
        cached.step([("a", random_ids(gen, 1))])
    cached.m.free("a")  # its full blocks stay in the prefix cache
    hit = cached.add("b", b_prompt)
    assert hit == 32
    cached.prefill(["b"], hits={"b": hit})
    assert ("b", 31) not in cached.out  # the hit tokens were not recomputed
    cached.step([("b", random_ids(gen, 2))])  # position 47: block 2 is partly filled
    cached.m.fork("b", "c")  # c shares b's blocks, the partial one included
    cached.tokens["c"] = list(cached.tokens["b"])
    tail_b, tail_c = [random_ids(gen, 1) for _ in range(4)], [random_ids(gen, 1) for _ in range(4)]
    for tb, tc in zip(tail_b, tail_c):  # both write into the shared block first: copy on write
        cached.step([("b", tb), ("c", tc)])
    blocks_b, blocks_c = cached.m.block_table_row("b", "full"), cached.m.block_table_row("c", "full")
    assert blocks_b[:2] == blocks_c[:2] and blocks_b[2] != blocks_c[2]

    for seq in ("b", "c"):  # plain runs: one sequence, no sharing, every token computed
        plain = Runner(quant=quant)
        plain.add(seq, cached.tokens[seq][:45])
        plain.prefill([seq])
        for pos in range(45, len(cached.tokens[seq])):
            plain.step([(seq, [cached.tokens[seq][pos]])])
        assert_same(plain, cached, [k for k in cached.out if k[0] == seq])


@pytest.mark.parametrize("ring", [False, True])
def test_rejected_drafts_leave_no_trace(ring):
    gen = torch.Generator().manual_seed(3)
    prompt = random_ids(gen, 30)
    spec = Runner(window=12 if ring else None, ring=ring, chunk=8)
    spec.add("s", prompt)
    spec.prefill(["s"])
    for k, n_acc in ((3, 1), (4, 0), (2, 2), (5, 3)):
        nxt = random_ids(gen, 1 + k)  # the real next token + k drafts
        spec.m.speculate("s", k)
        spec.step([("s", nxt)])
        spec.m.accept("s", n_acc)
        del spec.tokens["s"][spec.m.length("s"):]
        for key in [key for key in spec.out if key[1] >= spec.m.length("s")]:
            del spec.out[key]  # outputs of rejected drafts are discarded
        spec.step([("s", random_ids(gen, 1))])
    plain = Runner(window=12 if ring else None)
    plain.add("s", prompt)
    plain.prefill(["s"])
    for pos in range(len(prompt), len(spec.tokens["s"])):
        plain.step([("s", [spec.tokens["s"][pos]])])
    assert len(spec.tokens["s"]) > len(prompt) + 8
    assert_same(plain, spec, list(spec.out))
