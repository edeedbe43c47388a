"""docs/ops/*.md are generated from the contract data and must be up to date."""

from __future__ import annotations

import re

from pagedkit.validators.contract import CONTRACTS
from pagedkit.validators.docs import COMMAND, DOCS_DIR, main, render, rule_docs, stale_docs, targets


def test_committed_op_docs_are_current():
    stale = stale_docs()
    assert not stale, (f"stale generated docs: {[str(p) for p in stale]}; regenerate them with `{COMMAND}` "
                       "and commit the result")


def _rows(text: str, section: str) -> list[list[str]]:
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in body.splitlines() if line.startswith("| ")][2:]  # skip header + rule
    return [[c.strip() for c in re.split(r"(?<!\\)\|", r)[1:-1]] for r in rows]


def test_tables_follow_the_contract():
    for contract in CONTRACTS.values():
        text = render(contract)
        inputs = _rows(text, "Inputs")
        assert [(int(r[0]), r[1].strip("`")) for r in inputs] == [(p.index, p.name) for p in contract.inputs]
        assert [r[6] for r in inputs] == ["optional" if p.optional else "required" for p in contract.inputs]
        assert [r[7] == "pagedkit extension" for r in inputs] == [not p.shipped for p in contract.inputs]
        outputs = _rows(text, "Outputs")
        assert [r[1].strip("`") for r in outputs] == [p.name for p in contract.outputs]
        attrs = {r[0].strip("`"): r for r in _rows(text, "Attributes")}
        assert list(attrs) == [a.name for a in contract.attributes]
        for a in contract.attributes:
            if a.required:
                assert attrs[a.name][2] == "required"
            elif a.default is not None:
                assert str(a.default) in attrs[a.name][2], a.name
        tcs = {r[0].strip("`"): r[1] for r in _rows(text, "Type constraints")}
        assert set(tcs) == set(contract.type_constraints)
        for k, types in contract.type_constraints.items():
            assert tcs[k].count("`") == 2 * len(types)
        for heading, _ in contract.semantics:
            assert f"### {heading}\n" in text
        rules = [r[0].strip("`") for r in _rows(text, "Validation rules")]
        assert rules == list(rule_docs(contract)) and "MODEL-cache-written-back" in rules


def test_check_mode_reports_stale_files(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--check"]) == 1
    assert "regenerate with" in capsys.readouterr().out
    assert main(["--out", str(tmp_path)]) == 0
    assert main(["--out", str(tmp_path), "--check"]) == 0
    (tmp_path / "PagedAttention.md").write_text("edited by hand\n")
    assert main(["--out", str(tmp_path), "--check"]) == 1
    assert set(targets(tmp_path)) == {tmp_path / "PagedAttention.md", tmp_path / "GroupQueryAttention.md"}
    assert DOCS_DIR.name == "ops" and DOCS_DIR.parent.name == "docs"


README_COMMANDS = [
    'pip install torch==2.13.0 -e ".[export]" && paged-fetch smollm2-135m && paged-export --model smollm2-135m '
    '--output smollm2-fp16 && paged-run smollm2-fp16 --prompt "The history of the printing press begins" --parity',
    'pip install torch==2.13.0 -e ".[test,export,triton-cpu]" onnxruntime-genai && python -m pytest -q',
]


def test_readme_starts_with_the_two_setup_commands_and_ci_runs_the_second():
    root = DOCS_DIR.parents[1]
    lines = (root / "README.md").read_text(encoding="utf-8").splitlines()
    block = lines[lines.index("```") + 1:]
    assert lines.index("```") <= 2 and block[:3] == [*README_COMMANDS, "```"]
    ci = (root / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert README_COMMANDS[1] in ci, "keep .ci/run running the README's test command verbatim"
    assert (root / "examples" / "tiny-paged" / "model.onnx").is_file()


def test_validate_doc_examples_run(monkeypatch, capsys):
    """Every ```python block of docs/validate.md runs as written (from the repository root)."""
    root = DOCS_DIR.parents[1]
    monkeypatch.chdir(root)
    blocks = re.findall(r"```python\n(.*?)```", (root / "docs" / "validate.md").read_text(encoding="utf-8"), re.S)
    assert len(blocks) >= 4
    for i, code in enumerate(blocks):
        exec(compile(code, f"docs/validate.md block {i}", "exec"), {})
    out = capsys.readouterr().out
    assert "[MODEL-cache-graph-input]" in out and "input 'past_seqlens'" in out
