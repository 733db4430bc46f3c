"""Paged K/V for a rectangular batch that a caller drives position by position (HF's own generate loop).

Every row of the batch has a block table into one shared `BlockPool`; all layers use the same tables (a block id
names the same page in every layer's storage). Rows share blocks by reference count (`select_rows`: beam
reordering, repeat-interleave, batch selection) and a row copies a shared block only when it writes into it
(copy-on-write), so beams that descend from one hypothesis hold their common past once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .block_pool import NULL_BLOCK, BlockPool
from .tables import blocks_needed, copy_on_write, held, release_leading
from .slots import slot_tensor


@dataclass(slots=True)
class LayerPages:
    """One layer's pages: K and V shaped [num_blocks + 1, block_size, num_kv_heads, head_dim] (block 0 = null)."""

    keys: torch.Tensor
    values: torch.Tensor

    @property
    def num_bytes_per_block(self) -> int:
        per = self.keys[0].numel() * self.keys.element_size()
        return per + self.values[0].numel() * self.values.element_size()


@dataclass(slots=True, frozen=True)
class PagedKV:
    """What a layer's update hands an attention that reads the pages in place (the "paged_cache" implementation),
    instead of a gathered copy: this call's new K and V ([rows, heads, new, head_dim], already written) and where the
    layer's whole K/V live: slots [0, length) of every row of `store`'s pages of `layer`. Deliberately not a tensor:
    any other use of it fails loudly instead of computing on the new tokens alone."""

    new_keys: torch.Tensor
    new_values: torch.Tensor
    store: "PagedStore"
    layer: int
    length: int

    @property
    def pages(self) -> LayerPages:
        return self.store.layers[self.layer]

    def gathered(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V as [rows, heads, length, head_dim] copies (what a DynamicCache would hold)."""
        return self.store.read(self.layer, self.length)


class PagedStore:
    """Block tables for `num_rows` rows and the pages of every layer.

    Invariants: every row's table covers at least `capacity(row)` slots of which the first `length` (the caller's
    count for each layer) hold that layer's K/V, except the first `num_released_blocks` entries of every table: those
    were given back (`release_before`, a sliding window that will not read them again) and name the null block; a
    block id appears `ref_count` times over all tables; the null block appears nowhere else. `num_blocks=None` grows the pool (doubling) when it runs out; a fixed pool raises
    `MemoryError` instead.
    """

    def __init__(self, block_size: int = 16, num_blocks: int | None = None, initial_blocks: int = 64):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.growable = num_blocks is None
        self.pool = BlockPool(num_blocks if num_blocks is not None else initial_blocks)
        self.layers: dict[int, LayerPages] = {}
        self.tables: list[list[int]] = []
        self.num_released_blocks = 0  # leading entries of every table given back to the pool (now the null block)
        self._table_tensor: torch.Tensor | None = None  # cached [rows, max_blocks] table, rebuilt when tables change

    # ---- rows -------------------------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return len(self.tables)

    def set_num_rows(self, num_rows: int) -> None:
        """The first write fixes the batch size; an empty store may change it freely."""
        if num_rows != self.num_rows:
            if any(self.tables):
                raise ValueError(f"the cache holds {self.num_rows} rows; got a batch of {num_rows}")
            self.tables = [[] for _ in range(num_rows)]
            self._tables_changed()

    def select_rows(self, rows: list[int]) -> None:
        """New row i is old row `rows[i]` (rows may repeat or be dropped); blocks are shared, never copied."""
        new_tables = [list(self.tables[r]) for r in rows]
        for table in new_tables:
            self._take(table)
        for table in self.tables:
            self.pool.free(held(table))
        self.tables = new_tables
        self._tables_changed()

    def release_before(self, position: int) -> None:
        """Give back, in every row, the blocks that hold only slots before `position` (a sliding window's queries from
        `position` on never read them); their table entries become the null block, which reads as zeros."""
        count = max(position, 0) // self.block_size
        if count <= self.num_released_blocks:
            return
        for table in self.tables:
            release_leading(self.pool, table, count)
        self.num_released_blocks = count
        self._tables_changed()

    @property
    def num_released_tokens(self) -> int:
        """Slots [0, num_released_tokens) of every row are gone (`release_before`)."""
        return self.num_released_blocks * self.block_size

    def truncate(self, num_tokens: int) -> None:
        """Keep only the blocks that slots [0, num_tokens) need in every row; the rest go back to the pool."""
        keep = blocks_needed(max(num_tokens, 0), self.block_size)
        self.num_released_blocks = min(self.num_released_blocks, keep)
        for table in self.tables:
            if len(table) > keep:
                self.pool.free(held(table[keep:]))
                del table[keep:]
        self._tables_changed()

    def clear(self) -> None:
        for table in self.tables:
            self.pool.free(held(table))
        self.tables = [[] for _ in self.tables]
        self.num_released_blocks = 0
        self._tables_changed()

    # ---- memory -----------------------------------------------------------------------------------------------
    @property
    def num_blocks_in_use(self) -> int:
        return len({block for table in self.tables for block in table} - {NULL_BLOCK})

    @property
    def num_bytes_per_block(self) -> int:
        return sum(layer.num_bytes_per_block for layer in self.layers.values())

    @property
    def num_bytes_in_use(self) -> int:
        """Bytes of the distinct blocks the tables hold, over all layers (shared blocks count once)."""
        return self.num_blocks_in_use * self.num_bytes_per_block

    # ---- writes and reads -------------------------------------------------------------------------------------
    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
        """Store `keys` / `values` ([rows, heads, new, head_dim]) at slots [start, start + new) of every row."""
        rows, _, new, _ = keys.shape
        self.set_num_rows(rows)
        pages = self._pages(layer, keys, values)
        self._reserve(start + new)
        self._unshare(start, start + new)
        slots = self._slots(start, start + new).reshape(-1)
        flat_k = pages.keys.view(-1, *pages.keys.shape[2:])
        flat_v = pages.values.view(-1, *pages.values.shape[2:])
        flat_k.index_copy_(0, slots, keys.transpose(1, 2).reshape(-1, *flat_k.shape[1:]).to(flat_k.dtype))
        flat_v.index_copy_(0, slots, values.transpose(1, 2).reshape(-1, *flat_v.shape[1:]).to(flat_v.dtype))

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots [0, length) of every row as contiguous [rows, heads, length, head_dim] K and V: a copy gathered whole
        blocks at a time (each a contiguous page), then laid out heads-first and contiguous like DynamicCache's
        tensors (some models `.view` them)."""
        pages = self.layers[layer]
        table = self.table_tensor(pages.keys.device)[:, :blocks_needed(length, self.block_size)]

        def gather(storage: torch.Tensor) -> torch.Tensor:
            blocks = storage.index_select(0, table.reshape(-1))  # index_select: a memcpy per block on CPU
            rows = blocks.view(table.shape[0], -1, *storage.shape[2:])[:, :length]  # [rows, length, heads, dim]
            return rows.transpose(1, 2).contiguous()

        return gather(pages.keys), gather(pages.values)

    def table_tensor(self, device: torch.device) -> torch.Tensor:
        """[rows, max_blocks] int32 block tables, padded with the null block."""
        if self._table_tensor is None or self._table_tensor.device != device:
            width = max((len(t) for t in self.tables), default=0)
            padded = [t + [NULL_BLOCK] * (width - len(t)) for t in self.tables]
            self._table_tensor = torch.tensor(padded, dtype=torch.long, device=device).reshape(len(padded), width)
        return self._table_tensor

    # ---- internals --------------------------------------------------------------------------------------------
    def _pages(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> LayerPages:
        pages = self.layers.get(layer)
        if pages is None:
            shape = (self.pool.num_blocks + 1, self.block_size, keys.shape[1])
            pages = LayerPages(torch.zeros(*shape, keys.shape[3], dtype=keys.dtype, device=keys.device),
                               torch.zeros(*shape, values.shape[3], dtype=values.dtype, device=values.device))
            self.layers[layer] = pages
        elif pages.keys.shape[2:] != (keys.shape[1], keys.shape[3]):
            raise ValueError(f"layer {layer}: K/V of {tuple(keys.shape[1:2] + keys.shape[3:])} heads x dim, "
                             f"the cache holds {tuple(pages.keys.shape[2:])}")
        return pages

    def _tables_changed(self) -> None:
        self._table_tensor = None

    def _slots(self, start: int, stop: int) -> torch.Tensor:
        """[rows, stop - start] flat slot indices of positions [start, stop) (every table covers `stop`)."""
        device = next(iter(self.layers.values())).keys.device
        positions = torch.arange(start, stop, device=device)
        table = self.table_tensor(device)
        return slot_tensor(table, positions, self.block_size)

    def _take(self, table: list[int]) -> None:
        for block_id in held(table):
            self.pool.blocks[block_id].ref_count += 1

    def _allocate(self, count: int) -> list[int]:
        if count > self.pool.num_free_blocks:
            if not self.growable:
                raise MemoryError(f"the PagedCache pool has {self.pool.num_free_blocks} free blocks, "
                                  f"{count} are needed; give it more num_blocks")
            self._grow(max(self.pool.num_blocks, count))
        return self.pool.allocate(count)

    def _grow(self, extra: int) -> None:
        self.pool.grow(extra)
        for pages in self.layers.values():
            pages.keys = torch.cat([pages.keys, pages.keys.new_zeros(extra, *pages.keys.shape[1:])])
            pages.values = torch.cat([pages.values, pages.values.new_zeros(extra, *pages.values.shape[1:])])

    def _reserve(self, num_tokens: int) -> None:
        need = blocks_needed(num_tokens, self.block_size)
        for table in self.tables:
            if len(table) < need:
                table.extend(self._allocate(need - len(table)))
                self._tables_changed()

    def _unshare(self, start: int, stop: int) -> None:
        """Copy-on-write: a row about to write into a block that other rows also hold gets its own copy (every
        layer's page is copied: the other layers' earlier slots of the block are part of this row's past)."""
        first, last = start // self.block_size, blocks_needed(stop, self.block_size)
        for table in self.tables:
            for index in range(first, last):
                block_id = table[index]
                if block_id == NULL_BLOCK:
                    raise RuntimeError(f"slot {start} is in a block given back to the pool (released before "
                                       f"{self.num_released_tokens})")
                copied = copy_on_write(self.pool, table, index, self._allocate)
                if copied is not None:
                    source, copy = copied
                    for pages in self.layers.values():
                        pages.keys[copy] = pages.keys[source]
                        pages.values[copy] = pages.values[source]
                    self._tables_changed()
