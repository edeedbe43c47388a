"""Validation results: a list of `Issue`s, raised once at a public boundary as `ValidationError`."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Issue:
    """One broken rule.

    node: node name (or op type when unnamed); where: the offending tensor or attribute, spelled
    "input 'key_cache'", "output 'output_qk'", "attribute 'scale'" or "model"; rule: a stable id;
    expected / got: the expected value and what was found, in words.
    """

    node: str
    where: str
    rule: str
    expected: str
    got: str
    message: str = ""

    def __str__(self) -> str:
        text = f"{self.node}: {self.where}: "
        if self.message:
            text += f"{self.message}; "
        return text + f"expected {self.expected}, got {self.got} [{self.rule}]"

    def to_dict(self) -> dict:
        return asdict(self) | {"text": str(self)}


class ValidationError(ValueError):
    """Raised once, listing every issue found."""

    def __init__(self, issues: list[Issue], context: str = ""):
        self.issues = list(issues)
        head = f"{context}: " if context else ""
        lines = "\n".join(f"  - {i}" for i in self.issues)
        super().__init__(f"{head}{len(self.issues)} contract violation(s):\n{lines}")


def raise_if_any(issues: list[Issue], context: str = "") -> None:
    if issues:
        raise ValidationError(issues, context)
