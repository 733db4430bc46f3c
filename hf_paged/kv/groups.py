"""KV cache groups: the attention layers of a model split by what their queries can see, each group with a block table
of its own per request.

A layer that attends through a sliding window of W tokens never reads a slot more than W - 1 positions behind its
query, so its blocks behind the window can go back to the pool while the request runs; a full-attention layer keeps
every block. One block table cannot serve both, so layers are grouped by window, and every group has its own table.

All groups draw from ONE block pool, and a block id names the same amount of memory whichever group holds it: every
group has the same number of layers (`group_size`, the smallest count of layers sharing a window), and the KV storage
is `group_size` layer tensors, layer `position` of a group living in tensor `position` (`KVCacheSpec.position_of`).
Kinds of layers whose count is not a multiple of `group_size` leave the last group of that kind partly empty (its
missing positions are memory no layer uses). A model whose attention layers all share one window (or none) has one
group holding all of them: the layout is then one tensor per layer, as if there were no groups.

Invariants: groups are ordered by their first layer; every attention layer is in exactly one group; a group's layers
share its `window` and `chunk`. A chunked-attention group (llama4) gives back the blocks before its query's chunk, as a
sliding group those behind its window.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVGroup:
    """Layers (ascending) that share a block table; `window`: the sliding window every one of them applies, `chunk`:
    the attention chunk (llama4's chunked attention: a query sees its own chunk only); both None: full attention,
    every block kept."""

    layers: tuple[int, ...]
    window: int | None = None
    chunk: int | None = None

    @property
    def full(self) -> bool:
        return self.window is None and self.chunk is None

    def first_needed(self, position: int) -> int:
        """The first slot a query at `position` (or later) can read: 0 for full attention."""
        return first_needed(position, self.window, self.chunk)


def first_needed(position: int, window: int | None, chunk: int | None) -> int:
    """The first slot a query at `position` (or later) reads through `window` and / or in chunks of `chunk`."""
    first = 0
    if window is not None:
        first = max(position - window + 1, 0)
    if chunk is not None:
        first = max(first, position // chunk * chunk)
    return first


def plan_groups(kinds_of: dict[int, int | None | tuple]) -> tuple[KVGroup, ...]:
    """Groups for attention layers whose kinds are `kinds_of` (layer -> sliding window, None for full attention, or
    (window, chunk))."""
    if not kinds_of:
        return ()
    kinds: dict[tuple, list[int]] = {}
    for layer in sorted(kinds_of):
        kind = kinds_of[layer] if isinstance(kinds_of[layer], tuple) else (kinds_of[layer], None)
        kinds.setdefault(kind, []).append(layer)
    if len(kinds) == 1:
        ((kind, layers),) = kinds.items()
        return (KVGroup(tuple(layers), *kind),)
    size = min(len(layers) for layers in kinds.values())
    groups = [KVGroup(tuple(layers[i:i + size]), *kind) for kind, layers in kinds.items()
              for i in range(0, len(layers), size)]
    return tuple(sorted(groups, key=lambda group: group.layers[0]))


def group_size(groups: tuple[KVGroup, ...]) -> int:
    """Layer tensors of the KV storage: the most layers any group holds."""
    return max((len(group.layers) for group in groups), default=0)
