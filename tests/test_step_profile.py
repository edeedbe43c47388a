"""benchmarks/step_profile.py's pure parts: the --sweep entries and --pick's choice of decode knobs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import step_profile as sp  # noqa: E402


def test_sweep_entries():
    assert sp._config("dedup") == {"name": "dedup"}
    assert sp._config("64x8") == {"name": "64x8", "tile": (64, 8)}
    assert sp._config("@6") == {"name": "@6", "waves": 6.0}
    assert sp._config("128x4@1.5") == {"name": "128x4@1.5", "tile": (128, 4), "waves": 1.5}
    assert sp._config("nopdl+64x4") == {"name": "nopdl+64x4", "pdl": False, "tile": (64, 4)}
    assert sp._config("noroute") == {"name": "noroute", "noroute": True}
    with pytest.raises(ValueError):
        sp._config("64")


def test_noroute_turns_the_routing_kernel_off_within_the_entry():
    from pagedkit.runtime.ops import moe

    before = moe.ROUTE_KERNEL
    with sp._applied(sp._config("noroute")):
        assert moe.ROUTE_KERNEL is False
    assert moe.ROUTE_KERNEL == before
    with sp._applied(sp._config("default")):
        assert moe.ROUTE_KERNEL == before


def _rows(*times):
    names = ["default", "dedup", "64x4", "@6"]
    return [{"sweep": [{"config": n, "replay_ms": t} for n, t in zip(names, row)]} for row in times]


def test_pick_takes_the_best_mean_gain_without_a_losing_row():
    # @6 gains 4% on average; 64x4 gains more on row 0 but loses 5% on row 1; dedup is no knob
    assert sp.pick(_rows((1.0, 0.5, 0.90, 0.97), (2.0, 1.0, 2.10, 1.90))) == {"PAGEDKIT_DECODE_WAVES": "6.0"}
    assert sp.pick(_rows((1.0, 0.5, 0.95, 0.97), (2.0, 1.0, 1.90, 1.99))) == {"PAGEDKIT_DECODE_TILE": "64x4"}
    assert sp.pick(_rows((1.0, 0.5, 0.99, 1.0), (2.0, 1.0, 1.99, 2.0))) == {}  # under 2%: the defaults stay
    assert sp.pick([]) == {}
