"""Per-request state of state layers (linear attention, Mamba, short convolutions): one slot per running request.

A state layer keeps no K/V per token: each sequence carries fixed-size tensors (a convolution window, a recurrent
state) that every step reads and replaces. They live in `StateSlots`: for each (layer, kind, state index) one tensor
[num_slots, *shape], created at the first write with the shape and dtype the model produced, and grown (doubled) when
more slots are in use than it holds. A slot's tensors mean something only after a forward pass wrote them; a sequence
starting from token 0 reads no state (`fresh`), exactly as the model's own forward without a previous state.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

StateKey = tuple  # (layer index, "conv" | "recurrent", state index)


class StateSlots:
    """Slot ids handed out and freed like blocks, and the state tensors indexed by them.

    Invariants: a slot id is held by at most one sequence; `free` never touches the tensors (a slot handed out again
    is read only after a forward pass wrote it, or not at all while its holder is `fresh`). `begin` / `commit` /
    `rollback` make a step's allocations all or nothing (the tensors' contents are not put back: whoever rolls back
    must recompute the sequences whose state a failed forward may have written)."""

    def __init__(self, device: torch.device, capacity: int = 8):
        self.device = torch.device(device)
        self.capacity = max(1, int(capacity))
        self.tensors: dict[StateKey, torch.Tensor] = {}
        self._free = list(range(self.capacity - 1, -1, -1))  # popped from the end: slot 0 first
        self._saved: tuple | None = None

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    # ---- ids ------------------------------------------------------------------------------------------------
    def allocate(self) -> int:
        if not self._free:
            self._grow(self.capacity * 2)
        return self._free.pop()

    def free(self, slot: int) -> None:
        if slot < 0 or slot >= self.capacity or slot in self._free:
            raise ValueError(f"state slot {slot} is not held")
        self._free.append(slot)

    def release(self) -> None:
        """Give the tensors' memory back; they are made again at the next write. Only with every slot free (no
        sequence's state is read again)."""
        self.check_all_free()
        self.tensors.clear()

    def check_all_free(self) -> None:
        if len(self._free) != self.capacity:
            raise AssertionError(f"{self.num_used} state slots still held")

    def begin(self) -> None:
        self._saved = (list(self._free), self.capacity)

    def commit(self) -> None:
        self._saved = None

    def rollback(self) -> None:
        if self._saved is not None:
            free, capacity = self._saved
            # a grown capacity stays (the tensors are bigger); the slots added by the growth are free again
            self._free = list(range(self.capacity - 1, capacity - 1, -1)) + free
            self._saved = None

    @torch.inference_mode()
    def _grow(self, capacity: int) -> None:
        for key, tensor in self.tensors.items():
            bigger = tensor.new_empty((capacity, *tensor.shape[1:]))  # (not zeroed: see `write`)
            bigger[:self.capacity] = tensor
            self.tensors[key] = bigger
        self._free = list(range(capacity - 1, self.capacity - 1, -1)) + self._free
        self.capacity = capacity

    # ---- contents -------------------------------------------------------------------------------------------
    def read(self, key: StateKey, slots: torch.Tensor, span: slice | None = None) -> torch.Tensor | None:
        """The states of `slots` ([B] long, on the device) as a new tensor [B, *shape]; None if never written. With
        `span` (the same slots as a range: `slots` is `arange(span.start, span.stop)`) the slots' own storage instead:
        writing it writes the slots."""
        tensor = self.tensors.get(key)
        if tensor is None:
            return None
        return tensor[span] if span is not None else tensor.index_select(0, slots)

    def write(self, key: StateKey, slots: torch.Tensor, values: torch.Tensor, span: slice | None = None) -> None:
        """Store `values` [B, *shape] into `slots` (the tensor for `key` is made at the first write); nothing to do
        when `values` is the slots' own storage (`read` with their `span`)."""
        tensor = self.tensors.get(key)
        if tensor is None:
            # not zeroed (every slot is written before it is read, see the class): a tensor for every slot the
            # engine may hold can be large (128 sequences' recurrent states), and untouched pages cost no memory
            tensor = self.tensors[key] = values.new_empty((self.capacity, *values.shape[1:]))
        elif tensor.shape[1:] != values.shape[1:] or tensor.dtype != values.dtype:
            raise ValueError(f"state {key} changed shape or dtype: {tuple(tensor.shape[1:])} {tensor.dtype} -> "
                             f"{tuple(values.shape[1:])} {values.dtype}")
        if span is not None and values.data_ptr() == tensor[span].data_ptr() and values.stride() == tensor.stride():
            return  # the slots' own storage, written in place
        tensor.index_copy_(0, slots, values.to(tensor.device))

    @torch.inference_mode()
    def copy(self, source: int, destination: int) -> None:
        """A fork: `destination` gets `source`'s state."""
        for tensor in self.tensors.values():
            tensor[destination].copy_(tensor[source])

    @torch.inference_mode()
    def copy_from(self, other: "StateSlots", source: int, destination: int) -> None:
        """`destination` gets slot `source` of `other` (a checkpoint restored for a prefix hit)."""
        for key, tensor in other.tensors.items():
            if key not in self.tensors:
                self.tensors[key] = tensor.new_zeros((self.capacity, *tensor.shape[1:]))
            self.tensors[key][destination].copy_(tensor[source])

    @torch.inference_mode()
    def save(self, slot: int) -> dict[StateKey, torch.Tensor]:
        """A copy of one slot's state in host memory (preemption by swap)."""
        return {key: tensor[slot].to("cpu", copy=True) for key, tensor in self.tensors.items()}

    @torch.inference_mode()
    def load(self, slot: int, saved: dict[StateKey, torch.Tensor]) -> None:
        for key, value in saved.items():
            self.tensors[key][slot].copy_(value)


class StateCheckpoints:
    """The state after some prompt blocks, kept so that a later request whose prompt starts with the same blocks can
    start from there (a prefix hit on a model with state layers needs the state at the hit point, not only K/V).

    Block key (the prefix chain hash of the block, `KVCacheManager._hashes`) -> slot of `store` (fixed capacity),
    least recently used dropped first. `reserve` assigns a slot for a block a step is about to compute; the forward
    pass writes it. A slot assigned in a step that is rolled back leaves the map (its contents are unknown), and so
    does whatever key it held before."""

    def __init__(self, device: torch.device, capacity: int, interval: int):
        self.store = StateSlots(device, capacity)
        self.interval = interval  # checkpoint every `interval`-th block boundary of a prompt
        self.keys: OrderedDict[bytes, int] = OrderedDict()
        self._saved: tuple | None = None
        self._assigned: set[int] = set()  # slots (re)assigned since `begin`

    def find(self, key: bytes) -> int | None:
        slot = self.keys.get(key)
        if slot is not None:
            self.keys.move_to_end(key)
        return slot

    def reserve(self, key: bytes) -> int | None:
        """A slot for the state after block `key` (None: it is kept already)."""
        if key in self.keys:
            return None
        if self.store._free:
            slot = self.store.allocate()
        else:
            oldest = next((k for k, s in self.keys.items() if s not in self._assigned), None)
            if oldest is None:
                return None  # every slot is being written in this step
            slot = self.keys.pop(oldest)
        self.keys[key] = slot
        if self._saved is not None:  # inside a step: written by its forward pass
            self._assigned.add(slot)
        return slot

    def forget(self, key: bytes) -> None:
        """Drop the state kept after block `key` (a forward pass that went non-finite may have written it)."""
        slot = self.keys.pop(key, None)
        if slot is not None:
            self.store.free(slot)

    def clear(self) -> None:
        for slot in self.keys.values():
            self.store.free(slot)
        self.keys.clear()

    def begin(self) -> None:
        self._saved = (OrderedDict(self.keys), list(self.store._free))
        self._assigned = set()

    def commit(self) -> None:
        self._saved = None
        self._assigned = set()

    def rollback(self) -> None:
        if self._saved is None:
            return
        keys, free = self._saved
        self.keys, self.store._free = keys, free
        for key in [k for k, s in self.keys.items() if s in self._assigned]:
            self.store.free(self.keys.pop(key))
        self._saved, self._assigned = None, set()
