"""MLA through PagedAttention's LATENT layout (design §12, §17.3), at small DeepSeek-like dims:
kv_lora_rank 64, rope 16, nope 32, v 32, 4 heads -> absorbed head_size 80, v_head_size 64.
"""

import math

import pytest
import torch

from paged_oracle import Spec, build, clone_inputs, oracle, rel_err, rope64
from pagedkit.kernels import paged_attention
from pagedkit.validators import ValidationError

HQ, RANK, ROPE, NOPE, DV, BS = 4, 64, 16, 32, 32, 16
HEAD = RANK + ROPE  # absorbed query / latent row width
SCALE = 1.0 / math.sqrt(NOPE + ROPE)  # the pre-absorption head width, never 1/sqrt(HEAD)


class MLAProblem:
    """Two steps over two sequences: a prefill (5 and 9 tokens), then 1 and 2 more tokens."""

    steps = [([5, 9], [0, 0]), ([1, 2], [5, 9])]

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
        self.w_uk = r(HQ, NOPE, RANK) / math.sqrt(RANK)  # k_nope_h = W_UK[h] @ c
        self.w_uv = r(HQ, DV, RANK) / math.sqrt(RANK)  # v_h = W_UV[h] @ c
        self.tokens = []  # per step: c [n, RANK], k_pe [n, ROPE], q_nope [n, HQ, NOPE], q_pe [n, HQ, ROPE]
        for q_lens, _ in self.steps:
            n = sum(q_lens)
            self.tokens.append(tuple(t.half().double() for t in (r(n, RANK), r(n, ROPE), r(n, HQ, NOPE),
                                                                   r(n, HQ, ROPE))))
        pos = torch.arange(64, dtype=torch.float64)[:, None]
        theta = pos / 10000 ** (torch.arange(ROPE // 2, dtype=torch.float64) / (ROPE // 2))
        self.cos, self.sin = theta.cos().half(), theta.sin().half()
        self.nb = 7
        self.table = torch.tensor([[5, 2], [0, 6]], dtype=torch.int32)  # shuffled physical blocks
        self.cache0 = r(self.nb, BS, 1, HEAD).half()  # garbage everywhere

    def positions(self, step):
        q_lens, past = self.steps[step]
        return torch.cat([torch.arange(p, p + n) for p, n in zip(past, q_lens)])

    def absorbed_inputs(self, step, cache, pre_rotated=False):
        c, k_pe, q_nope, q_pe = self.tokens[step]
        q_abs = torch.einsum("hdr,nhd->nhr", self.w_uk, q_nope)  # W_UK^T q_nope: [n, HQ, RANK]
        query = torch.cat((q_abs, q_pe), dim=-1).half()  # [n, HQ, HEAD]
        key = torch.cat((c, k_pe), dim=-1).half()[:, None, :]  # [n, 1, HEAD]
        if pre_rotated:  # RoPE applied "in the graph" (float32, then T), op runs with do_rotary=0
            pos = self.positions(step)
            cos, sin = self.cos.float(), self.sin.float()
            query = rope64(query.float(), pos, cos, sin, False, RANK).half()
            key = rope64(key.float(), pos, cos, sin, False, RANK).half()
        q_lens, past = self.steps[step]
        x = dict(query=query.reshape(-1, HQ * HEAD), key=key.reshape(-1, HEAD), key_cache=cache,
                 cumulative_sequence_length=torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32),
                 past_seqlens=torch.tensor(past, dtype=torch.int32), block_table=self.table)
        if not pre_rotated:
            x.update(cos_cache=self.cos, sin_cache=self.sin)
        return x

    def attrs(self, rotary=True, **kw):
        a = dict(num_heads=HQ, kv_num_heads=1, kv_cache_layout="LATENT", v_head_size=RANK, scale=SCALE)
        if rotary:
            a.update(do_rotary=1, rotary_offset=RANK)
        return a | kw

    def non_absorbed(self, step):
        """Per-head MHA over decompressed K = [W_UK c, rope(k_pe)], V = W_UV c (head 48, v 32, 4 kv heads)."""
        out = []
        for b in range(2):
            ks, vs, qs = [], [], []
            for s in range(step + 1):
                c, k_pe, q_nope, q_pe = self.tokens[s]
                q_lens, past = self.steps[s]
                t0 = sum(q_lens[:b])
                sl = slice(t0, t0 + q_lens[b])
                pos = self.positions(s)[sl]
                cos, sin = self.cos.double(), self.sin.double()
                k_rot = rope64(k_pe[sl][:, None, :], pos, cos, sin, False, 0)[:, 0]
                k_rot = k_rot.half().double()  # the cache holds the rotated row in fp16
                ks.append(torch.cat((torch.einsum("hdr,nr->nhd", self.w_uk, c[sl]),
                                     k_rot[:, None, :].expand(-1, HQ, -1)), dim=-1))
                vs.append(torch.einsum("hvr,nr->nhv", self.w_uv, c[sl]))
                if s == step:
                    qs = torch.cat((q_nope[sl], rope64(q_pe[sl], pos, cos, sin, False, 0)), dim=-1)
            k, v = torch.cat(ks), torch.cat(vs)  # [L, HQ, 48], [L, HQ, 32]
            n, length = qs.shape[0], k.shape[0]
            mask = torch.ones(n, length, dtype=torch.bool).tril(length - n)
            o = torch.nn.functional.scaled_dot_product_attention(
                qs.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=SCALE)
            out.append(o.transpose(0, 1).reshape(n, HQ * DV))
        return torch.cat(out)

    def up_project(self, latent_out):
        """Absorbed output [n, HQ * RANK] -> W_UV per head -> [n, HQ * DV]."""
        o = latent_out.double().reshape(-1, HQ, RANK)
        return torch.einsum("hvr,nhr->nhv", self.w_uv, o).reshape(-1, HQ * DV)


def test_absorbed_equals_non_absorbed():
    prob = MLAProblem(seed=0)
    cache = prob.cache0.clone()
    for step in range(2):
        res = paged_attention(prob.absorbed_inputs(step, cache), **prob.attrs())
        assert res["output"].shape == (sum(prob.steps[step][0]), HQ * RANK)
        assert "value_cache_out" not in res and res["key_cache_out"] is cache
        got, want = prob.up_project(res["output"]), prob.non_absorbed(step)
        err = rel_err(got, want)
        assert err <= 5e-3, f"step {step}: absorbed vs non-absorbed rel err {err:.3g}"


def test_in_op_rotary_offset_equals_graph_applied_rope():
    prob = MLAProblem(seed=1)
    cache_op, cache_graph = prob.cache0.clone(), prob.cache0.clone()
    for step in range(2):
        a = paged_attention(prob.absorbed_inputs(step, cache_op), **prob.attrs(rotary=True))
        b = paged_attention(prob.absorbed_inputs(step, cache_graph, pre_rotated=True), **prob.attrs(rotary=False))
        assert torch.equal(a["output"], b["output"]), f"step {step}"
        assert torch.equal(cache_op, cache_graph)


def test_v_aliases_leading_channels_of_key_cache():
    """Changing channels >= v_head_size of V's source changes only the scores, and the V read is exactly
    the leading RANK channels: with uniform attention (all-equal scores) the output is their mean."""
    prob = MLAProblem(seed=2)
    x = prob.absorbed_inputs(0, prob.cache0.clone())
    x["query"] = torch.zeros_like(x["query"])  # all scores 0 -> uniform over the admitted prefix
    res = paged_attention(x, **prob.attrs())
    rows = x["key_cache"][5, :5, 0, :RANK].double()  # sequence 0's cached latent rows
    want = torch.stack([rows[: i + 1].mean(0) for i in range(5)])
    got = res["output"][:5].double().reshape(5, HQ, RANK)
    assert rel_err(got, want[:, None, :].expand(-1, HQ, -1)) <= 1e-3


def test_missing_scale_is_rejected():
    prob = MLAProblem(seed=3)
    attrs = prob.attrs()
    del attrs["scale"]
    with pytest.raises(ValidationError, match=r"scale") as err:
        paged_attention(prob.absorbed_inputs(0, prob.cache0.clone()), **attrs)
    assert any(i.where == "attribute 'scale'" for i in err.value.issues)


@pytest.mark.parametrize("extra,name", [
    ({"head_sink": torch.zeros(HQ).half()}, "head_sink"),
    ({"q_norm_weight": torch.ones(HEAD).half(), "k_norm_weight": torch.ones(HEAD).half()}, "q_norm_weight"),
    ({"value_cache": torch.zeros(7, BS, 1, HEAD).half()}, "value_cache"),
])
def test_latent_rejections_name_the_input(extra, name):
    prob = MLAProblem(seed=4)
    x = prob.absorbed_inputs(0, prob.cache0.clone()) | extra
    with pytest.raises(ValidationError, match=rf"'{name}' must be absent when kv_cache_layout is LATENT"):
        paged_attention(x, **prob.attrs())


def test_latent_value_cache_same_tensor_as_key_cache_is_rejected():
    prob = MLAProblem(seed=5)
    x = prob.absorbed_inputs(0, prob.cache0.clone())
    x["value_cache"] = x["key_cache"]
    with pytest.raises(ValidationError, match="value_cache"):
        paged_attention(x, **prob.attrs())


def test_mla_shuffled_blocks_minus_one_slots_fp8_latent_cache():
    """LATENT x shuffled blocks x slot -1 x fp8 PER_CHANNEL latent cache, against the float64 oracle: the
    skipped tokens' rows are pre-populated and are read back as they are."""
    spec = Spec(q_lens=[3, 0, 5, 1], past=[10, 4, 0, 20], num_heads=HQ, kv_num_heads=1, head_size=HEAD,
                latent=True, v_head_size=RANK, cache="float8e4m3fn", k_quant="PER_CHANNEL", rotary="half",
                rotary_offset=RANK, rotary_dim=ROPE, attrs={"scale": SCALE, "qk_output": 2}, seed=6)
    case = build(spec)
    exp = oracle(case)  # expects every new token written at its derived slot
    pre = clone_inputs(case.inputs)
    paged_attention(pre, **case.attrs)  # pre-populate: the same tokens written once, normally
    x = clone_inputs(pre)
    x["key_cache"] = pre["key_cache"].clone()
    table, csl = x["block_table"], x["cumulative_sequence_length"].tolist()
    slots = []
    for b, p0 in enumerate(spec.past):
        for j in range(csl[b + 1] - csl[b]):
            p = p0 + j
            slots.append(int(table[b, p // BS]) * BS + p % BS)
    skipped = [0, 3, 4, 8]
    for t in skipped:
        slots[t] = -1
    x["slot_mapping"] = torch.tensor(slots, dtype=torch.int32)
    before = x["key_cache"].clone()
    res = paged_attention(x, **case.attrs)
    assert torch.equal(res["key_cache_out"].view(torch.uint8), before.view(torch.uint8))  # rewritten identically
    assert rel_err(res["output"], exp["output"]) <= 2e-3
    assert rel_err(res["output_qk"], exp["output_qk"]) <= 2e-3
    # and with the skipped rows poisoned, the skipped tokens read the poison (the write really was skipped)
    poisoned = clone_inputs(x)
    poisoned["key_cache"] = before.clone()
    for t in skipped:
        b = max(i for i in range(4) if csl[i] <= t and csl[i + 1] > t)
        p = spec.past[b] + t - csl[b]
        poisoned["key_cache"][int(table[b, p // BS]), p % BS] = torch.full((1, HEAD), 8.0).to(torch.float8_e4m3fn)
    res2 = paged_attention(poisoned, **case.attrs)
    assert not torch.equal(res2["output"], res["output"])
    for t in skipped:
        b = max(i for i in range(4) if csl[i] <= t < csl[i + 1])
        p = spec.past[b] + t - csl[b]
        assert float(res2["key_cache_out"][int(table[b, p // BS]), p % BS].float().min()) == 8.0
