"""The continuous-batching engine: scheduler (owns the KV manager and every change of a request's state),
runner (a step's plan -> packed inputs -> one forward -> logits), decode CUDA graphs, and the engine's step."""
from .engine import Engine

__all__ = ["Engine"]
