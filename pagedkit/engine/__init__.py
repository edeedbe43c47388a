"""Continuous-batching generation engine over paged ONNX models (see docs/engine.md)."""

from .engine import Engine, EngineStats
from .params import RequestOutput, SamplingParams
from .sampling import ngram_draft, sample_token

__all__ = ["Engine", "EngineStats", "RequestOutput", "SamplingParams", "ngram_draft", "sample_token"]
