"""What every attention backend object is: capability flags, the two reasons it may refuse, and `forward`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, NamedTuple

import torch

from ..extras import LayerExtras
from ..metadata import AttentionMetadata


class AttentionBackend:
    """One way of computing paged attention. Objects are made by `AttentionBackends` (attention/dispatch.py), once
    per engine (or per `paged_attention` call), and may keep per-step state (work buffers, plans) in attributes.

    Flags: `prefill` / `decode` (serves steps with prompt rows / with one-token rows), `fp8` (reads scaled fp8
    caches, i.e. applies the per-layer `kv_scales`), `graph_capturable` (a decode step may be recorded once in a CUDA
    graph and replayed: no host-side decision depends on the step's values), `extras` (which of
    extras.EXTRA_NAMES, i.e. attention sinks / ALiBi / attention chunks / relative logits, its `forward` implements:
    the chooser never hands it a layer using any other, and `forward` raises ValueError if called with one).

    Invariant the chooser relies on to memoize: `unsupported_reason` looks at nothing but what `CallKind` records.
    """

    name: ClassVar[str]
    prefill: ClassVar[bool] = True
    decode: ClassVar[bool] = True
    fp8: ClassVar[bool] = False
    graph_capturable: ClassVar[bool] = False
    extras: ClassVar[frozenset] = frozenset()
    strided_pages: ClassVar[bool] = False  # reads caches whose pages are strided apart (not contiguous: kv/cache.py)

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        """Why this backend cannot run on `device` at all (missing library, no such device); None: it can."""
        return None

    def unsupported_reason(self, query: torch.Tensor, key_cache: torch.Tensor, metadata: AttentionMetadata,
                           sliding_window: int | None, softcap: float | None) -> str | None:
        """Why this backend cannot serve this call (None: it can): the flags first, then `layout_reason`."""
        if not self.prefill and metadata.max_query_len != 1:
            return (f"the {self.name} backend serves decode-only steps (max_query_len == 1); this step has prefills "
                    f"(max_query_len={metadata.max_query_len})")
        if not self.decode and metadata.num_decode_tiles:
            return f"the {self.name} backend serves no decode rows; this step has some"
        if key_cache.element_size() == 1 and not self.fp8:
            return (f"the {self.name} backend does not read scaled fp8 caches ({key_cache.dtype}); "
                    "use the torch or triton backend")
        reason = self.layout_reason(query, key_cache, metadata, sliding_window, softcap)
        if reason is None and not self.strided_pages and not key_cache.is_contiguous():
            return (f"the {self.name} backend reads contiguous pages only; this layer's pages are strided apart "
                    f"(a model whose layers keep K/V of different shapes); the torch backend reads them")
        return reason

    def layout_reason(self, query: torch.Tensor, key_cache: torch.Tensor, metadata: AttentionMetadata,
                      sliding_window: int | None, softcap: float | None) -> str | None:
        """Backend-specific rules (dtypes, head sizes, page sizes); None: supported."""
        return None

    def forward(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float, sliding_window: int | None, softcap: float | None,
                key: torch.Tensor | None = None, value: torch.Tensor | None = None,
                kv_scales: tuple[float, float] = (1.0, 1.0), extras: LayerExtras | None = None) -> torch.Tensor:
        """query [T, H, D] -> output [T, H, D] over the pages (this step's K/V already stored). `key` / `value`: the
        new rows' K/V [T, H_kv, D], for backends that can skip re-reading them; `kv_scales`: an fp8 cache's
        (k_scale, v_scale), read only by backends with the `fp8` flag; `extras`: the layer's LayerExtras (only
        those in the `extras` flag; `check_extras`)."""
        raise NotImplementedError

    def check_extras(self, extras: LayerExtras | None) -> None:
        """Raise ValueError when `extras` uses something this backend does not implement (never ignore it)."""
        missing = extras.names() - self.extras if extras is not None else frozenset()
        if missing:
            raise ValueError(f"the {self.name} attention backend does not implement {sorted(missing)} "
                             f"(attention sinks / ALiBi / chunked attention); use the torch or triton backend")


class CallKind(NamedTuple):
    """What decides which backend serves a call: the tensors' devices, dtypes, head shapes, page size and last-dim
    contiguity, the kind of step (has prefills / has decodes) and the layer's features (window / soft-cap set).
    Values never matter, only their presence: one kind covers every layer of that shape of every such step.
    (A NamedTuple: built and hashed on every attention call, ~3x cheaper than a frozen dataclass.)"""

    device: torch.device
    query_dtype: torch.dtype
    cache_dtype: torch.dtype
    heads: int
    head_dim: int
    kv_heads: int
    block_size: int
    cache_device: torch.device
    contiguous_heads: bool
    contiguous_pages: bool
    has_prefills: bool
    has_decodes: bool
    windowed: bool
    softcapped: bool

    @classmethod
    def of(cls, query: torch.Tensor, key_cache: torch.Tensor, metadata: AttentionMetadata,
           sliding_window: int | None, softcap: float | None) -> "CallKind":
        return cls(query.device, query.dtype, key_cache.dtype, query.shape[1], query.shape[-1], key_cache.shape[2],
                   key_cache.shape[1], key_cache.device, query.stride(-1) == 1 and key_cache.stride(-1) == 1,
                   key_cache.is_contiguous(),
                   metadata.max_query_len != 1, metadata.num_decode_tiles > 0, bool(sliding_window), bool(softcap))


@dataclass(slots=True)
class StepCache:
    """Values derived from one step's metadata, built by the step's first layer and reused by its other layers.
    Invariant: `values` were all built from `metadata` (compared by identity: the engine builds a new metadata
    object every step, so a new object means a new step)."""

    metadata: AttentionMetadata | None = None
    values: dict[str, Any] = field(default_factory=dict)

    def get(self, metadata: AttentionMetadata, key: str, build: Callable[[], Any]) -> Any:
        if self.metadata is not metadata:
            self.metadata, self.values = metadata, {}
        if key not in self.values:
            self.values[key] = build()
        return self.values[key]
