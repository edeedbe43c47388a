"""pagedkit.runtime.lite: CPU generation in a process that never imports torch (docs/cpu.md, "The torch-free path").

    from pagedkit.runtime.lite import LiteGenerator
    gen = LiteGenerator("model_dir", threads=2)
    print(gen.greedy([1, 5, 9], max_new_tokens=8))

artifact.py: the CPU plan on disk (one onnxruntime model + plan.json) and where it lies; make.py: makes a missing
one (compile.py, in a child process unless torch is imported already); runner.py: LiteGenerator (onnxruntime +
numpy).
"""

from .artifact import LiteUnavailable, find_plan
from .make import ensure_plan
from .runner import LiteGenerator

__all__ = ["LiteGenerator", "LiteUnavailable", "ensure_plan", "find_plan"]
