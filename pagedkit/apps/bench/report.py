"""paged-bench's outputs: the environment facts of the JSON (device, versions, commit), the per-row
fractions of the floor and ratios, a one-line-per-row table, and the plot (matplotlib, Agg backend)."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

from ... import settings

ARM_LABELS = {"pagedkit": "pagedkit engine", "ort": "onnxruntime CUDA EP", "genai": "onnxruntime-genai Engine"}


def settings_env() -> dict[str, str]:
    """The kernel settings the environment overrides (PAGEDKIT_DECODE_TILE, PAGEDKIT_QUANT_ASM, ...): every
    PAGEDKIT_* variable but PAGEDKIT_COMMIT, for a result file to record what it ran under."""
    return {k: v for k, v in settings.pagedkit_environment().items() if k != "PAGEDKIT_COMMIT"}


def pagedkit_commit() -> str | None:
    """PAGEDKIT_COMMIT, else `git rev-parse HEAD` of the checkout pagedkit is imported from (None if neither)."""
    env = settings.read("PAGEDKIT_COMMIT")
    if env:
        return env
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def versions() -> dict:
    import numpy
    import onnx
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "onnx": onnx.__version__,
           "numpy": numpy.__version__, "onnxruntime": None}
    try:
        import onnxruntime

        out["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        pass
    return out


def device_name(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    return f"cpu: {platform.processor() or platform.machine()} ({os.cpu_count()} logical cores)"


def finish_row(rec: dict) -> dict:
    """Adds fraction_of_floor per arm (arm tokens/s over the floor's) and pagedkit_over_ort."""
    floor = rec["floor"]["tokens_per_s"]
    for arm in rec["arms"].values():
        tps = arm.get("tokens_per_s")
        if tps is not None:
            arm["fraction_of_floor"] = tps / floor
    pk, ort, gen = (rec["arms"].get(a, {}).get("tokens_per_s") for a in ("pagedkit", "ort", "genai"))
    rec["pagedkit_over_ort"] = pk / ort if pk and ort else None
    if "genai" in rec["arms"]:
        rec["pagedkit_over_genai"] = pk / gen if pk and gen else None
    return rec


def table(result: dict) -> list[str]:
    """One line per row: ms/step, tokens/s and TTFT per arm, the floor."""
    lines = []
    for r in result["rows"]:
        head = f"batch {r['batch']:>3} context {r['context']:>6}"
        if "skipped" in r:
            lines.append(f"{head}: skipped: {r['skipped']}")
            continue
        parts = []
        for name, arm in r["arms"].items():
            if "tokens_per_s" in arm:
                parts.append(f"{name} {arm['ms_per_step']:.2f} ms/step {arm['tokens_per_s']:.1f} tok/s "
                             f"ttft {arm['ttft_ms']:.1f} ms ({100 * arm['fraction_of_floor']:.3g}% of floor)")
            else:
                parts.append(f"{name} skipped")
        parts.append(f"floor {r['floor']['ms_per_step']:.4g} ms/step {r['floor']['tokens_per_s']:.4g} tok/s")
        if "prefill_floor" in r:
            parts.append(f"prefill floor {r['prefill_floor']['ms']:.4g} ms")
        for key, peer in (("parity", "ort"), ("parity_genai", "genai")):
            if key in r:
                parts.append(f"greedy tokens equal {peer}'s" if r[key]["equal"]
                             else f"greedy tokens differ from {peer}'s in requests {r[key]['mismatched_requests']}")
        lines.append(f"{head}: " + "; ".join(parts))
    return lines


def plot(result: dict, path: Path) -> str | None:
    """Decode tokens/s and TTFT against the batch, one line per (arm, context), the floor dashed.
    Returns why no plot was written (matplotlib missing), else None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no plot"
    rows = [r for r in result["rows"] if "skipped" not in r]
    contexts = sorted({r["context"] for r in rows})
    fig, (ax_tps, ax_ttft) = plt.subplots(1, 2, figsize=(12, 4.5))
    for ctx in contexts:
        mine = sorted((r for r in rows if r["context"] == ctx), key=lambda r: r["batch"])
        xs = [r["batch"] for r in mine]
        ax_tps.plot(xs, [r["floor"]["tokens_per_s"] for r in mine], "k--", alpha=0.5,
                    label=f"floor, context {ctx}")
        for arm in ARM_LABELS:
            pts = [(r["batch"], r["arms"][arm]) for r in mine if "tokens_per_s" in r["arms"].get(arm, {})]
            if pts:
                ax_tps.plot([x for x, _ in pts], [a["tokens_per_s"] for _, a in pts], "o-",
                            label=f"{ARM_LABELS[arm]}, context {ctx}")
                ax_ttft.plot([x for x, _ in pts], [a["ttft_ms"] for _, a in pts], "o-",
                             label=f"{ARM_LABELS[arm]}, context {ctx}")
    batches = sorted({r["batch"] for r in rows})
    for ax, title, unit in ((ax_tps, "decode throughput", "tokens / s"), (ax_ttft, "time to first token", "ms")):
        ax.set_xscale("log", base=2)
        if batches:
            ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_yscale("log")
        ax.set_xlabel("batch")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    model = result["model"]
    fig.suptitle(f"paged-bench {model['name']} on {result['device_name']} ({result['date']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
