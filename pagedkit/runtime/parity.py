"""Parity of a pagedkit run with Hugging Face eager: the same tokens teacher-forced through HF (float32,
eager attention, the local checkpoint folder only, offline, no remote code), compared step by step.

    gen = Generator(model_dir); list(gen.greedy(prompt, 16))
    report = parity(gen.history, hf_logits(load_hf(hf_dir), gen.history.token_ids), TOLERANCES[gen.dtype])
    print("\n".join(report.lines())); report.ok

A step passes when max|ours - ref| <= tol * max|ref| over the vocabulary (the logits bound); greedy tokens
must agree unless the step is a near-tie: HF's own top-2 logits closer than that tolerance,
top1 - top2 < tol * max|ref|, so that a flip there is explained by the tolerance. A flip where HF's top-2 gap
is larger than the tolerance is a real disagreement (a failure), however small the logits difference.
Every step compares the logits after the same prefix (the reference is teacher-forced over the run's tokens),
so one flip never shifts the later steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from .. import settings
from ..interface.paths import recorded_checkpoint
from .generate import TOLERANCES, History

__all__ = ["ParityReport", "ParityStep", "TOLERANCES", "hf_logits", "load_hf", "parity", "recorded_source"]


@dataclass
class ParityStep:
    step: int
    position: int  # position whose next-token logits are compared
    max_abs_diff: float
    max_ref: float
    ours: int  # our greedy token (argmax of our logits)
    ref: int  # the reference's greedy token
    near_tie: bool  # the reference's top-2 logits are closer than tol * max|ref|
    gap: float = float("nan")  # the reference's top-1 minus top-2 logit

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
    def near_ties(self) -> list[ParityStep]:
        """Steps where the reference's top-2 logits are closer than the tolerance (a flip would be allowed)."""
        return [s for s in self.steps if s.near_tie]

    @property
    def near_tie_flips(self) -> list[ParityStep]:
        """Near-ties where the greedy tokens did differ (allowed)."""
        return [s for s in self.steps if s.near_tie and not s.agree]

    @property
    def ok(self) -> bool:
        return self.max_rel <= self.tol and not self.disagreements

    def lines(self) -> list[str]:
        out = [f"{'step':>4} {'pos':>5} {'ours':>7} {'ref':>7} {'max|diff|':>10} {'/max|ref|':>10}  tokens"]
        for s in self.steps:
            mark = "agree" if s.agree else (f"differ (near-tie: HF top-2 gap {s.gap:.3g} < tol "
                                            f"{self.tol * s.max_ref:.3g})" if s.near_tie
                                            else f"DIFFER (HF top-2 gap {s.gap:.3g} >= tol {self.tol * s.max_ref:.3g})")
            flag = "" if s.rel <= self.tol else "  > tol"
            out.append(f"{s.step:>4} {s.position:>5} {s.ours:>7} {s.ref:>7} {s.max_abs_diff:>10.3e} {s.rel:>10.3e}"
                       f"  {mark}{flag}")
        verdict = "OK" if self.ok else "FAIL"
        out.append(f"parity {verdict}: largest max|diff| / max|ref| = {self.max_rel:.3e} (tol {self.tol:g}), "
                   f"{len(self.steps)} steps compared teacher-forced, "
                   f"{sum(s.agree for s in self.steps)}/{len(self.steps)} greedy tokens agree, "
                   f"{len(self.near_ties)} near-ties (HF top-2 closer than tol), "
                   f"{len(self.near_tie_flips)} flips at near-ties, {len(self.disagreements)} real disagreements")
        return out


def _is_gguf(path: Path) -> bool:
    """A .gguf file, or a folder with exactly one .gguf and no config.json (what `paged-export` reads)."""
    if path.is_file():
        return path.suffix == ".gguf"
    return path.is_dir() and not (path / "config.json").exists() and len(list(path.glob("*.gguf"))) == 1


def load_hf(hf_dir: str | Path, num_layers: int | None = None) -> torch.nn.Module:
    """A local Hugging Face causal LM, float32, eager attention; never downloads, never runs remote code.
    hf_dir: a checkpoint folder, a .gguf file or a folder holding one (dequantized to float32).
    num_layers: keep only the first N decoder layers (an export made with `--num-layers N`)."""
    settings.stay_offline("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    import transformers

    path = Path(hf_dir)
    kwargs = {}
    if _is_gguf(path):  # transformers' GGUF reader, dequantized to float32
        gguf = path if path.is_file() else next(path.glob("*.gguf"))
        path, kwargs["gguf_file"] = gguf.parent, gguf.name
    elif not path.is_dir():
        raise FileNotFoundError(f"Hugging Face checkpoint folder not found: {hf_dir}")
    if num_layers is not None:
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False,
                                                         **kwargs)
        if num_layers < config.num_hidden_layers:  # the first num_layers layers, as `paged-export --num-layers`
            config.num_hidden_layers = num_layers
            if getattr(config, "layer_types", None) is not None:
                config.layer_types = list(config.layer_types[:num_layers])
        kwargs["config"] = config
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager", local_files_only=True,
        trust_remote_code=False, **kwargs).eval()


def recorded_source(pagedkit_section: dict, model_dir: str | Path = "") -> tuple[Path, int | None]:
    """The source checkpoint an export recorded (genai_config.json's pagedkit.source: `checkpoint`, the
    local weights it was exported from, and `num_hidden_layers`); ValueError when there is none."""
    source = pagedkit_section.get("source") or {}
    checkpoint = source.get("checkpoint")
    if not checkpoint:
        why = ("it was exported from random weights" if source.get("weights") == "random"
               else "no pagedkit.source.checkpoint in its genai_config.json")
        raise ValueError(f"{model_dir}: no source checkpoint recorded ({why}); pass --parity HF_CHECKPOINT_DIR")
    layers = source.get("num_hidden_layers")
    # the config names this path: only inside the model folder or pagedkit's model cache (issue 9.1)
    return recorded_checkpoint(model_dir, checkpoint), int(layers) if layers else None


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
        gap = float(top2[0] - top2[1])
        steps.append(ParityStep(k, s.position, float((ours - ref).abs().max()), max_ref, int(torch.argmax(ours)),
                                int(torch.argmax(ref)), gap < tol * max_ref, gap))
    return ParityReport(steps, tol)
