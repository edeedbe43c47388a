"""Shared harness of the tensor-parallel tests (tests/test_tp_*.py): tiny random models exported twice, as one
fp32 graph (paged-export) and as a set of N ranks (paged-export --tp N), run greedily with pagedkit's Generator.

The reference is the single-device export run alone (onnxruntime's CPU kernels between the attention nodes, as
paged-run); the set runs the same model cut into ranks, teacher-forced over the reference's greedy tokens. The
check: at every step max|logits_tp - logits_1| <= TOL x max|logits_1| and the set's argmax is the reference's
token (the same greedy tokens). Both graphs round Q / K / V to float16 at the attention node in the same way;
everything else is float32, summed in another order (partial sums over the ranks): 1e-3 has room for that and
none for a dropped all-reduce, a wrong head or a permuted vocabulary (the teeth tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from export_utils import export_tiny, tiny_model

TOL = 1e-3
PROMPT = [5, 17, 3, 99, 42, 8, 61, 23, 77, 14, 30, 2 + 1, 88, 9, 120, 64, 33, 71, 12]  # 19 tokens: 2 blocks of 16
STEPS = 6


@dataclass(frozen=True)
class Case:
    config: str
    overrides: tuple = ()
    seed: int = 0

    def model(self):
        return tiny_model(self.config, seed=self.seed, **dict(self.overrides))


def export_pair(hf, out: Path, world: int = 2, **opts) -> tuple[Path, Path]:
    """(single-device fp32 export, tensor-parallel fp32 export of `world` ranks) of `hf` under out/."""
    from pagedkit.exporters.families.base import ExportOptions
    from pagedkit.exporters.tp.export import export_tp_model

    one, many = out / "tp1", out / f"tp{world}"
    export_tiny(hf, one, dtype="fp32", **opts)
    export_tp_model(hf, many, ExportOptions(dtype="fp32", progress=False, **opts), tp=world)
    return one, many


def reference(folder: Path, prompt=PROMPT, steps: int = STEPS, cpu_backend: str = "auto"):
    """The single-device export's greedy steps."""
    from pagedkit.runtime.generate import Generator

    return list(Generator(folder, cpu_backend=cpu_backend).greedy(prompt, steps, stop_at_eos=False))


def run_set(tp, folder: Path, tokens: list[int], prompt=PROMPT, cpu_backend: str = "auto"):
    """The set's steps teacher-forced over `tokens` (tp: a running TensorParallel)."""
    from pagedkit.runtime.generate import Generator

    session = tp.session(folder, cpu_backend=cpu_backend)
    try:
        return Generator(folder, session=session).teacher_forced(prompt, tokens)
    finally:
        session.close()


def compare(ref, got, tol: float = TOL) -> float:
    """The worst max|diff| / max|ref| over the steps; AssertionError when a step breaks the bound or the argmax."""
    worst = 0.0
    for k, (r, g) in enumerate(zip(ref, got)):
        scale = float(r.logits.abs().max())
        ratio = float((g.logits - r.logits).abs().max()) / scale
        worst = max(worst, ratio)
        assert ratio <= tol, f"step {k}: max|diff| / max|ref| = {ratio:.3g} > {tol}"
        assert int(torch.argmax(g.logits)) == r.token, f"step {k}: greedy token {int(torch.argmax(g.logits))} " \
                                                       f"!= {r.token}"
    assert len(ref) == len(got)
    return worst
