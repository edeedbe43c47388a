"""L2 prefetch of a captured decode step's weights on a side stream (kernels/triton/prefetch.py).

A decode step alternates memory-bound products (QKV, O, gate | up, down, the LM head: [K, N] weights read once
for a few rows) with short kernels that leave the memory bus idle (norms, the cache write, attention, its
reduce, SiluMul). The products shortest in bytes never reach the device's bandwidth: their first tiles wait
out the memory latency. With a prefetch config, each product op also launches, on a side stream, the request of
a later product's weight head into the L2:

    products in step order  P0 P1 P2 ...  (MatMul / Gemm over a constant CUDA weight of >= MIN_BYTES)
    at P(k) ("early": before its launch, concurrent with it; "late": after it, so it starts when P(k) ends and
    runs beside the short kernels up to P(k + d)): request the first `mb` MB of P(k + d)'s weight

The side stream forks from the step's stream by an event and joins it at the end of the run (`join`), so a
CUDA-graph capture holds the prefetches as a parallel branch; nothing is read or written but the L2. Only
captured steps prefetch (an eager step pays a launch per product on the host) and only products of at most
MAX_ROWS rows (decode; a prefill's products are compute-bound). `CONFIG` (PAGEDKIT_L2_PREFETCH) is read at each
capture: sweeps (benchmarks/step_profile.py --sweep pfMB:late) set it in-process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import settings

CONFIG: dict | None = settings.read("PAGEDKIT_L2_PREFETCH")
MIN_BYTES = 1 << 20  # smaller weights are not worth a launch
MAX_ROWS = 64  # products of more rows (prefill) do not prefetch
PRODUCT_OPS = ("MatMul", "Gemm")


@dataclass(frozen=True)
class Product:
    op: int  # index in the program's ops
    weight: torch.Tensor  # the constant weight the product reads

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


def products(prog, device_type: str = "cuda") -> list[Product]:
    """The program's products over a constant contiguous weight of >= MIN_BYTES on that device, in step order."""
    out = []
    for i, op in enumerate(prog.ops):
        step = op.step
        if step.domain != "" or step.op_type not in PRODUCT_OPS or len(op.ins) < 2:
            continue
        w = prog.template[op.ins[1]]
        if (isinstance(w, torch.Tensor) and w.device.type == device_type and w.is_contiguous()
                and w.numel() * w.element_size() >= MIN_BYTES):
            out.append(Product(i, w))
    return out


def requests(prods: list[Product], k: int, cfg: dict) -> list[tuple[torch.Tensor, int]]:
    """What product k requests under cfg: [(weight of product k + distance, bytes)], or nothing past the last."""
    j = k + cfg["distance"]
    if j >= len(prods):
        return []
    return [(prods[j].weight, min(prods[j].nbytes, int(cfg["mb"] * (1 << 20))))]


def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


def _rows(ins: list) -> int:
    a = ins[0]
    return a.numel() // a.shape[-1] if isinstance(a, torch.Tensor) and a.dim() else 0


def _launch(weight: torch.Tensor, nbytes: int, mode: str) -> None:
    from ..kernels.triton.prefetch import prefetch_l2

    prefetch_l2(weight, nbytes, mode)


class Prefetcher:
    """The side stream of one session and whether the run in progress forked it."""

    def __init__(self, prods: list[Product], side=None):
        self.prods = prods
        self.side = side  # torch.cuda.Stream, made by attach (a capture may not create streams)
        self.forked = False
        self.launched = 0  # prefetch launches made (captures)

    def wrap(self, k: int, run):
        """Product k's op call with its prefetch (module docstring)."""

        def run_product(ins):
            cfg = CONFIG
            if cfg is None or not _capturing() or _rows(ins) > MAX_ROWS:
                return run(ins)
            items = requests(self.prods, k, cfg)
            if cfg["at"] == "early":
                self.fork(items, cfg["mode"])
            outs = run(ins)
            if cfg["at"] != "early":
                self.fork(items, cfg["mode"])
            return outs

        return run_product

    def fork(self, items: list, mode: str) -> None:
        if not items:
            return
        self.side.wait_stream(torch.cuda.current_stream())  # the fork: it starts where the step's stream is
        with torch.cuda.stream(self.side):
            for weight, nbytes in items:
                _launch(weight, nbytes, mode)
                self.launched += 1
        self.forked = True

    def join(self) -> None:
        """The run's stream waits for the side stream (a capture must end joined)."""
        if self.forked:
            torch.cuda.current_stream().wait_stream(self.side)
            self.forked = False


def attach(prog, device: torch.device) -> Prefetcher | None:
    """Wrap the products of a CUDA program (module docstring); None where nothing would prefetch."""
    if device.type != "cuda":
        return None
    prods = products(prog)
    if len(prods) < 2:
        return None
    pf = Prefetcher(prods, torch.cuda.Stream(device=device))
    for k, p in enumerate(prods):
        op = prog.ops[p.op]
        op.run = pf.wrap(k, op.run)
    return pf
