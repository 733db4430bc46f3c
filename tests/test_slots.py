"""kv/slots.py: a position's flat slot is its block's id x block size + its offset in the block, in lists and tensors
alike."""
import torch

from hf_paged.kv.slots import slot_of, slot_tensor, slots_of

TABLE = [5, 2, 7]  # block ids of positions 0-3, 4-7, 8-11 (block size 4)


def test_slot_of_a_position():
    assert [slot_of(TABLE, p, 4) for p in (0, 3, 4, 9)] == [20, 23, 8, 29]


def test_slots_of_a_range_match_slot_of_each_position():
    assert slots_of(TABLE, 2, 10, 4) == [slot_of(TABLE, p, 4) for p in range(2, 10)]
    assert slots_of(TABLE, 3, 3, 4) == []


def test_slot_tensor_matches_the_list_formula_row_by_row():
    tables = torch.tensor([TABLE, [1, 3, 0]], dtype=torch.int64)
    positions = torch.arange(12, dtype=torch.int64)
    slots = slot_tensor(tables, positions, 4)
    assert slots.tolist() == [slots_of(row, 0, 12, 4) for row in tables.tolist()]
