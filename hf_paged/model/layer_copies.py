"""The weight copies of `fused_layers`' decoder layers: each layer's seven projection weights joined (q/k/v and
gate/up each as one weight) and laid out for the product that multiplies them, and the checks that keep them equal to
their weights.

Invariants:
- Layouts: fp32 weights transposed ([in, out], MKL's plain product: `torch.mm` / `addmm`), or packed by oneDNN
  (`onednn`: bf16 weights always, fp32 ones where `fused_layers` measures that variant); a layer holds at most one copy
  of each layout (`_COPIES`: transposed fp32 or packed bf16, `_ONEDNN`: packed fp32), both in packed_linear's budget.
- A copy is used only while it matches its weights: each weight's storage, address, shape, strides and version counter
  on every call (`copies_for`), sample runs of every weight before each forward (`Samples.check`: a mismatch drops the
  model's copies). No copy holds a view of a weight.
"""
from __future__ import annotations

import functools
import weakref

import torch

from . import packed_linear

DTYPES = (torch.float32, torch.bfloat16)
_COPIES: "weakref.WeakKeyDictionary[torch.nn.Module, LayerCopies]" = weakref.WeakKeyDictionary()  # layer -> copy
_ONEDNN: "weakref.WeakKeyDictionary[torch.nn.Module, LayerCopies]" = weakref.WeakKeyDictionary()  # fp32, oneDNN
packed_linear.EXTRA_STORES.extend([_COPIES, _ONEDNN])


def layer_shape(weights: list[torch.Tensor]) -> tuple:
    """(hidden, each projection's out features): the trial key's shape."""
    return (weights[0].shape[1], *(w.shape[0] for w in weights))


def _copy_kind(weight: torch.Tensor):
    """How a weight of this dtype is copied: fp32 transposed (MKL's plain product), bf16 packed by oneDNN."""
    return packed_linear.TRANSPOSED if weight.dtype is torch.float32 else None


def copyable(weight: torch.Tensor, dtype: torch.dtype) -> bool:
    if weight.dtype is not dtype or dtype not in DTYPES or (dtype is torch.bfloat16 and not packed_linear.supported()):
        return False
    return packed_linear.weight_packable(weight, _copy_kind(weight))


class LayerCopies:
    """A layer's seven weights joined (q/k/v and gate/up each as one weight): fp32 ones transposed ([in, out] each,
    side by side) unless `onednn`, bf16 ones (and fp32 ones with `onednn`) packed by oneDNN; with a
    `packed_linear.PackedCopy` record of what each was made from (its `packed`: for a transposed copy the view of that
    weight's columns)."""
    __slots__ = ("qkv", "o", "gate_up", "down", "widths", "records", "nbytes", "shape", "onednn", "__weakref__")

    def __init__(self, weights: list[torch.Tensor], onednn: bool = False):
        self.onednn = onednn or weights[0].dtype is not torch.float32
        with torch.no_grad():
            q, k, v, o, gate, up, down = (w.detach() for w in weights)
            if self.onednn:
                pack = functools.partial(torch.ops.mkldnn._reorder_linear_weight, batch_size=packed_linear.BATCH_HINT)
                self.qkv, self.o, self.gate_up, self.down = pack(torch.cat([q, k, v])), pack(o), \
                    pack(torch.cat([gate, up])), pack(down)
            else:
                self.qkv, self.o = torch.cat([q, k, v]).t().contiguous(), o.t().contiguous()
                self.gate_up, self.down = torch.cat([gate, up]).t().contiguous(), down.t().contiguous()
        nq, nk, ni = q.shape[0], k.shape[0], gate.shape[0]
        self.widths = (nq, nk, ni)
        if self.onednn:  # records only: what each weight was when packed (no view of it)
            views = [torch.empty(0, dtype=torch.float32)] * 7
        else:
            views = [self.qkv[:, :nq], self.qkv[:, nq:nq + nk], self.qkv[:, nq + nk:], self.o, self.gate_up[:, :ni],
                     self.gate_up[:, ni:], self.down]
        self.records = [packed_linear.PackedCopy(w, packed_linear.TRANSPOSED, made=view)
                        for w, view in zip(weights, views)]
        self.nbytes = sum(packed_linear._packed_bytes(t, t) for t in (self.qkv, self.o, self.gate_up, self.down))
        self.shape = layer_shape(weights)

    def matches(self, weights: list[torch.Tensor]) -> bool:
        return all(record.matches(w) for record, w in zip(self.records, weights))


def copies_for(layer: torch.nn.Module, weights: list[torch.Tensor], onednn: bool = False) -> LayerCopies | None:
    """`layer`'s copies of `weights` as they are now (made again if they changed), or None: over the budget, or
    weights a copy does not take (`copyable`: no longer fp32 / bf16 CPU parameters, ...). `onednn`: fp32 weights
    packed by oneDNN (kept apart from their transposed copies)."""
    onednn = onednn and weights[0].dtype is torch.float32
    store = _ONEDNN if onednn else _COPIES
    copies = store.get(layer)
    if copies is not None and copies.matches(weights):
        return copies
    if not all(copyable(w, weights[0].dtype) for w in weights):  # cast, moved, ...
        return None
    with packed_linear._LOCK:
        store.pop(layer, None)
        need = sum(w.numel() * w.element_size() for w in weights)
        if sum(c.nbytes for c in packed_linear._all_copies()) + need > packed_linear._budget_bytes():
            return None
        try:
            copies = LayerCopies(weights, onednn)
        except (RuntimeError, MemoryError):
            return None
        store[layer] = copies
        return copies


def forget(layers, stores: tuple = (_COPIES, _ONEDNN)) -> int:
    with packed_linear._LOCK:
        return sum(store.pop(layer, None) is not None for layer in layers for store in stores)


class Samples:
    """The sample runs of the copied weights of some layers (`check`), with the views and the values they were
    copied with kept between forwards while the same copies live (joined again when they change)."""

    def __init__(self):
        self.seen: list = []  # weak references to the LayerCopies the views below were taken for
        self.views: list[torch.Tensor] = []
        self.values: torch.Tensor | None = None

    def check(self, layers: list, projections_of: list) -> bool:
        """True when every sample run of the copied weights of `layers` (whose projections are `projections_of`)
        holds its value when copied; else their copies are all dropped (made again on use). A copy whose weight now
        has other storage is dropped alone (it would be made again on its next call anyway)."""
        live = [(layer, c, mods) for store in (_COPIES, _ONEDNN) for layer, mods in zip(layers, projections_of)
                if (c := store.get(layer)) is not None]
        moved = [layer for layer, c, mods in live
                 if not all(r.same_storage(m.weight) for r, m in zip(c.records, mods))]
        if moved:
            forget(moved)
            live = [entry for entry in live if entry[0] not in moved]
        if not live:
            self.seen, self.views, self.values = [], [], None
            return True
        if len(live) != len(self.seen) or any(ref() is not c for ref, (_, c, _) in zip(self.seen, live)):
            self.seen = [weakref.ref(c) for _, c, _ in live]
            self.views = [v for _, c, mods in live for r, m in zip(c.records, mods) for v in r.sample_views(m.weight)]
            self.values = torch.cat([r.values for _, c, _ in live for r in c.records])
        if torch.equal(packed_linear._bits(torch.cat(self.views)), self.values):
            return True
        self.seen, self.views, self.values = [], [], None
        forget(layers)
        return False


