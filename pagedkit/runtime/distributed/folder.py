"""A tensor-parallel export folder: its genai_config.json's `pagedkit.tensor_parallel` entry (world size, one graph
per rank), read by rank 0 (launch.py) and by every follower (follower.py)."""

from __future__ import annotations

import os
from pathlib import Path

from ...interface.genai_config import read_genai_config, read_pagedkit_section
from ...interface.paths import inside_folder

TP_KEY = "tensor_parallel"


def tp_section(folder: str | os.PathLike) -> dict | None:
    """The tensor_parallel entry of a model folder's genai_config.json (None: a single-device model)."""
    path = Path(folder) / "genai_config.json"
    if not path.is_file():
        return None
    try:
        config = read_genai_config(path)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise ValueError(f"{path}: not a JSON genai_config ({type(exc).__name__})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: genai_config.json must hold a JSON object, got {type(config).__name__}")
    tp = read_pagedkit_section(config).get(TP_KEY)
    if tp is not None and (not isinstance(tp, dict) or not isinstance(tp.get("world_size"), int)
                           or not isinstance(tp.get("ranks"), list) or len(tp["ranks"]) != tp["world_size"]):
        raise ValueError(f"{path}: pagedkit.{TP_KEY} must hold world_size and one file per rank (ranks)")
    return tp


def world_size_of(folder: str | os.PathLike) -> int:
    """1 for a single-device model folder, else its tensor-parallel world size."""
    tp = tp_section(folder)
    return 1 if tp is None else int(tp["world_size"])


def resolve_world(folder: str | os.PathLike, tp: int | None, who: str = "") -> int:
    """The world size to run `folder` with: its tensor-parallel export's, which `tp` must equal when given; 1 for
    a single-device folder (tp None or 1). ValueError naming both otherwise."""
    if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
        raise ValueError(f"{who}tp must be an integer >= 1, got {tp!r}")
    world = world_size_of(folder)
    if tp is not None and tp != world:
        if world == 1:
            raise ValueError(f"{who}{folder} is a single-device export: run it without --tp (or export it for {tp} "
                             f"ranks with paged-export --tp {tp})")
        raise ValueError(f"{who}{folder} is a tensor-parallel export of {world} ranks: run it with --tp {world}")
    return world


def rank_model_path(folder: str | os.PathLike, rank: int, world: int) -> Path:
    """Rank `rank`'s graph of a tensor-parallel folder of `world` ranks (inside the folder, or refused)."""
    tp = tp_section(folder)
    if tp is None:
        raise ValueError(f"{folder}: not a tensor-parallel export (no pagedkit.{TP_KEY} in genai_config.json); "
                         "run it without --tp")
    if tp["world_size"] != world:
        raise ValueError(f"{folder}: a tensor-parallel export of {tp['world_size']} ranks, run with --tp {world}: "
                         f"use --tp {tp['world_size']}")
    return inside_folder(folder, tp["ranks"][rank], f"pagedkit.{TP_KEY}.ranks[{rank}]",
                         str(Path(folder) / "genai_config.json"))
