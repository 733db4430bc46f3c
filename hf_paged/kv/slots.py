"""Where a position's K/V lives: the one formula that turns a block table and a position into a flat slot index
(block id x block size + offset in the block) of a layer's [num_blocks * block_size, heads, head_dim] pages."""
from __future__ import annotations

import torch


def slot_of(table: list[int], position: int, block_size: int) -> int:
    return table[position // block_size] * block_size + position % block_size


def slots_of(table: list[int], start: int, stop: int, block_size: int) -> list[int]:
    """The slots of positions [start, stop) of one sequence."""
    return [table[p // block_size] * block_size + p % block_size for p in range(start, stop)]


def slot_tensor(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The same for tensors: `tables` [..., blocks] (int64) indexed by `positions` (int64) along its last
    dimension."""
    return tables[..., positions // block_size] * block_size + positions % block_size
