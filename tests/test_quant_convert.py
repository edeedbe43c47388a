"""The packed cache-code conversions of the decode kernel (_decode_kernels._ASM_*: int8 / fp8 / int4 -> float16 by
inline asm in the load's layout).

- GPU: every byte value through each conversion, in a 2-D tile, against torch's own decoding of the codes.
- CPU: the attention kernel compiled for sm_90 (ptxas and nvdisasm ship with Triton) reads no cache tile back
  from shared memory one byte per load (what the plain conversions compiled to), and the packed conversion is
  what runs; with the asm off (PAGEDKIT_QUANT_ASM=0's path) the byte loads are back (the check has teeth).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")



@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4-lo", "int4-hi"])
def test_asm_conversion_every_code(fmt):
    import triton.language as tl

    from pagedkit.kernels.triton import _decode_kernels as K

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    tile = codes[torch.randperm(256 * 64, device="cpu") % 256].reshape(128, 128).cuda()  # every byte, shuffled
    F = {"int8": 1, "fp8": 2}.get(fmt, 3)

    @triton.jit
    def kern(x_ptr, o_ptr, FMT: tl.constexpr, HIGH: tl.constexpr, R: tl.constexpr):
        r = tl.arange(0, R)
        offs = r[:, None] * R + r[None, :]
        x = tl.load(x_ptr + offs)
        if FMT == 1:
            x = x.to(tl.int8, bitcast=True)
        tl.store(o_ptr + offs, K._values(x, FMT, HIGH, tl.float16, False, True))

    out = torch.full((128, 128), float("nan"), dtype=torch.float16, device="cuda")
    kern[(1,)](tile, out, FMT=F, HIGH=fmt == "int4-hi", R=128, num_warps=4)
    if fmt == "int8":
        ref = tile.view(torch.int8).float()
    elif fmt == "fp8":
        ref = tile.view(torch.float8_e4m3fn).float()
    elif fmt == "int4-lo":
        ref = (tile & 15).float() - 8
    else:
        ref = (tile >> 4).float() - 8
    got = out.float()
    both_nan = torch.isnan(ref) & torch.isnan(got)  # fp8 e4m3fn's two NaN codes
    assert torch.equal(torch.where(both_nan, 0.0, got), torch.where(both_nan, 0.0, ref)), fmt


def _sass(fmt: str, asm: str) -> str:
    """The SASS, compiled in a child process: the interpreter (TRITON_INTERPRET=1, set for the CPU tests) wraps
    the kernels in objects that cannot be compiled for a GPU target."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, os.path.join(root, "tests", "_sm90_sass.py"), fmt, asm or "0"],
                          capture_output=True, text=True, check=True, env=env).stdout


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_sm90_code_reads_no_cache_bytes_from_shared(fmt):
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    if not os.path.exists(nvdisasm) or shutil.which("ld") is None:
        pytest.skip("Triton's NVIDIA tools (ptxas / nvdisasm) are not installed")
    sass = _sass(fmt, "v")
    byte_loads = re.findall(r"\bLDS\.[US]8\b", sass)
    assert not byte_loads, f"{len(byte_loads)} byte-wide shared loads"
    marker = "PRMT" if fmt == "int8" else "F2FP.F16.E4M3.UNPACK_B"
    assert marker in sass and "HMMA" in sass
    # teeth: the plain conversions compile to byte-wide shared loads of the V tile
    if fmt == "int8":
        assert len(re.findall(r"\bLDS\.[US]8\b", _sass(fmt, "0"))) >= 64
