"""The report every GQA <-> PagedAttention pass returns: nodes changed, nodes skipped (and why), model-level
changes. Same shape as decompose's DecomposeReport (changed / skipped) plus `model` lines."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RewriteReport:
    pass_name: str
    changed: list[str] = field(default_factory=list)  # attention nodes rewritten
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (node name, reason)
    model: list[str] = field(default_factory=list)  # model-level changes (inputs, outputs, casts, config)
    rules: dict[str, list[str]] = field(default_factory=dict)  # node name -> rules applied

    @property
    def refused(self) -> bool:
        return bool(self.skipped)

    def __str__(self) -> str:
        lines = [f"{self.pass_name}: {len(self.changed)} attention node(s) rewritten, {len(self.skipped)} skipped"]
        lines += [f"  rewritten: {n}" for n in self.changed]
        lines += [f"  skipped: {n}: {r}" for n, r in self.skipped]
        lines += [f"  model: {m}" for m in self.model]
        return "\n".join(lines)


class RewriteRefused(ValueError):
    """A whole-model rewrite that cannot be done exactly; the message is one line with every reason."""
