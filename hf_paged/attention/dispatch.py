"""Backend selection. Every backend module exposes three functions:

    unavailable_reason(device) -> str | None          # None: importable / built / has a device for it
    unsupported_reason(query, key_cache, metadata, sliding_window, softcap) -> str | None
    paged_attention(query, key_cache, value_cache, metadata, scale, sliding_window, softcap) -> output

and is imported only when asked for, so optional dependencies stay optional.
"""
from __future__ import annotations

import importlib

import torch

from ..config import ATTENTION_BACKENDS
from .metadata import AttentionMetadata

MODULES = {
    "torch": "hf_paged.attention.torch_backend",
    "triton": "hf_paged.attention.triton_backend",
    "cuda": "hf_paged.attention.cuda_backend",
    "flash3": "hf_paged.attention.flash_backends.fa3",
    "flash2": "hf_paged.attention.flash_backends.fa2",
    "flashinfer": "hf_paged.attention.flash_backends.flashinfer",
}
BACKENDS = ATTENTION_BACKENDS
assert BACKENDS == ("auto", *MODULES), "config.ATTENTION_BACKENDS and the backend modules must list the same names"
# "auto" on an accelerator tries these in order; on CPU it is the torch backend (with the native decode kernel)
AUTO_ORDER = ("flash3", "flashinfer", "flash2", "cuda", "triton", "torch")


def _module(name: str):
    try:
        return importlib.import_module(MODULES[name])
    except ImportError as e:  # a backend whose module is missing is simply unavailable
        return _Missing(f"{name} backend could not be imported: {e}")


class _Missing:
    def __init__(self, reason: str):
        self.reason = reason

    def unavailable_reason(self, device: torch.device) -> str | None:
        return self.reason


def why_not(name: str, query: torch.Tensor, key_cache: torch.Tensor, metadata: AttentionMetadata,
            sliding_window: int | None, softcap: float | None) -> str | None:
    """None when backend `name` can run this call, else the reason it cannot."""
    module = _module(name)
    reason = module.unavailable_reason(query.device)
    if reason is None:
        reason = module.unsupported_reason(query, key_cache, metadata, sliding_window, softcap)
    return reason


def unavailable(backend: str, device: torch.device) -> str | None:
    """Why `backend` cannot run on `device` at all (None: it can, for some calls)."""
    if backend not in BACKENDS:
        return f"unknown attention backend {backend!r}; choose from {BACKENDS}"
    return None if backend == "auto" else _module(backend).unavailable_reason(device)


def select(backend: str, query: torch.Tensor, key_cache: torch.Tensor, metadata: AttentionMetadata,
           sliding_window: int | None, softcap: float | None, strict: bool = True):
    """The backend module to run. An explicitly requested backend that cannot run is a clear error; with
    `strict=False` (the engine) a backend that is available but does not cover this call (e.g. a decode-only
    kernel on a step with prefills) gives way to "auto" for this call. "auto" falls back along AUTO_ORDER."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose from {BACKENDS}")
    if backend != "auto":
        module = _module(backend)
        reason = module.unavailable_reason(query.device)
        if reason is None:
            reason = module.unsupported_reason(query, key_cache, metadata, sliding_window, softcap)
            if reason is None:
                return module
            if not strict:
                return select("auto", query, key_cache, metadata, sliding_window, softcap)
        raise ValueError(f"attention backend {backend!r} is not available here: {reason}")
    if query.device.type == "cpu":
        return _module("torch")
    for name in AUTO_ORDER:
        if why_not(name, query, key_cache, metadata, sliding_window, softcap) is None:
            return _module(name)
    return _module("torch")
