"""Choosing attention backends, once.

`choose_backends(name, device)` makes an `AttentionBackends` (the engine makes one per engine); every attention call
then asks it `backend_for(...)` and gets a backend object (attention/backends/). Decisions are memoized per
`CallKind` (dtypes, head shape, page size, whether the step has prefills / decodes, whether the layer has a window /
soft-cap), so a decision is made once per kind of call, not per layer per step, and each backend's availability
(library import, extension build, device) is tried once per chooser.
"""
from __future__ import annotations

import dataclasses

import torch

from ..config import ATTENTION_BACKENDS
from .backends import BACKEND_CLASSES, AttentionBackend, CallKind, backend_class
from .backends.torch_sdpa import TorchBackend
from .extras import LayerExtras
from .metadata import AttentionMetadata

BACKENDS = ATTENTION_BACKENDS
assert BACKENDS == ("auto", *BACKEND_CLASSES), "config.ATTENTION_BACKENDS and the backend classes must list the same names"
# "auto" on an accelerator tries these in order; on CPU it is the torch backend (with the native decode kernel)
AUTO_ORDER = ("flash3", "flashinfer", "flash2", "cuda", "triton", "torch")


def _check_name(name: str) -> None:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {BACKENDS}")


def unavailable(backend: str, device: torch.device) -> str | None:
    """Why `backend` cannot run on `device` at all (None: it can, for some calls)."""
    if backend not in BACKENDS:
        return f"unknown attention backend {backend!r}; choose from {BACKENDS}"
    return None if backend == "auto" else backend_class(backend).unavailable_reason(torch.device(device))


def why_not(name: str, query: torch.Tensor, key_cache: torch.Tensor, metadata: AttentionMetadata,
            sliding_window: int | None, softcap: float | None) -> str | None:
    """None when backend `name` can run this call, else the reason it cannot."""
    _check_name(name)
    cls = backend_class(name)
    reason = cls.unavailable_reason(query.device)
    if reason is None:
        reason = cls().unsupported_reason(query, key_cache, metadata, sliding_window, softcap)
    return reason


class AttentionBackends:
    """Which backend object serves each attention call, for backend setting `name` on `device`.

    A named backend serves every call it covers. One that is available but does not cover a call (e.g. the decode-only
    CUDA kernel on a step with prefills) gives way to "auto" for that call, or raises when `strict`. "auto": on CPU
    the torch backend with the native decode kernel; elsewhere the first of AUTO_ORDER that is available and covers
    the call. (The named "torch" backend is plain torch, the reference: no native kernel.)

    Invariants: `decisions` maps each CallKind seen to the backend that serves it (decided once); `_candidates` holds
    one object per backend name "auto" tried (None: unavailable here, for the reason in `unavailable`), so each
    backend's availability is checked at most once and per-step state lives in one object per backend.
    """

    def __init__(self, name: str, device: torch.device | str, strict: bool = False):
        _check_name(name)
        self.name = name
        self.device = torch.device(device)
        self.strict = strict
        self.decisions: dict[CallKind, AttentionBackend] = {}
        self.unavailable: dict[str, str] = {}
        self._candidates: dict[str, AttentionBackend | None] = {}
        self.named: AttentionBackend | None = None
        if name == "torch":
            self.named = TorchBackend()
        elif name != "auto":
            self.named = self._candidate(name)
            if self.named is None:
                raise ValueError(f"attention_backend {name!r} cannot run on {self.device}: {self.unavailable[name]}")

    def backend_for(self, query: torch.Tensor, key_cache: torch.Tensor, metadata: AttentionMetadata,
                    sliding_window: int | None, softcap: float | None) -> AttentionBackend:
        """The backend object that serves this call (see the class docstring)."""
        kind = CallKind.of(query, key_cache, metadata, sliding_window, softcap)
        backend = self.decisions.get(kind)
        if backend is None:
            backend = self.decisions[kind] = self._decide(query, key_cache, metadata, sliding_window, softcap)
        return backend

    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               metadata: AttentionMetadata, scale: float | None = None, sliding_window: int | None = None,
               softcap: float | None = None, key: torch.Tensor | None = None, value: torch.Tensor | None = None,
               kv_scales: tuple[float, float] = (1.0, 1.0), sinks: torch.Tensor | None = None,
               extras: LayerExtras | None = None) -> torch.Tensor:
        """Paged attention of one layer (see AttentionBackend.forward); `scale` None: head_dim ** -0.5. `extras`:
        the layer's attention sinks / ALiBi slopes / attention chunk (`sinks=` is a shorthand for
        LayerExtras(sinks=...)). A layer using extras runs on the backend chosen for its kind of call when that
        backend implements them (its `extras` flag), otherwise on the torch backend (which implements all)."""
        if scale is None:
            scale = query.shape[-1] ** -0.5
        if sinks is not None:
            extras = dataclasses.replace(extras, sinks=sinks) if extras else LayerExtras(sinks)
        backend = self.backend_for(query, key_cache, metadata, sliding_window, softcap)
        if extras is not None and extras.any():
            if not extras.names() <= backend.extras:
                backend = self._extras_backend(query, key_cache, metadata, sliding_window, softcap, extras.names())
                if not backend.graph_capturable and query.is_cuda and torch.cuda.is_current_stream_capturing():
                    raise RuntimeError(f"a layer with {sorted(extras.names())} runs on the {backend.name} backend, "
                                       f"which cannot be replayed in a CUDA graph")
            return backend.forward(query, key_cache, value_cache, metadata, scale, sliding_window, softcap, key,
                                   value, kv_scales, extras=extras)
        return backend.forward(query, key_cache, value_cache, metadata, scale, sliding_window, softcap, key, value,
                               kv_scales)

    def _decide(self, query, key_cache, metadata, sliding_window, softcap) -> AttentionBackend:
        if self.named is not None:
            reason = self.named.unsupported_reason(query, key_cache, metadata, sliding_window, softcap)
            if reason is None:
                return self.named
            if self.strict:
                raise ValueError(f"attention backend {self.name!r} is not available here: {reason}")
        if self.device.type == "cpu":
            return self._candidate("torch")
        for name in AUTO_ORDER:
            backend = self._candidate(name)
            if backend is not None and backend.unsupported_reason(query, key_cache, metadata, sliding_window,
                                                                  softcap) is None:
                return backend
        return self._candidate("torch")

    def _extras_backend(self, query, key_cache, metadata, sliding_window, softcap, names) -> AttentionBackend:
        """For a layer with extras `names` the chosen backend lacks (cuda, flash*): triton where it implements them and
        can serve the call (a CUDA-graph replay may include it), else torch (which implements all)."""
        if self.device.type != "cpu":
            triton = self._candidate("triton")
            if triton is not None and names <= triton.extras and triton.unsupported_reason(
                    query, key_cache, metadata, sliding_window, softcap) is None:
                return triton
        return self._candidate("torch")

    def _candidate(self, name: str) -> AttentionBackend | None:
        """Backend `name`'s object for this chooser, made on first use; None when it cannot run on the device."""
        if name not in self._candidates:
            cls = backend_class(name)
            reason = cls.unavailable_reason(self.device)
            if reason is not None:
                self.unavailable[name] = reason
                self._candidates[name] = None
            else:
                self._candidates[name] = TorchBackend(native_decode=True) if name == "torch" else cls()
        return self._candidates[name]


def choose_backends(name: str, device: torch.device | str, strict: bool = False) -> AttentionBackends:
    """The chooser for backend setting `name` on `device`. Raises ValueError when `name` is unknown or cannot run on
    `device` at all. `strict=False` (the engine): a named backend gives way to "auto" on calls it does not cover."""
    return AttentionBackends(name, device, strict)
