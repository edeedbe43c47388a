"""Tensor-parallel execution on torch.distributed (NCCL on CUDA, gloo on the CPU): a set of N ranks on this
machine, each running its rank's graph of a `paged-export --tp N` folder (docs/distributed.md).

- group.py: the process group the collective ops (runtime/ops/collectives.py) run on, with its timeouts;
- launch.py: `TensorParallel(N)`: this process is rank 0, N - 1 followers are spawned; `tp.session(folder)`;
- session.py: `DistributedSession`, rank 0's session: each run is broadcast first;
- follower.py: what the other ranks do; messages.py: what travels between them.
"""

from .group import TPError
from .launch import TensorParallel, rank_model_path, resolve_world, tp_section, world_size_of
from .session import DistributedSession

__all__ = ["DistributedSession", "TPError", "TensorParallel", "rank_model_path", "resolve_world", "tp_section", "world_size_of"]
