"""What one forward pass needs to read and write the paged KV cache. Built once per engine step."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .extras import allowed as allowed_mask


@dataclass(slots=True)
class DenseTile:
    """Sequences of one step padded to a common query length, for backends that compute on dense tiles.

    `query_index[g, j]` is the packed row of query token j of sequence g (0 for padding);
    `valid` selects the real entries of the flattened [G * max_query_len] tile, `rows` where they go.
    `allowed[(window, chunk)]` is a bool mask [G, 1, max_query_len, kv_len] (bottom-right causal, context length,
    optional sliding window and attention chunk), built on first use and kept for the other layers of the step.
    """

    query_index: torch.Tensor
    valid: torch.Tensor
    rows: torch.Tensor
    block_tables: torch.Tensor  # [G, max_blocks] int64
    flat_tables: torch.Tensor  # the same, flattened, for one index_select per cache
    query_start: torch.Tensor  # absolute position of each sequence's first query token [G, 1]
    query_lens: torch.Tensor  # [G, 1]
    context_lens: torch.Tensor  # [G, 1]
    max_query_len: int
    kv_len: int
    allowed: dict = field(default_factory=dict)

    def positions(self) -> torch.Tensor:
        """Absolute position of every query slot [G, max_query_len] (padding slots continue past the last)."""
        return self.query_start + torch.arange(self.max_query_len, device=self.block_tables.device)[None, :]

    def mask(self, sliding_window: int | None, chunk_size: int | None = None) -> torch.Tensor:
        key = (sliding_window or 0, chunk_size or 0)
        if key not in self.allowed:
            device = self.block_tables.device
            k_pos = torch.arange(self.kv_len, device=device)
            mask = allowed_mask(self.positions(), k_pos, sliding_window, chunk_size)  # [G, Q, L]
            padded_query = torch.arange(self.max_query_len, device=device)[None, :] >= self.query_lens
            mask |= padded_query[:, :, None]  # padding rows attend to everything; their output is dropped
            self.allowed[key] = mask[:, None]  # [G, 1, Q, L]: broadcast over heads
        return self.allowed[key]


@dataclass(slots=True)
class AttentionMetadata:
    """Packed varlen description of one step.

    Token rows of all sequences are packed along one axis (T = cu_seqlens_q[-1]). Sequence b owns rows
    cu_seqlens_q[b]:cu_seqlens_q[b+1]; its cache holds context_lens[b] tokens after this step's writes,
    so its queries sit at the bottom-right of its causal mask. `slot_mapping[t]` is the flat cache slot
    (block_id * block_size + offset) that row t writes.
    """

    cu_seqlens_q: torch.Tensor  # int32 [B + 1]
    context_lens: torch.Tensor  # int32 [B]
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    slot_mapping: torch.Tensor  # int64 [T]
    max_query_len: int
    max_context_len: int
    block_size: int
    tiles: list[DenseTile] = field(default_factory=list)  # see decode_tiles / other_tiles
    fresh: list[tuple[int, int]] = field(default_factory=list)  # row ranges of prompts with no cached context
    num_decode_tiles: int = 0  # once built, the first tiles are the decodes, split by context length
    _pending_decodes: list[list[int]] = field(default_factory=list)  # decode tiles whose plans are not built yet
    _decodes: DenseTile | None = None
    _decode_tables: tuple | None = None  # (block tables, context lengths) as int64, for kernels (`decode_tables`)
    _lists: tuple = ()  # (decode members, cu, query_lens, context_lens, block_tables) for building plans

    def _build(self, members: list[int]) -> DenseTile:
        _, cu, query_lens, context_lens, tables = self._lists
        return _plan(members, cu, query_lens, context_lens, tables, self.block_size, self.block_tables.device)

    def decode_tiles(self) -> list[DenseTile]:
        """The decodes split by context length (for backends that pad a tile to its longest member). Built
        on first use: a backend that handles ragged lengths asks for `all_decodes` instead."""
        if self._pending_decodes:
            self.tiles = [self._build(m) for m in self._pending_decodes] + self.tiles
            self._pending_decodes = []
        return self.tiles[:self.num_decode_tiles]

    def other_tiles(self) -> list[DenseTile]:
        """The dense tile of chunked / resumed prefills (at most one)."""
        return self.tiles if self._pending_decodes else self.tiles[self.num_decode_tiles:]

    def all_decodes(self) -> DenseTile | None:
        """Every decode of the step in ONE tile (kernels that handle ragged lengths need no length split).
        `rows` lists the packed rows in order, so when it covers all T rows it is arange(T)."""
        if self._decodes is None and self.num_decode_tiles:
            if self.num_decode_tiles == 1:
                self._decodes = self.decode_tiles()[0]
            else:
                self._decodes = self._build(self._lists[0])
        return self._decodes

    def decode_tables(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a step of decodes only (every sequence one query row, so row b is sequence b's): the block tables
        [B, >= max_blocks] and context lengths [B] as int64; None for any other step. What a kernel that reads each
        sequence's pages up to its length needs. Where the step's one decode tile exists (a decode graph's static
        plan, refreshed in place every step, or one built already), its own tensors; else int64 copies of the
        step's tables, made once (a step's metadata from `build` never changes), without building the tile (whose
        table is cut to the longest context: the columns past it are padding either way)."""
        if self.max_query_len != 1 or not self.num_decode_tiles:
            return None
        if not self._pending_decodes and self.num_decode_tiles == 1:  # a tile given (a decode graph's static plan,
            tile = self.tiles[0]  # whose tensors are refreshed in place every step) or built already: its own
            return tile.block_tables, tile.context_lens.view(-1)
        if self._decode_tables is None:  # built once: a step's own metadata is not changed after `build`
            self._decode_tables = (self.block_tables.long(), self.context_lens.long())
        return self._decode_tables

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
              slot_mapping: list[int], block_size: int, device: torch.device) -> "AttentionMetadata":
        """From per-sequence Python lists. Three kinds of sequences are planned separately so that no
        kind pads another: decodes (1 query token) form one dense tile; fresh prompts (nothing cached
        before this step) are listed in `fresh` and attend over their own new K/V; the rest (chunked
        or resumed prefills) form a second dense tile over their pages."""
        num_seqs = len(query_lens)
        cu = [0]
        for q in query_lens:
            cu.append(cu[-1] + q)
        max_blocks = max(len(t) for t in block_tables)
        tables = [t + [0] * (max_blocks - len(t)) for t in block_tables]
        meta = cls(
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            max_query_len=max(query_lens),
            max_context_len=max(context_lens),
            block_size=block_size,
        )
        decode = [i for i in range(num_seqs) if query_lens[i] == 1]
        fresh = [i for i in range(num_seqs) if 1 < query_lens[i] == context_lens[i]]
        longer = [i for i in range(num_seqs) if 1 < query_lens[i] < context_lens[i]]
        meta.fresh = [(cu[i], cu[i + 1]) for i in fresh]
        decode_tiles = _split_by_length(decode, context_lens) if decode else []
        meta.num_decode_tiles = len(decode_tiles)
        meta._lists = (decode, cu, query_lens, context_lens, block_tables)
        meta._pending_decodes = decode_tiles
        if longer:
            meta.tiles.append(_plan(longer, cu, query_lens, context_lens, block_tables, block_size, device))
        return meta


def _split_by_length(members: list[int], context_lens: list[int], min_tile: int = 8,
                     min_saving: float = 0.15) -> list[list[int]]:
    """Decodes padded to one length waste reads on the short ones. Sorted by context length, a tile is
    halved (recursively) while that saves at least `min_saving` of its padded K/V reads."""
    if len(members) < 2 * min_tile:
        return [members]
    ordered = sorted(members, key=context_lens.__getitem__)
    half = len(ordered) // 2
    whole = len(ordered) * context_lens[ordered[-1]]
    split = half * context_lens[ordered[half - 1]] + (len(ordered) - half) * context_lens[ordered[-1]]
    if split > (1 - min_saving) * whole:
        return [members]
    return [*_split_by_length(ordered[:half], context_lens), *_split_by_length(ordered[half:], context_lens)]


def _plan(members, cu, query_lens, context_lens, block_tables, block_size, device) -> DenseTile:
    if all(query_lens[i] == 1 for i in members):
        return _decode_plan(members, cu, context_lens, block_tables, block_size, device)
    return _dense_plan(members, cu, query_lens, context_lens, block_tables, block_size, device)


def _dense_plan(members, cu, query_lens, context_lens, block_tables, block_size, device) -> DenseTile:
    max_q = max(query_lens[i] for i in members)
    max_blocks = max(-(-context_lens[i] // block_size) for i in members)
    index, valid, rows, tables = [], [], [], []
    for i in members:
        q = query_lens[i]
        seq_rows = list(range(cu[i], cu[i] + q))
        index.append(seq_rows + [0] * (max_q - q))
        valid.extend([True] * q + [False] * (max_q - q))
        rows.extend(seq_rows)
        table = block_tables[i][:max_blocks]
        tables.append(table + [0] * (max_blocks - len(table)))

    def column(values):
        return torch.tensor(values, dtype=torch.int64, device=device)[:, None]

    block_tables = torch.tensor(tables, dtype=torch.int64, device=device)
    return DenseTile(
        query_index=torch.tensor(index, dtype=torch.int64, device=device),
        valid=torch.tensor(valid, dtype=torch.bool, device=device),
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        block_tables=block_tables,
        flat_tables=block_tables.reshape(-1),
        query_start=column([context_lens[i] - query_lens[i] for i in members]),
        query_lens=column([query_lens[i] for i in members]),
        context_lens=column([context_lens[i] for i in members]),
        max_query_len=max_q,
        kv_len=max_blocks * block_size,
    )


def _decode_plan(members, cu, context_lens, block_tables, block_size, device) -> DenseTile:
    """`_dense_plan` of decodes only (one query row each; the same tensors), from two host-to-tensor copies instead
    of nine: a decode step builds one every step, and on a small model these copies are a visible part of it."""
    max_blocks = max(-(-context_lens[i] // block_size) for i in members)
    rows = [cu[i] for i in members]
    tables = [block_tables[i][:max_blocks] + [0] * (max_blocks - len(block_tables[i][:max_blocks])) for i in members]
    lists = torch.tensor([rows, [context_lens[i] for i in members]], dtype=torch.int64, device=device)
    row_index, lengths = lists[0], lists[1][:, None]
    block_tables = torch.tensor(tables, dtype=torch.int64, device=device)
    return DenseTile(
        query_index=row_index[:, None], valid=torch.ones(len(members), dtype=torch.bool, device=device),
        rows=row_index, block_tables=block_tables, flat_tables=block_tables.reshape(-1), query_start=lengths - 1,
        query_lens=torch.ones_like(lengths), context_lens=lengths, max_query_len=1, kv_len=max_blocks * block_size)
