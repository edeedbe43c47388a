"""pagedkit.runtime.parity on hand-made logits: what counts as a near-tie, a flip, a failure."""

from __future__ import annotations

import torch

from pagedkit.runtime.generate import History, StepResult
from pagedkit.runtime.parity import parity

TOL = 2e-2  # float16's tolerance: the bound is TOL * max|ref| = 0.2 logits for the rows below (max|ref| 10)


def _report(pairs):
    """One step per (ours, ref) pair of logit rows; ref rows stacked as the teacher-forced reference."""
    hist = History(prompt=[0])
    refs = []
    for k, (ours, ref) in enumerate(pairs):
        hist.steps.append(StepResult(token=int(torch.tensor(ours).argmax()), logits=torch.tensor(ours), position=k,
                                     seconds=0.0))
        refs.append(ref)
    return parity(hist, torch.tensor(refs), TOL)


def test_a_flip_beyond_the_tolerance_gap_is_a_failure_not_a_near_tie():
    # HF: top-2 gap 0.5 > 0.2 (the tolerance); ours differ from HF by 0.3 on two logits, enough to flip the argmax
    ref = [10.0, 9.5, 0.0, -1.0]
    ours = [9.7, 9.8, 0.0, -1.0]
    rep = _report([(ours, ref)])
    (s,) = rep.steps
    assert not s.agree and not s.near_tie and abs(s.gap - 0.5) < 1e-6
    assert rep.disagreements == [s] and not rep.near_tie_flips and not rep.ok
    assert "DIFFER" in rep.lines()[1] and "parity FAIL" in rep.lines()[-1]


def test_a_flip_inside_the_tolerance_is_an_allowed_near_tie():
    ref = [10.0, 9.9, 0.0, -1.0]  # gap 0.1 < 0.2
    ours = [9.95, 9.97, 0.0, -1.0]
    rep = _report([(ours, ref)])
    (s,) = rep.steps
    assert s.near_tie and not s.agree and rep.near_tie_flips == [s] and not rep.disagreements and rep.ok
    assert "differ (near-tie" in rep.lines()[1]
    assert "1 steps compared teacher-forced" in rep.lines()[-1] and "1 flips at near-ties" in rep.lines()[-1]


def test_gap_just_above_the_tolerance_is_not_a_near_tie():
    ref = [10.0, 9.75, 0.0, -1.0]  # gap 0.25 > 0.2; ours within 0.15 of ref everywhere (inside the logits bound)
    rep = _report([([9.87, 9.89, 0.0, -1.0], ref)])
    assert rep.max_rel <= TOL
    assert not rep.steps[0].near_tie and not rep.ok


def test_counts_in_the_summary():
    agree = ([10.0, 1.0, 0.0, -1.0], [10.0, 1.0, 0.0, -1.0])
    tie_agree = ([10.0, 9.95, 0.0, -1.0], [10.0, 9.9, 0.0, -1.0])
    rep = _report([agree, tie_agree, agree])
    last = rep.lines()[-1]
    assert rep.ok and "parity OK" in last and "3 steps compared teacher-forced" in last
    assert "3/3 greedy tokens agree" in last and "1 near-ties" in last and "0 flips at near-ties" in last
    assert "0 real disagreements" in last


# --- the scale's absolute values: a row whose most NEGATIVE logit dominates -------------------------------------

NEG_REF = [2.0, 1.0, 0.0, -20.0]  # max|ref| = 20 from the -20: the bound is 0.4 (0.04 if taken from the max, 2)


def _neg_dominant_checks(parity_fn):
    """What parity must say on rows whose largest magnitude is negative; raises AssertionError otherwise."""
    def report(pairs):
        hist = History(prompt=[0])
        for k, (ours, _) in enumerate(pairs):
            hist.steps.append(StepResult(token=int(torch.tensor(ours).argmax()), logits=torch.tensor(ours),
                                         position=k, seconds=0.0))
        return parity_fn(hist, torch.tensor([ref for _, ref in pairs]), TOL)

    # 0.3 off on one logit: 0.3 / 20 = 0.015 <= 0.02 (a scale from the largest value, 2, would make it 0.15)
    rep = report([([2.0, 1.3, 0.0, -20.0], NEG_REF)])
    assert abs(rep.steps[0].max_ref - 20.0) < 1e-6 and abs(rep.max_rel - 0.015) < 1e-6 and rep.ok
    # 0.5 off on the dominant negative logit alone: 0.025 > 0.02 whatever the sign of the difference
    for ours in ([2.0, 1.0, 0.0, -20.5], [2.0, 1.0, 0.0, -19.5]):
        rep = report([(ours, NEG_REF)])
        assert abs(rep.max_rel - 0.025) < 1e-6 and not rep.ok, ours
    # HF's top-2 gap 0.3 < 0.02 x 20 = 0.4: a near-tie, its flip allowed
    rep = report([([1.85, 1.9, 0.0, -20.0], [2.0, 1.7, 0.0, -20.0])])
    assert rep.steps[0].near_tie and rep.near_tie_flips == rep.steps and rep.ok


def test_the_bound_scales_by_the_largest_magnitude_even_when_negative():
    _neg_dominant_checks(parity)


def test_teeth_the_scale_without_abs_fails(tmp_path, monkeypatch):
    """parity.py with the scale's abs dropped (max ref, 2, instead of max |ref|, 20), or the difference's
    (a difference below the reference reads as none): the checks above fail."""
    import pytest

    from mutants import mutant
    from pagedkit.runtime import parity as parity_module

    for old, new in [("max_ref = float(ref.abs().max())", "max_ref = float(ref.max())"),
                     ("float((ours - ref).abs().max())", "float((ours - ref).max())")]:
        bad = mutant(parity_module, [(old, new)], tmp_path, monkeypatch)
        with pytest.raises(AssertionError):
            _neg_dominant_checks(bad.parity)
