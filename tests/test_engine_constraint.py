"""Token constraints in the engine (SamplingParams.constraint, engine/constraint.py): the mask is applied to the
logits before the choice, greedy and sampled, with speculative drafts and overlapped decode, and with no host
read of the logits beyond what an unconstrained step makes.

The constraints here are plain Python (`Walk`: the allowed ids after each prefix drawn at random from the prefix,
packed into the bitmask with numpy here), so the oracles share nothing with the engine's unpacking: the greedy
choice is numpy's argmax over the allowed ids of the scripted logits, the sampled distribution numpy's softmax over
them. Teeth (in the tests): the mask not applied, speculative rows masked with the state before the drafts, drafts
not rolled back, overlapped decode taking constrained requests, an extra host read in the masking.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedkit.engine import Engine, SamplingParams
from pagedkit.engine import constraint as C
from pagedkit.engine import overlap as overlap_mod
from scripted_engine import TINY_PAGED, VOCAB, ScriptedModel, drive, scripted_engine
from test_engine import assert_pool_free, check_stream

EOS = 2


def pack(ids, vocab=VOCAB) -> torch.Tensor:
    """The packed int32 bitmask allowing `ids` (numpy: bit t % 32 of word t // 32)."""
    words = np.zeros((vocab + 31) // 32, dtype=np.uint32)
    for t in ids:
        words[t // 32] |= np.uint32(1 << (t % 32))
    return torch.from_numpy(words.view(np.int32).copy())


def allowed_after(prefix, size=12) -> list[int]:
    """A random set of allowed ids after `prefix` (a function of it: the same state gives the same set)."""
    rng = np.random.default_rng(abs(hash(tuple(prefix))) % 2 ** 32)
    return sorted(rng.choice(np.arange(3, VOCAB), size=size, replace=False).tolist())


class Walk:
    """A constraint over token ids: `length` tokens from allowed_after(accepted), then complete (eos allowed
    too once complete). accept() of a token outside the set raises (the engine then aborts the request)."""

    def __init__(self, length: int = 6, log: list | None = None):
        self.length, self.accepted, self.masks = length, [], 0
        self.log = log if log is not None else []

    def allowed(self) -> list[int]:
        return [EOS] if len(self.accepted) >= self.length else allowed_after(self.accepted)

    def mask(self) -> torch.Tensor:
        self.masks += 1
        return pack(self.allowed())

    def accept(self, token: int) -> bool:
        if token not in self.allowed():
            raise ValueError(f"token {token} is not allowed after {self.accepted}")
        self.accepted.append(token)
        self.log.append(("accept", token))
        return len(self.accepted) > self.length or token == EOS

    def rollback(self, n: int) -> None:
        del self.accepted[len(self.accepted) - n:]
        self.log.append(("rollback", n))


def scripted_logits(req, context) -> torch.Tensor:
    rng = np.random.default_rng(abs(hash(tuple(context))) % 2 ** 32)
    return torch.from_numpy(rng.normal(0, 3, VOCAB).astype(np.float32))


def greedy_oracle(prompt, length) -> list[int]:
    ctx, out = list(prompt), []
    while True:
        ok = [EOS] if len(out) >= length else allowed_after(out)
        logits = scripted_logits(None, ctx).numpy()
        t = ok[int(np.argmax(logits[ok]))]
        out.append(t)
        ctx.append(t)
        if t == EOS or len(out) > length:
            return out


# -- the masking itself ----------------------------------------------------------------------------------------

def test_apply_sets_exactly_the_disallowed_logits_to_minus_inf():
    rng = np.random.default_rng(0)
    for vocab in (128, 100, 33):
        logits = torch.from_numpy(rng.normal(size=(5, vocab)).astype(np.float32))
        sets = {0: [0, 31, 32, vocab - 1], 3: rng.choice(vocab, 17, replace=False).tolist(), 4: list(range(vocab))}
        out = C.apply(logits, {r: pack(s, vocab) for r, s in sets.items()}).numpy()
        want = logits.numpy().copy()
        for r, s in sets.items():
            drop = np.setdiff1d(np.arange(vocab), s)
            want[r, drop] = -np.inf
        np.testing.assert_array_equal(out, want)
    assert C.apply(logits, {}) is logits


# -- greedy and sampled choices ----------------------------------------------------------------------------------

def test_greedy_choice_is_the_argmax_over_the_allowed_tokens(monkeypatch):
    def run():
        eng = scripted_engine()
        ScriptedModel(eng, scripted_logits)
        prompts = [[5 + i, 9, 40 + i] for i in range(6)]
        ids = [eng.add_request(p, SamplingParams(max_new_tokens=20, constraint=lambda: Walk(6))) for p in prompts]
        outs = drive(eng)
        assert_pool_free(eng)
        return [(outs[i][-1].finish_reason, check_stream(outs[i])) for i in ids], prompts

    got, prompts = run()
    for (reason, toks), p in zip(got, prompts):
        assert reason == "stop" and toks == greedy_oracle(p, 6)
    monkeypatch.setattr(C, "apply", lambda logits, masks: logits)  # teeth: the mask is not applied
    got, _ = run()
    assert any(reason == "abort" for reason, _ in got)  # the constraint refused the unmasked choice


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 0, 0.9), (1.3, 5, 1.0)])
def test_sampled_distribution_is_the_softmax_over_the_allowed_tokens(temperature, top_k, top_p):
    """600 seeded one-token draws: none outside the allowed set, frequencies within 4.5 sigma of numpy's
    masked softmax (temperature, then top-k and top-p over the allowed tokens). Most of the logits' mass is
    outside the allowed set, so sampling before masking, or top-p computed without the mask, is far off."""
    base = np.random.default_rng(7).normal(0, 1.5, VOCAB).astype(np.float32)
    ok = [4, 9, 17, 30, 44, 51, 63, 80]
    base[[t for t in range(VOCAB) if t not in ok][:20]] += 6  # the disallowed favourites
    eng = scripted_engine(max_batch_size=64, max_num_tokens=512)
    ScriptedModel(eng, lambda req, ctx: torch.from_numpy(base))

    class Fixed(Walk):
        def allowed(self):
            return ok if not self.accepted else [EOS]

    n = 600
    ids = [eng.add_request([3, 4], SamplingParams(max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p,
                                                 seed=s, constraint=lambda: Fixed(1))) for s in range(n)]
    outs = drive(eng)
    draws = [outs[i][-1].token_ids[0] for i in ids]
    assert set(draws) <= set(ok)
    x = base[ok].astype(np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros(len(ok), bool)
    keep[order[:top_k or len(ok)]] = True
    p = np.where(keep, p, 0)
    p /= p.sum()
    before = np.cumsum(p[order]) - p[order]
    p[order[before >= top_p]] = 0
    p /= p.sum()
    counts = np.array([draws.count(t) for t in ok])
    sigma = np.sqrt(n * p * (1 - p)) + 1
    assert np.all(np.abs(counts - n * p) <= 4.5 * sigma), (counts, n * p)


# -- speculative drafts -----------------------------------------------------------------------------------------

def _spec_run(drafts_of=None, length=10, n_req=3):
    """Real tiny-paged weights; drafter: the plain run's next tokens with every third one wrong."""
    eng = Engine(TINY_PAGED, max_batch_size=4, max_num_tokens=128)
    logs = [[] for _ in range(n_req)]
    prompts = [[5, 9, 11 + i, 40] for i in range(n_req)]
    ids = []
    for i, p in enumerate(prompts):
        sp = SamplingParams(max_new_tokens=30, num_draft_tokens=3 if drafts_of else 0,
                            constraint=lambda log=logs[i]: Walk(length, log))
        drafter = (lambda toks, i=i: drafts_of(i, toks)) if drafts_of else None
        ids.append(eng.add_request(p, sp, drafter=drafter))
    outs = drive(eng)
    assert_pool_free(eng)
    return [check_stream(outs[r]) for r in ids], [outs[r][-1].finish_reason for r in ids], logs, eng, prompts


def test_speculative_drafts_give_the_plain_constrained_output(monkeypatch):
    plain, reasons, _, _, prompts = _spec_run()
    assert reasons == ["stop"] * 3
    for toks in plain:
        w = Walk(10)
        for t in toks:
            w.accept(t)  # every token allowed (raises otherwise)

    def drafts_of(i, toks):
        done = len(toks) - len(prompts[i])
        ahead = list(plain[i][done:done + 3])
        if done % 3 == 1 and ahead:
            ahead[-1] = 3 + (ahead[-1] + 1) % (VOCAB - 3)  # a wrong draft, often one the grammar refuses too
        return ahead

    spec, reasons, logs, eng, _ = _spec_run(drafts_of)
    assert spec == plain and reasons == ["stop"] * 3
    assert eng.stats.accepted_draft_tokens >= 10 and eng.stats.draft_tokens > eng.stats.accepted_draft_tokens
    for log, toks in zip(logs, spec):  # what the constraint kept is exactly the output
        state = []
        for kind, v in log:
            if kind == "accept":
                state.append(v)
            else:
                del state[len(state) - v:]
        assert state == toks

    real_walk = C._walk
    monkeypatch.setattr(C, "_walk", lambda c, drafts: [c.mask()] * (len(drafts) + 1))  # teeth: rows masked alike
    bad, reasons, *_ = _spec_run(drafts_of)
    assert bad != plain or reasons != ["stop"] * 3

    def no_rollback(c, drafts):  # teeth: the drafts are accepted but never rolled back
        c.rollback = lambda n: None
        return real_walk(c, drafts)

    monkeypatch.setattr(C, "_walk", no_rollback)
    _, reasons, *_ = _spec_run(drafts_of)
    assert "abort" in reasons


# -- overlapped decode ------------------------------------------------------------------------------------------

def _overlap_run():
    eng = Engine(TINY_PAGED, max_batch_size=4, max_num_tokens=128, cuda_graphs="padded", overlap=True)
    ids = [eng.add_request([5, 9, 11 + i], SamplingParams(max_new_tokens=20, constraint=lambda: Walk(12)))
           for i in range(3)]
    free = eng.add_request([7, 8], SamplingParams(max_new_tokens=40, ignore_eos=True))  # overlaps alone at the end
    outs = drive(eng)
    assert_pool_free(eng)
    return [outs[r][-1].finish_reason for r in ids], eng.stats.overlapped_steps, check_stream(outs[free])


def test_overlapped_decode_leaves_constrained_requests_to_synchronous_steps(monkeypatch):
    reasons, overlapped, _ = _overlap_run()
    assert reasons == ["stop"] * 3 and overlapped > 0
    monkeypatch.setattr(overlap_mod, "greedy_decode", lambda e: len(e.ids) == 1 and not e.drafts and not e.new
                        and e.req.decoding and e.req.params.temperature == 0)  # teeth: the constraint check dropped
    import pagedkit.engine.engine as engine_mod

    monkeypatch.setattr(engine_mod, "greedy_decode", overlap_mod.greedy_decode)
    monkeypatch.setattr(overlap_mod, "chain_entries", _chain_without_constraint_check(overlap_mod.chain_entries))
    reasons, _, _ = _overlap_run()
    assert "abort" in reasons


def _chain_without_constraint_check(chain):
    def chained(engine, prev, make_entry):
        saved = {id(e.req): e.req.constraint for e in prev.entries}
        for e in prev.entries:
            e.req.constraint = None
        try:
            return chain(engine, prev, make_entry)
        finally:
            for e in prev.entries:
                e.req.constraint = saved[id(e.req)]
    return chained


# -- no extra host read ------------------------------------------------------------------------------------------

class Device(torch.Tensor):
    """Marks the model's logits (and what is computed from them) as device tensors and counts the host reads
    made of them: .item(), .tolist(), .cpu(), .numpy(), int() / float() / bool(), .to("cpu")."""

    reads: list[str] = []
    READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__int__,
             torch.Tensor.__float__, torch.Tensor.__bool__, torch.Tensor.__index__}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        to_host = func is torch.Tensor.to and any(str(a) == "cpu" for a in list(args[1:]) + list(kwargs.values()))
        if func in cls.READS or to_host:  # (what a host copy feeds stays marked: the same in both runs)
            cls.reads.append(func.__name__)
        return super().__torch_function__(func, types, args, kwargs)


def _reads(constrained: bool, temperature: float) -> tuple[list[str], int]:
    eng = scripted_engine()
    model = ScriptedModel(eng, scripted_logits)
    run = model.run
    model.engine.model.run = lambda *a, **k: run(*a, **k).as_subclass(Device)
    walks = []

    def make():
        walks.append(Walk(4))
        return walks[-1]

    for i in range(3):
        eng.add_request([5, 6 + i], SamplingParams(max_new_tokens=4, temperature=temperature, seed=i,
                                                   constraint=make if constrained else None))
    Device.reads = []
    drive(eng)
    return list(Device.reads), sum(w.masks for w in walks)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_masking_reads_nothing_more_from_the_device(monkeypatch, temperature):
    plain, _ = _reads(False, temperature)
    masked, masks = _reads(True, temperature)
    assert masks >= 9 and plain and masked == plain

    real = C.apply

    def host_apply(logits, masks):  # teeth: the mask applied on a host copy of the logits
        return real(logits.cpu(), masks).to(logits.device) if masks else logits

    monkeypatch.setattr(C, "apply", host_apply)
    masked, _ = _reads(True, temperature)
    assert masked != plain


# -- failures -----------------------------------------------------------------------------------------------------

def test_a_failing_constraint_aborts_its_request_only():
    class Broken(Walk):
        def mask(self):
            if len(self.accepted) == 2:
                raise RuntimeError("grammar state lost")
            return super().mask()

    eng = scripted_engine()
    ScriptedModel(eng, scripted_logits)
    bad = eng.add_request([5, 6], SamplingParams(max_new_tokens=10, constraint=Broken))
    good = eng.add_request([5, 7], SamplingParams(max_new_tokens=10, constraint=lambda: Walk(4)))
    outs = drive(eng)
    assert outs[bad][-1].finish_reason == "abort" and "grammar state lost" in outs[bad][-1].reason
    assert len(outs[bad][-1].token_ids) == 2
    assert outs[good][-1].finish_reason == "stop" and check_stream(outs[good]) == greedy_oracle([5, 7], 4)
    assert_pool_free(eng)
    with pytest.raises(ValueError, match="constraint"):
        SamplingParams(constraint="json")
    with pytest.raises(ValueError, match="factory failed"):
        eng.add_request([5], SamplingParams(constraint=lambda: 1 / 0))


def test_complete_constraint_stops_without_eos_even_with_ignore_eos():
    class Two(Walk):
        def accept(self, token):
            super().accept(token)
            return len(self.accepted) == 2  # complete after two tokens: no eos needed

    eng = scripted_engine()
    ScriptedModel(eng, scripted_logits)
    rid = eng.add_request([5, 6], SamplingParams(max_new_tokens=10, ignore_eos=True, constraint=lambda: Two(5)))
    outs = drive(eng)
    assert outs[rid][-1].finish_reason == "stop" and len(outs[rid][-1].token_ids) == 2


# -- on CUDA (the device; CI deselects `gpu`) -------------------------------------------------------------------------

@pytest.mark.gpu
def test_apply_on_cuda_makes_no_host_sync():
    """The masks' copy (pinned, non-blocking) and the masking run with CUDA's sync debug mode set to error."""
    rng = np.random.default_rng(1)
    vocab = 50_000
    logits = torch.from_numpy(rng.normal(size=(6, vocab)).astype(np.float32))
    sets = {1: rng.choice(vocab, 300, replace=False).tolist(), 4: [0, vocab - 1]}
    masks = {r: pack(s, vocab) for r, s in sets.items()}
    dev = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = C.apply(dev, masks)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    want = logits.numpy().copy()
    for r, s in sets.items():
        want[r, np.setdiff1d(np.arange(vocab), s)] = -np.inf
    np.testing.assert_array_equal(out.cpu().numpy(), want)


@pytest.mark.gpu
def test_constrained_requests_on_cuda_with_graphs_and_overlap():
    eng = Engine(TINY_PAGED, device="cuda", max_batch_size=4, max_num_tokens=128)
    assert eng.overlap
    ids = [eng.add_request([5, 9, 11 + i], SamplingParams(max_new_tokens=20, temperature=0.7 * (i % 2), seed=i,
                                                         constraint=lambda: Walk(12))) for i in range(3)]
    free = eng.add_request([7, 8], SamplingParams(max_new_tokens=40, ignore_eos=True))
    outs = drive(eng)
    assert_pool_free(eng)
    assert [outs[r][-1].finish_reason for r in ids] == ["stop"] * 3  # every token allowed (Walk raises otherwise)
    assert len(check_stream(outs[free])) == 40 and eng.stats.overlapped_steps > 0
