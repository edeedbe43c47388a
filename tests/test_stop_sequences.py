"""Stop sequences of 3+ tokens with partial matches before the real one, through the real Engine with a
scripted model (tests/scripted_engine.py: the generated tokens are set by the test), and stop strings of 3+
characters in paged-serve's TextStream.

Documented behaviour (params.py, request.py): stop_sequences are matched against the GENERATED tokens; the
matched sequence is removed from the output and never streamed; tokens that may start a stop sequence are
held back until they cannot (then released in the step that decides it); nothing generated after the match is
visible; a request that ends another way (length, a stop token) releases what it held back. stop_token_ids
finish with "stop" and stay in the output. Every expectation below is written out by hand from those rules.

Teeth: the realistic matcher bugs (only the last 2 tokens compared, only the first stop sequence checked, the
matched sequence kept, hold-back of 1 token / none, held-back tokens dropped instead of released) are
monkeypatched into Request and fail the tests; the same for TextStream's partial-match hold-back.
"""

from __future__ import annotations

import pytest

from pagedkit.apps.serve import textstream as textstream_mod
from pagedkit.apps.serve.textstream import TextStream
from pagedkit.engine import SamplingParams
from pagedkit.engine.request import Request
from scripted_engine import ScriptedModel, continuation_script, drive, scripted_engine

FILLER = 99  # what the scripted model says once a script is exhausted: never expected in an output


def run(cases, **engine_kw):
    """cases: [(prompt, script, SamplingParams)] run together; per case (per-step new_token_ids of the outputs,
    the final output, the number of model steps)."""
    engine = scripted_engine(**engine_kw)
    model = ScriptedModel(engine, continuation_script({tuple(p): s for p, s, _ in cases}, filler=FILLER))
    ids = [engine.add_request(p, sp) for p, _, sp in cases]
    outs = drive(engine)
    assert engine.check_invariants() == [] and not engine.running
    result = []
    for rid in ids:
        o = outs[rid]
        assert o[-1].finished and not any(x.finished for x in o[:-1]), "exactly one final output, last"
        assert [t for x in o for t in x.new_token_ids] == o[-1].token_ids, "the streamed pieces != the final tokens"
        result.append(([x.new_token_ids for x in o], o[-1]))
    return result, model


def stop(seqs, n=20, **kw):
    return SamplingParams(max_new_tokens=n, stop_sequences=seqs, ignore_eos=True, **kw)


# ---- the cases (script = the tokens the model generates; expected pieces written from the rules) ----------------

# stop [5, 6, 7], stream 5 6 9 5 6 5 6 7 (8 ...): 5 6 held, released with 9; 5 6 held, the next 5 breaks that
# match (releases 5 6, holds the new 5); 6 held; 7 completes: "5 6 7" removed, finish "stop", 8 never seen.
BROKEN_PARTIALS = ([1, 40], [5, 6, 9, 5, 6, 5, 6, 7, 8, 8, 8], stop([(5, 6, 7)]),
                   [[5, 6, 9], [5, 6], []], [5, 6, 9, 5, 6], "stop")
# a step that releases 5 6 and holds the new 5, then 8 breaks that match too: the held 5 comes out with 8
REBROKEN = ([1, 47], [5, 6, 5, 8, 5, 6, 7, 8], stop([(5, 6, 7)]), [[5, 6], [5, 8], []], [5, 6, 5, 8], "stop")
# the stop's last two tokens occur first without its head (4 6 7): no match there, nothing to hold back
TAIL_FIRST = ([1, 41], [4, 6, 7, 5, 6, 7, 8], stop([(5, 6, 7)]), [[4], [6], [7], []], [4, 6, 7], "stop")
# a 4-token stop whose first 3 tokens occur (and break) before the match: 3 tokens held back
FOUR = ([1, 42], [5, 6, 7, 9, 5, 6, 7, 8, 9], stop([(5, 6, 7, 8)]), [[5, 6, 7, 9], []], [5, 6, 7, 9], "stop")
# the stop overlaps itself (5 5 6 after 5 5 5): the match is found one token late by a matcher that restarts
SELF_OVERLAP = ([1, 43], [5, 5, 5, 6, 7], stop([(5, 5, 6)]), [[5], []], [5], "stop")
# two stop sequences: after 5 6 the first is pending (2 held); 9 breaks it but 6 9 starts the second (1 held
# more: 5 released); 9 completes "6 9 9"
TWO = ([1, 44], [5, 6, 9, 9, 3], stop([(5, 6, 7), (6, 9, 9)]), [[5], []], [5], "stop")
# max_new_tokens reached while 5 6 is pending: finish "length", the held-back 5 6 released in the final output
LENGTH_WHILE_PENDING = ([1, 45], [1, 5, 6, 7], stop([(5, 6, 7)], n=3), [[1], [5, 6]], [1, 5, 6], "length")
# a stop token while 5 6 is pending: "stop", the stop token kept, 5 6 released
STOP_TOKEN_WHILE_PENDING = ([1, 46], [5, 6, 11, 7], stop([(5, 6, 7)], stop_token_ids=(11,)),
                            [[5, 6, 11]], [5, 6, 11], "stop")
# the prompt ends with 5 6: a generated 7 does not complete a match (only generated tokens are matched)
ACROSS_PROMPT = ([1, 5, 6], [7, 9, 5, 6, 7], stop([(5, 6, 7)]), [[7], [9], []], [7, 9], "stop")

CASES = {"broken partials": BROKEN_PARTIALS, "rebroken": REBROKEN, "tail first": TAIL_FIRST, "four tokens": FOUR,
         "self overlap": SELF_OVERLAP, "two sequences": TWO, "length while pending": LENGTH_WHILE_PENDING,
         "stop token while pending": STOP_TOKEN_WHILE_PENDING, "across the prompt": ACROSS_PROMPT}


def check_cases(names=tuple(CASES)):
    cases = [CASES[n] for n in names]
    got, model = run([c[:3] for c in cases])
    for name, (prompt, script, sp, pieces, final, reason), (got_pieces, out) in zip(names, cases, got):
        assert FILLER not in out.token_ids, f"{name}: tokens after the script leaked"
        assert (out.finish_reason, out.token_ids) == (reason, final), \
            f"{name}: finished {out.finish_reason!r} with {out.token_ids}, expected {reason!r} with {final}"
        assert got_pieces == pieces, f"{name}: streamed pieces {got_pieces}, expected {pieces}"
    return model


def test_stop_sequences_with_partial_matches():
    check_cases()


def test_the_model_is_not_run_past_the_stop():
    """The request ends in the step whose token completes the match: 8 model steps for 8 scripted tokens."""
    _, model = run([BROKEN_PARTIALS[:3]])
    assert model.steps == 8


def test_stop_inside_accepted_drafts_leaks_nothing():
    """Speculative decoding: prompt-lookup drafts 5 6 7 8 are all accepted in one step; the stop 5 6 7 completes
    inside them, so 8 (an accepted draft) and the step's bonus token are not output."""
    prompt = [1, 40, 5, 6, 7, 8, 9, 41]
    script = [40, 5, 6, 7, 8, 9, 3]
    [(pieces, final)], model = run([(prompt, script, stop([(5, 6, 7)], num_draft_tokens=4))])
    assert [lens for _, lens in model.fed] == [(8,), (5,)]  # the prompt, then 40 + the drafts 5 6 7 8
    assert final.finish_reason == "stop" and final.token_ids == [40]
    assert pieces == [[40], []]


# ---- teeth: realistic Request bugs ----------------------------------------------------------------------------

_real_holdback, _real_emit = Request._holdback, Request.emit


def _append_variant(bug: str):
    """Request.append (request.py) with one realistic change."""
    def append(self, token, logprob=None):  # (logprobs: not asked by these tests)
        self.tokens.append(int(token))
        out_len = self.num_output
        seqs = self.params.stop_sequences[:1] if bug == "first only" else self.params.stop_sequences
        for seq in seqs:
            n = len(seq)
            m = min(2, n) if bug == "last two" else n  # how many trailing tokens are compared
            if out_len >= m and tuple(self.tokens[-m:]) == seq[-m:]:
                del self.tokens[len(self.tokens) - (n - 1 if bug == "keeps first" else n):]
                self.num_emitted = min(self.num_emitted, self.num_output)
                return self.finish("stop")
        if token in self.stop_ids:
            return self.finish("stop")
        if out_len >= self.params.max_new_tokens or len(self.tokens) >= self.max_total:
            return self.finish("length")
        return False

    return append


def _holdback_one(self):
    return min(1, _real_holdback(self))


def _emit_drops_held_back(self):
    """Held-back tokens are skipped instead of released: num_emitted jumps over them."""
    out = _real_emit(self)
    if out is not None and not self.finished:
        self.num_emitted = self.num_output
    return out


REQUEST_BUGS = {
    "correct copy": ("append", _append_variant("none")),  # (not a bug: must pass, see below)
    "last two tokens only": ("append", _append_variant("last two")),
    "first stop sequence only": ("append", _append_variant("first only")),
    "first token of the match kept": ("append", _append_variant("keeps first")),
    "hold back one token": ("_holdback", _holdback_one),
    "no hold-back": ("_holdback", lambda self: 0),
    "held-back tokens dropped": ("emit", _emit_drops_held_back),
}


@pytest.mark.parametrize("bug", [b for b in REQUEST_BUGS if b != "correct copy"])
def test_teeth_request_bugs(monkeypatch, bug):
    attr, fn = REQUEST_BUGS[bug]
    monkeypatch.setattr(Request, attr, fn)
    with pytest.raises(AssertionError):
        check_cases()


def test_teeth_harness_correct_copy_passes(monkeypatch):
    """The append copy the bugs are made from passes without a bug: the teeth fail because of the bug."""
    monkeypatch.setattr(Request, "append", _append_variant("none"))
    check_cases()


# ---- stop strings in paged-serve's TextStream (3+ characters) ---------------------------------------------------

def _chars(ids):
    return "".join(chr(i) for i in ids)


def _push_all(ts, text):
    return [ts.push([ord(c)]) for c in text]


def check_textstream():
    # "abcd" after "abc" (broken by x) and "ab" (broken by a): held back up to 3 characters, released when broken
    ts = TextStream(_chars, ["abcd"])
    got = _push_all(ts, "abcxababcde")
    assert got == ["", "", "", "abcx", "", "", "ab", "", "", "", ""], got
    assert ts.stopped and ts.text == "abcxab" and ts.finish() == "" and ts.num_tokens == 10
    # two stops: the longest pending partial decides what is held ("xyz" of "xyzw", then "yzz" of "yzzq")
    ts = TextStream(_chars, ["yzzq", "xyzw"])
    got = _push_all(ts, "xyzzq")
    assert got == ["", "", "", "x", ""] and ts.stopped and ts.text == "x", got
    # the generation ends while "abc" is pending: finish() releases it
    ts = TextStream(_chars, ["abcd"])
    assert _push_all(ts, "zabc") == ["z", "", "", ""] and ts.finish() == "abc" and not ts.stopped


def test_textstream_long_stops_with_partial_matches():
    check_textstream()


def test_teeth_textstream_partial_match_of_two_chars_only(monkeypatch):
    real = textstream_mod.StopMatcher.partial
    monkeypatch.setattr(textstream_mod.StopMatcher, "partial", lambda self: min(2, real(self)))
    with pytest.raises(AssertionError):
        check_textstream()


def test_teeth_textstream_held_back_text_dropped(monkeypatch):
    """A stream that forgets held-back text when the match breaks (releases only the newest character) fails."""
    real = TextStream._release

    def release(self, final):
        return real(self, final)[-1:]

    monkeypatch.setattr(TextStream, "_release", release)
    with pytest.raises(AssertionError):
        check_textstream()
