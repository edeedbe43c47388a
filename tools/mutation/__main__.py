"""Mutation testing, time-boxed for a 2-core machine: sample mutants of one component (or of the files you
changed), run each against that component's own tests with pytest -x on a copy of the repository, report.

    python -m tools.mutation --list
    python -m tools.mutation --component parity --sample 100 --seed 0 --jobs 2
    python -m tools.mutation --files pagedkit/engine/sampling.py pagedkit/engine/engine.py --jobs 2
    python -m tools.mutation --component kernels --sample 20 --dry-run
    python -m tools.mutation --render parity      # after recording reasons in docs/mutation/accepted.json

Mutants come from cosmic-ray's core operators (filtered: tools/mutation/mutants.py) and, for the Triton
kernels, a hand-written list (tools/mutation/kernels.py). The components (sources, test selection, timeout,
time box) are data in tools/mutation/components.py. A component campaign writes docs/mutation/<name>.md and
.json; --files writes build/mutation/changed.md and .json. Survivors are listed with the reason they are
equivalent or accepted, read from docs/mutation/accepted.json (key: "path|original line|mutated line").
Exit status 1 when the kill rate ((killed + timeouts) / mutants run) is under --fail-under (default 85), or,
with --files, when a survivor has no recorded reason. docs/testing.md says when to run what.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import subprocess
import sys
import time
from pathlib import Path

from .components import COMPONENTS, Component
from .mutants import Mutant, all_mutants, describe, expand, matches, mutated_source

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "mutation"
ACCEPTED = DOCS / "accepted.json"


def component_sources(root: Path, comp: Component) -> list[str]:
    files = expand(root, comp.sources, must_match=True)
    return [f for f in files if not any(matches(f, pat) for pat, _ in comp.exclude if "::" not in pat)]


def tests_for(root: Path, comp: Component, path: str) -> list[str]:
    globs = comp.tests
    for pat, sel in comp.tests_by_source:
        if matches(path, pat):
            globs = tuple(g.replace("{stem}", Path(path).stem) for g in sel)
            break
    tests, opts, it = [], [], iter(globs)
    for g in it:  # pytest options pass through: "-k", "not long_contexts"
        if g.startswith("-"):
            opts += [g, next(it)] if g in ("-k", "-m") else [g]
        else:
            tests += [t for t in expand(root, [g], must_match=False) if t not in tests]
    if not tests:
        raise SystemExit(f"mutation: no test file matches {list(globs)} (for {path})")
    return tests + opts


def owner(root: Path, path: str) -> tuple[str, Component]:
    for name, comp in COMPONENTS.items():
        if path in component_sources(root, comp):
            return name, comp
    raise SystemExit(f"mutation: {path} is in no component of tools/mutation/components.py "
                     f"({', '.join(COMPONENTS)}); add it there, or pass --tests")


def key(m: Mutant, original: str, mutated: str) -> str:
    return f"{m.path}|{original}|{mutated}"


def git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def _versions() -> dict:
    import importlib.metadata as md

    out = {}
    for dist in ("cosmic-ray", "pytest", "torch", "triton"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m tools.mutation", description=__doc__.split("\n\n")[0])
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--component", choices=sorted(COMPONENTS), help="sample mutants of one component")
    what.add_argument("--files", nargs="+", metavar="F", help="mutants of these files (the ones you changed)")
    what.add_argument("--list", action="store_true", help="components: sources, tests, mutant counts")
    what.add_argument("--render", metavar="NAME", help="rewrite docs/mutation/NAME.md from its .json with the "
                      "reasons now in docs/mutation/accepted.json (no run)")
    p.add_argument("--sample", type=int, default=None,
                   help="random sample size (default: 100 for --component, every mutant for --files)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=2, help="mutants run at once, each on its own copy (default 2)")
    p.add_argument("--timeout", type=float, default=None,
                   help="per-mutant seconds (default: the component's, at least 2x the unmutated run + 30)")
    p.add_argument("--budget", type=float, default=None, help="time box in seconds (default: the component's)")
    p.add_argument("--tests", nargs="+", default=None, help="with --files: the pytest selection to use")
    p.add_argument("--out", type=Path, default=None,
                   help="report folder (default docs/mutation for --component, build/mutation for --files)")
    p.add_argument("--fail-under", type=float, default=85.0, help="kill rate in percent (default 85)")
    p.add_argument("--dry-run", action="store_true", help="print the sampled mutants, run nothing")
    p.add_argument("--workdir", type=Path, default=None, help="where the repository copies go (default: tmp)")
    return p.parse_args(argv)


def list_components() -> int:
    for name, comp in COMPONENTS.items():
        files = component_sources(ROOT, comp)
        n = len(all_mutants(ROOT, files, comp.kernel_list))
        tests = expand(ROOT, comp.tests, must_match=False)
        print(f"{name}: {len(files)} files, {n} mutants; tests: {' '.join(tests)}"
              + (f"; per-source selections: {len(comp.tests_by_source)}" if comp.tests_by_source else ""))
    return 0


def main(argv=None) -> int:
    args = parse(argv)
    try:
        import cosmic_ray  # noqa: F401
    except ImportError:
        raise SystemExit('mutation: needs cosmic-ray: pip install -e ".[mutation]" (cosmic-ray==8.7.0)') from None
    if args.list:
        return list_components()
    accepted = json.loads(ACCEPTED.read_text(encoding="utf-8")) if ACCEPTED.exists() else {}
    if args.render:
        out_dir = args.out or DOCS
        report = json.loads((out_dir / f"{args.render}.json").read_text(encoding="utf-8"))
        for m in report["mutants"]:
            m["why"] = accepted.get(f"{m['path']}|{m['original']}|{m['mutated']}", "")
        (out_dir / f"{args.render}.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        (out_dir / f"{args.render}.md").write_text(markdown(report, COMPONENTS.get(args.render)), encoding="utf-8")
        left = sum(m["status"] == "survived" and not m["why"] for m in report["mutants"])
        print(f"{out_dir / (args.render + '.md')}: {left} survivors without a recorded reason")
        return 0

    if args.component:
        name, comp = args.component, COMPONENTS[args.component]
        files = component_sources(ROOT, comp)
        sample_n = 100 if args.sample is None else args.sample
        out_dir = args.out or DOCS
    else:
        files = [str(Path(f).resolve().relative_to(ROOT)) for f in args.files]
        owners = {f: owner(ROOT, f) for f in files} if args.tests is None else {}
        comp = next(iter(owners.values()))[1] if owners else Component((), tuple(args.tests), 120, 3600)
        name = "changed"
        sample_n = args.sample or 0
        out_dir = args.out or ROOT / "build" / "mutation"

    def comp_of(path: str) -> Component:
        return comp if args.component else (owners[path][1] if owners else comp)

    population = []
    for f in files:
        c = comp_of(f)
        skip_fns = [pat.split("::", 1)[1] for pat, _ in c.exclude if "::" in pat and matches(f, pat.split("::")[0])]
        population += [m for m in all_mutants(ROOT, [f], c.kernel_list) if m.function not in skip_fns]
    rng = random.Random(args.seed)
    sample = population if not sample_n or sample_n >= len(population) else rng.sample(population, sample_n)
    sample.sort(key=lambda m: (m.path, m.line, m.col, m.operator, m.occurrence))

    sources = {f: (ROOT / f).read_text(encoding="utf-8") for f in files}
    jobs, info = [], {}
    from .runner import Job, Pool

    for m in sample:
        text = mutated_source(ROOT, m, sources[m.path])
        original, mutated = describe(sources[m.path], text)
        tests = args.tests or tests_for(ROOT, comp_of(m.path), m.path)
        info[m.id] = {**m.as_dict(), "original": original, "mutated": mutated, "tests": tests,
                      "why": accepted.get(key(m, original, mutated), "")}
        if text is not None:
            jobs.append(Job(m.id, m.path, text, tests, 0.0))
    print(f"{name}: {len(files)} files, {len(population)} mutants, sample {len(sample)} (seed {args.seed})",
          flush=True)
    if args.dry_run:
        for m in sample:
            i = info[m.id]
            print(f"{m.path}:{m.line} {m.operator} [{m.function}]  {i['original']}  ->  {i['mutated']}")
        return 0

    t_start = time.monotonic()
    pool = Pool(ROOT, args.jobs, args.workdir)
    try:
        selections = sorted({tuple(j.tests) for j in jobs})
        base = pool.run([Job(f"baseline:{' '.join(s)}", "", None, list(s), 3600) for s in selections])
        baseline = {}
        for s in selections:
            o = base[f"baseline:{' '.join(s)}"]
            if o.status != "survived":
                print(f"mutation: the unmutated selection fails ({o.status}, exit {o.exit_code}): {' '.join(s)}\n"
                      f"{o.killed_by}\n{o.log_tail}", file=sys.stderr)
                return 2
            baseline[s] = o.seconds
            print(f"baseline {o.seconds:.1f} s: {' '.join(s)}", flush=True)
        for j in jobs:
            comp_timeout = comp_of(j.path).timeout
            j.timeout = args.timeout or max(comp_timeout, 2 * baseline[tuple(j.tests)] + 30)
        budget = args.budget if args.budget is not None else (comp.budget if args.component else None)

        def progress(job, out, done, total):
            m = info[job.key]
            print(f"[{done}/{total}] {out.status:8} {out.seconds:6.1f} s  {m['path']}:{m['line']} "
                  f"{m['operator']}  {m['mutated'][:90]}", flush=True)

        t_run = time.monotonic()
        results = pool.run(jobs, budget=budget, progress=progress)
        run_seconds = time.monotonic() - t_run
    finally:
        pool.close()

    rows = []
    for m in sample:
        i = info[m.id]
        o = results.get(m.id)
        if o is None:
            continue  # not run: the time box ran out
        rows.append(i | {"status": o.status, "seconds": round(o.seconds, 2), "exit_code": o.exit_code,
                         "killed_by": o.killed_by})
    counts = {s: sum(r["status"] == s for r in rows) for s in ("killed", "timeout", "survived", "error")}
    ran = len(rows)
    rate = 100.0 * (counts["killed"] + counts["timeout"]) / ran if ran else 0.0
    cmd = "python -m tools.mutation " + " ".join(sys.argv[1:] if argv is None else argv)
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    report = {
        "component": name, "notes": comp.notes if args.component else "", "command": cmd,
        "commit": git("rev-parse", "HEAD") + (" (with uncommitted changes)" if dirty else ""),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "versions": _versions(), "files": files, "population": len(population), "sample": len(sample),
        "seed": args.seed, "ran": ran, "jobs": args.jobs, **counts, "kill_rate": round(rate, 1),
        "baseline_seconds": {" ".join(s): round(v, 1) for s, v in baseline.items()},
        "wall_seconds": round(time.monotonic() - t_start, 1), "run_seconds": round(run_seconds, 1),
        "seconds_per_mutant": round(run_seconds / ran, 2) if ran else None,
        "budget": budget, "mutants": rows,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    (out_dir / f"{name}.md").write_text(markdown(report, comp if args.component else None), encoding="utf-8")
    unexplained = [r for r in rows if r["status"] == "survived" and not r["why"]]
    print(f"{name}: ran {ran} of {len(sample)}: killed {counts['killed']}, timeouts {counts['timeout']}, "
          f"survived {counts['survived']} ({len(unexplained)} without a recorded reason), errors {counts['error']}; "
          f"kill rate {rate:.1f}%; {report['seconds_per_mutant']} s/mutant at --jobs {args.jobs}; "
          f"report {out_dir / (name + '.md')}")
    if counts["error"] or rate < args.fail_under or (args.files and unexplained):
        return 1
    return 0


def _cell(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def markdown(r: dict, comp: Component | None) -> str:
    out = [f"# Mutation report: {r['component']}", ""]
    if r["notes"]:
        out += [r["notes"][0].upper() + r["notes"][1:] + ".", ""]
    out += [f"Command: `{r['command']}`  ",
            f"Commit: {r['commit']}; {r['date']}; cosmic-ray {r['versions'].get('cosmic-ray')}, "
            f"pytest {r['versions'].get('pytest')}, torch {r['versions'].get('torch')}, "
            f"triton {r['versions'].get('triton')}", ""]
    out += ["Sources: " + ", ".join(f"`{f}`" for f in r["files"]), ""]
    sels = sorted({" ".join(m["tests"]) for m in r["mutants"]})
    out += ["Tests (pytest -x, each mutant on a copy of the repository):"]
    out += [f"- `{s}` (unmutated: {r['baseline_seconds'].get(s, '?')} s)" for s in sels]
    if comp is not None and comp.exclude:
        out += ["", "Not mutated: " + "; ".join(f"`{p}` ({why})" for p, why in comp.exclude)]
    out += ["", "| population | sample (seed) | ran | killed | timeouts | survived | errors | kill rate | s/mutant |",
            "|---|---|---|---|---|---|---|---|---|",
            f"| {r['population']} | {r['sample']} ({r['seed']}) | {r['ran']} | {r['killed']} | {r['timeout']} | "
            f"{r['survived']} | {r['error']} | {r['kill_rate']}% | {r['seconds_per_mutant']} (--jobs {r['jobs']}) |",
            "", "Kill rate = (killed + timeouts) / mutants run. A timeout is a mutant whose tests ran past the "
            "per-mutant limit (at least twice the unmutated run): the change was noticed as a hang.", ""]
    surv = [m for m in r["mutants"] if m["status"] == "survived"]
    out += [f"## Survivors ({len(surv)})", ""]
    if surv:
        out += ["| file:line | function | operator | mutation | why equivalent / accepted |", "|---|---|---|---|---|"]
        for m in surv:
            out.append(f"| {m['path']}:{m['line']} | {_cell(m['function'])} | {m['operator']} | "
                       f"`{_cell(m['original'])}` → `{_cell(m['mutated'])}` | {_cell(m['why']) or '**unexplained**'} |")
    else:
        out.append("None.")
    other = [m for m in r["mutants"] if m["status"] in ("timeout", "error")]
    if other:
        out += ["", f"## Timeouts and errors ({len(other)})", "", "| file:line | status | mutation | detail |",
                "|---|---|---|---|"]
        for m in other:
            out.append(f"| {m['path']}:{m['line']} | {m['status']} | `{_cell(m['original'])}` → "
                       f"`{_cell(m['mutated'])}` | {_cell(m['killed_by'])} |")
    by_op: dict[str, list[int]] = {}
    for m in r["mutants"]:
        k = by_op.setdefault(m["operator"].split("_")[0] if m["operator"].startswith("core/Replace") and "Operator" in
                             m["operator"] else m["operator"], [0, 0])
        k[0] += 1
        k[1] += m["status"] in ("killed", "timeout")
    out += ["", "## By operator", "", "| operator | mutants | killed |", "|---|---|---|"]
    out += [f"| {op} | {n} | {k} |" for op, (n, k) in sorted(by_op.items())]
    out += ["", "Every mutant (status, seconds, the first failing test) is in the .json beside this file.", ""]
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
