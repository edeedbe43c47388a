"""Parity of a pagedkit run with Hugging Face eager: the same tokens teacher-forced through HF (float32,
eager attention, the local checkpoint folder only, offline, no remote code), compared step by step.

    gen = Generator(model_dir); list(gen.greedy(prompt, 16))
    report = parity(gen.history, hf_logits(load_hf(hf_dir), gen.history.token_ids), TOLERANCES[gen.dtype])
    print("\n".join(report.lines())); report.ok

A step passes when max|ours - ref| <= tol * max|ref| over the vocabulary; greedy tokens must agree
unless HF's top-2 logits are within tol * max|ref| (a near-tie: either choice is within numerical noise).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from .generate import TOLERANCES, History

__all__ = ["ParityReport", "ParityStep", "TOLERANCES", "hf_logits", "load_hf", "parity"]


@dataclass
class ParityStep:
    step: int
    position: int  # position whose next-token logits are compared
    max_abs_diff: float
    max_ref: float
    ours: int  # our greedy token (argmax of our logits)
    ref: int  # the reference's greedy token
    near_tie: bool  # the reference's top-2 logits are within tol * max|ref|

    @property
    def rel(self) -> float:
        return self.max_abs_diff / max(self.max_ref, 1e-30)

    @property
    def agree(self) -> bool:
        return self.ours == self.ref


@dataclass
class ParityReport:
    steps: list[ParityStep]
    tol: float

    @property
    def max_rel(self) -> float:
        return max((s.rel for s in self.steps), default=0.0)

    @property
    def disagreements(self) -> list[ParityStep]:
        """Steps whose greedy tokens differ where the reference has no near-tie."""
        return [s for s in self.steps if not s.agree and not s.near_tie]

    @property
    def ok(self) -> bool:
        return self.max_rel <= self.tol and not self.disagreements

    def lines(self) -> list[str]:
        out = [f"{'step':>4} {'pos':>5} {'ours':>7} {'ref':>7} {'max|diff|':>10} {'/max|ref|':>10}  tokens"]
        for s in self.steps:
            mark = "agree" if s.agree else ("differ (near-tie)" if s.near_tie else "DIFFER")
            if s.agree and s.near_tie:
                mark += " (near-tie)"
            flag = "" if s.rel <= self.tol else "  > tol"
            out.append(f"{s.step:>4} {s.position:>5} {s.ours:>7} {s.ref:>7} {s.max_abs_diff:>10.3e} {s.rel:>10.3e}"
                       f"  {mark}{flag}")
        verdict = "OK" if self.ok else "FAIL"
        out.append(f"parity {verdict}: largest max|diff| / max|ref| = {self.max_rel:.3e} (tol {self.tol:g}), "
                   f"{sum(s.agree for s in self.steps)}/{len(self.steps)} greedy tokens agree, "
                   f"{sum(s.near_tie for s in self.steps)} near-ties, {len(self.disagreements)} real disagreements")
        return out


def load_hf(hf_dir: str | Path) -> torch.nn.Module:
    """A local Hugging Face causal LM, float32, eager attention; never downloads, never runs remote code."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import transformers

    if not Path(hf_dir).is_dir():
        raise FileNotFoundError(f"Hugging Face checkpoint folder not found: {hf_dir}")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(hf_dir), dtype=torch.float32, attn_implementation="eager", local_files_only=True,
        trust_remote_code=False).eval()


def hf_logits(model: torch.nn.Module | str | Path, token_ids: Sequence[int]) -> torch.Tensor:
    """Teacher-forced logits over token_ids in one forward pass: [L, V] float32 (row t = the next-token
    logits after token t). `model`: a loaded model (load_hf) or a checkpoint folder."""
    if not isinstance(model, torch.nn.Module):
        model = load_hf(model)
    with torch.no_grad():
        out = model(torch.tensor([list(token_ids)], dtype=torch.long), use_cache=False)
    return out.logits[0].float()


def parity(history: History, ref_logits: torch.Tensor, tol: float) -> ParityReport:
    """Compare every step of a run with the reference's logits at the same position."""
    steps = []
    for k, s in enumerate(history.steps):
        ref = ref_logits[s.position].float()
        ours = s.logits.float()
        if ours.shape != ref.shape:
            raise ValueError(f"step {k}: our logits have shape {tuple(ours.shape)}, the reference's {tuple(ref.shape)}")
        top2 = torch.topk(ref, 2).values
        max_ref = float(ref.abs().max())
        steps.append(ParityStep(k, s.position, float((ours - ref).abs().max()), max_ref, int(torch.argmax(ours)),
                                int(torch.argmax(ref)), float(top2[0] - top2[1]) <= tol * max_ref))
    return ParityReport(steps, tol)
