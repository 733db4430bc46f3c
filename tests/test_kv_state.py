"""kv/state.py: state slots (ids, growth, contents, all-or-nothing allocation) and state checkpoints (LRU, undo)."""
from __future__ import annotations

import pytest
import torch

from hf_paged.kv.state import StateCheckpoints, StateSlots

KEY = (0, "recurrent", 0)


def test_slots_are_handed_out_once_and_grow():
    slots = StateSlots("cpu", capacity=2)
    slots.write(KEY, torch.tensor([0, 1]), torch.tensor([[1.0], [2.0]]))
    taken = [slots.allocate() for _ in range(3)]  # the third doubles the capacity; contents kept
    assert sorted(taken) == [0, 1, 2] and slots.capacity == 4
    assert slots.read(KEY, torch.tensor([0, 1])).tolist() == [[1.0], [2.0]]
    slots.free(taken[0])
    with pytest.raises(ValueError):
        slots.free(taken[0])
    with pytest.raises(AssertionError):
        slots.check_all_free()


def test_slot_allocation_rolls_back():
    slots = StateSlots("cpu", capacity=1)
    kept = slots.allocate()
    slots.begin()
    extra = [slots.allocate(), slots.allocate()]  # grows inside the step
    slots.free(kept)
    slots.rollback()
    assert slots.num_used == 1  # `kept` held again, the step's slots free (the capacity stays grown)
    slots.free(kept)
    slots.check_all_free()
    assert len(set(extra)) == 2


def test_shape_change_is_refused():
    slots = StateSlots("cpu")
    slots.write(KEY, torch.tensor([0]), torch.zeros(1, 3))
    with pytest.raises(ValueError, match="changed shape"):
        slots.write(KEY, torch.tensor([0]), torch.zeros(1, 4))


def test_copy_save_load():
    slots = StateSlots("cpu", capacity=3)
    slots.write(KEY, torch.tensor([0]), torch.tensor([[5.0, 6.0]]))
    slots.copy(0, 1)
    saved = slots.save(1)
    slots.write(KEY, torch.tensor([1]), torch.tensor([[0.0, 0.0]]))
    slots.load(2, saved)
    assert slots.read(KEY, torch.tensor([1, 2])).tolist() == [[0.0, 0.0], [5.0, 6.0]]
    other = StateSlots("cpu", capacity=1)
    other.copy_from(slots, 2, 0)
    assert other.read(KEY, torch.tensor([0])).tolist() == [[5.0, 6.0]]


def test_checkpoints_evict_least_recently_used():
    store = StateCheckpoints("cpu", capacity=2, interval=1)
    a, b = store.reserve(b"a"), store.reserve(b"b")
    assert store.reserve(b"a") is None  # kept already
    assert store.find(b"a") == a  # a is now the most recently used
    c = store.reserve(b"c")
    assert c == b and store.find(b"b") is None and store.find(b"a") == a


def test_a_failed_step_forgets_every_checkpoint_it_assigned():
    """A slot reassigned in a failed step may hold half of the new state: neither its new key nor its old one may
    find it afterwards."""
    store = StateCheckpoints("cpu", capacity=1, interval=1)
    store.begin()
    slot = store.reserve(b"a")
    store.commit()
    store.begin()
    assert store.reserve(b"b") == slot  # evicts a
    store.rollback()
    assert store.find(b"a") is None and store.find(b"b") is None
    store.store.check_all_free()
    store.begin()
    store.reserve(b"c")
    assert store.reserve(b"d") is None  # the only slot is being written in this step: no eviction of it
    store.commit()
    store.clear()
    store.store.check_all_free()


def test_slots_read_in_place_for_a_range():
    """Slots that form a range are read as the slots' own storage (written in place, no copy back); others as a
    copy that `write` stores."""
    slots = StateSlots("cpu", 4)
    key = (0, "recurrent", 0)
    slots.write(key, torch.arange(4), torch.arange(4.0)[:, None].repeat(1, 3))
    ids = torch.tensor([1, 2])
    view = slots.read(key, ids, slice(1, 3))
    view.add_(10)
    slots.write(key, ids, view, slice(1, 3))
    assert slots.tensors[key][:, 0].tolist() == [0, 11, 12, 3]
    copy = slots.read(key, torch.tensor([0, 3]))
    copy.add_(100)
    assert slots.tensors[key][:, 0].tolist() == [0, 11, 12, 3]
    slots.write(key, torch.tensor([0, 3]), copy)
    assert slots.tensors[key][:, 0].tolist() == [100, 11, 12, 103]
