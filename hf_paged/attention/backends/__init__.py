"""The attention backends, one module per backend, each defining one `AttentionBackend` class.

A backend's module is imported only when that backend is asked for (`backend_class`), so optional libraries
(triton, flash-attn, flashinfer) stay optional and the Triton kernels are defined only once TRITON_INTERPRET has
been decided. A module that fails to import gives a stand-in class whose `unavailable_reason` is the import error.
"""
from __future__ import annotations

import importlib

from .base import AttentionBackend, CallKind, StepCache

# backend name -> "module:class" (modules relative to this package)
BACKEND_CLASSES = {
    "torch": "torch_sdpa:TorchBackend",
    "triton": "triton_varlen:TritonBackend",
    "cuda": "cuda:CudaBackend",
    "flash3": "fa3:FlashAttention3Backend",
    "flash2": "fa2:FlashAttention2Backend",
    "flashinfer": "flashinfer:FlashInferBackend",
}


def backend_class(name: str) -> type[AttentionBackend]:
    """The class of backend `name` (a key of BACKEND_CLASSES), importing its module now."""
    module_name, class_name = BACKEND_CLASSES[name].split(":")
    try:
        module = importlib.import_module(f"{__name__}.{module_name}")
    except ImportError as e:
        return missing_backend(name, f"{name} backend could not be imported: {e}")
    return getattr(module, class_name)


def missing_backend(name: str, reason: str) -> type[AttentionBackend]:
    """A stand-in class for a backend whose module cannot be imported: never available, for `reason`."""
    def unavailable_reason(cls, device) -> str:
        return reason

    return type(f"Missing_{name}", (AttentionBackend,), {"name": name,
                                                          "unavailable_reason": classmethod(unavailable_reason)})


__all__ = ["AttentionBackend", "CallKind", "StepCache", "BACKEND_CLASSES", "backend_class", "missing_backend"]
