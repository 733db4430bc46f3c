"""Per-request block tables on top of the block pool, with prefix reuse."""
from __future__ import annotations

from typing import Protocol

from .block_pool import NULL_BLOCK, Block, BlockPool
from .groups import KVGroup, first_needed
from .hashing import hash_block
from .prefix_hits import find_hits, group_key
from .state import StateCheckpoints, StateSlots
from .tables import blocks_needed, copy_on_write, held, release_leading, released_prefix


class BlockHolder(Protocol):
    """What the manager reads and keeps per sequence (a `Request` is one). The manager owns `block_tables` (one per
    KV group, or none while the sequence holds no memory), `block_hashes` and `num_published_blocks`; it only reads
    the token ids and `num_computed_tokens`."""

    block_tables: list[list[int]]
    block_hashes: list[bytes]
    num_published_blocks: int
    stale_kv: bool  # holds K/V computed before the context changed: never published (see `set_context`)
    state_slot: int  # its slot in `states` while it holds memory (models with state layers), else -1
    all_token_ids: list[int]
    num_computed_tokens: int

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def cache_salt(self) -> str | None: ...


class KVCacheManager:
    """Grows and releases each request's block tables, one per KV group (logical block i -> physical block id), all
    drawing from one block pool: the coordinator of the groups.

    Invariants: a request's tables each cover `num_computed_tokens + scheduled new tokens` slots after a successful
    `allocate_slots`, and it holds none after `free`. Only full blocks whose tokens are all computed are ever hashed,
    so a shared block is never written again; a group's blocks are found under that group's keys only. The manager
    never changes a sequence's `num_computed_tokens` (the scheduler does); it tells the scheduler how many tokens a
    prefix hit covers (the same for every group). Blocks whose memory must be cleared before use (never used yet, or
    last held by a request whose K/V went non-finite) are reported once by `take_blocks_to_clear` when handed out.
    A group whose layers attend through a sliding window (`windows[g]`) or in chunks (`chunks[g]`; both switched off
    with None) gives back the blocks
    behind it (`release_behind`): their table entries become the null block (never counted, never freed), always a
    leading run of that group's table. A prefix hit serves a sliding group with only the blocks its window sees.

    On a model with state layers (`states`), every sequence that holds blocks also holds one state slot: taken when
    it is admitted or forked (a fork's slot gets a copy of its parent's state), given back by `free`. A prefix hit
    there also needs the state at the hit point: hits end at a block whose state was checkpointed (`checkpoints`,
    written by the forward pass that computed the block: `reserve_checkpoints`); without checkpoints, no hits.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 states: StateSlots | None = None, checkpoints: StateCheckpoints | None = None,
                 groups: tuple[KVGroup, ...] | None = None):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.groups = tuple(groups) if groups else (KVGroup(()),)
        self.windows: list[int | None] = [group.window for group in self.groups]  # release behind (None: keep all)
        self.chunks: list[int | None] = [group.chunk for group in self.groups]  # release before the query's chunk
        self.max_chunk: int | None = None  # the most tokens a step computes for one sequence (None: not bounded)
        self.states = states
        self.checkpoints = checkpoints if states is not None and enable_prefix_caching else None
        self.enable_prefix_caching = enable_prefix_caching and (states is None or self.checkpoints is not None)
        self.hit_tokens = 0
        self.query_tokens = 0
        self._fresh: list[int] = []  # handed out since the last take_blocks_to_clear() and not clean
        self._clean = bytearray(num_blocks + 1)  # 1: the block's memory holds finite values
        self._clean[NULL_BLOCK] = 1  # cleared once when the cache is created (see take_blocks_to_clear)
        self._copies: list[tuple[int, int]] = []  # copy-on-write (source, destination) not yet executed
        self._saved: tuple | None = None  # what `rollback` restores besides the pool (see `begin`)
        self._context: object = None  # what produced the cached K/V (weights, adapters, scales): see `set_context`
        self._root: bytes | None = None  # the chain's root key for this context
        self._contexts = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def tables(self, request: BlockHolder) -> list[list[int]]:
        """The request's tables, one per group (made empty for one that holds nothing)."""
        if not request.block_tables:
            request.block_tables = [[] for _ in self.groups]
        return request.block_tables

    def _span(self, group: int) -> int | None:
        """The most slots before a query a releasing group's queries read (None: the group keeps every block)."""
        spans = [size - 1 for size in (self.windows[group], self.chunks[group]) if size is not None]
        return min(spans) if spans else None

    def group_bound(self, group: int, num_tokens: int) -> int:
        """The most blocks a sequence of `num_tokens` tokens holds at once in `group`: every one, or in a group that
        gives blocks back behind its window or chunk (with `max_chunk`, the most tokens one step computes for a
        sequence, set), the span its queries read, one step's chunk, one partly covered and the last published one."""
        count = blocks_needed(num_tokens, self.block_size)
        span = self._span(group)
        if span is None or self.max_chunk is None:
            return count
        return min(count, blocks_needed(span + self.max_chunk, self.block_size) + 2)

    def blocks_for(self, num_tokens: int) -> int:
        """The most block ids a sequence of `num_tokens` tokens holds at once, over all groups."""
        return sum(self.group_bound(g, num_tokens) for g in range(len(self.groups)))

    # ---- all or nothing ------------------------------------------------------------------------------------
    def begin(self) -> None:
        """Record from now on (see `BlockPool.begin`); the pending lists and the clean flags are copied."""
        self.pool.begin()
        if self.states is not None:
            self.states.begin()
        if self.checkpoints is not None:
            self.checkpoints.begin()
        self._saved = (list(self._fresh), list(self._copies), bytes(self._clean), self.hit_tokens, self.query_tokens)

    def commit(self) -> None:
        self.pool.commit()
        if self.states is not None:
            self.states.commit()
        if self.checkpoints is not None:
            self.checkpoints.commit()
        self._saved = None

    def rollback(self) -> set[int]:
        """Put the pool and this manager back as they were at `begin` (the sequences' own fields are the caller's to
        restore). Returns the blocks handed out meanwhile: their memory may have been written (cleared, copied into,
        swapped into, or by a forward pass), so they count as not clean and are out of the prefix map; a sequence
        that holds one after the caller's restore must not trust its contents."""
        allocated = self.pool.rollback()
        if self.states is not None:
            self.states.rollback()
        if self.checkpoints is not None:
            self.checkpoints.rollback()
        if self._saved is not None:
            fresh, copies, clean, self.hit_tokens, self.query_tokens = self._saved
            self._fresh, self._copies, self._clean = fresh, copies, bytearray(clean)
            self._saved = None
        for block_id in allocated:
            self._clean[block_id] = 0
        return allocated

    # ---- prefix reuse ----------------------------------------------------------------------------
    def context_changed(self, context: object) -> bool:
        """Whether `context` (compared with ==; a fresh `object()` always differs) differs from the one in force. The
        first context ever given is taken as in force (nothing has been computed yet)."""
        if not self._contexts:
            self._context, self._contexts = context, 1
            return False
        return context != self._context

    def set_context(self, context: object) -> None:
        """Say what produces K/V from now on. Every cached block leaves the prefix map and keys start from a new root,
        so no K/V produced before is ever found again. The caller first marks the sequences holding K/V as
        `stale_kv` (they never publish again) and drops the keys of those holding none. The new context is recorded
        last: if this is interrupted, the next call finds the change again and finishes it."""
        for block in list(self.pool.cached.values()):
            self.pool.uncache(block.block_id)
        if self.checkpoints is not None:
            self.checkpoints.clear()
        self._root = (self._contexts + 1).to_bytes(16, "little")
        self._contexts += 1
        self._context = context

    def _hashes(self, request: BlockHolder, count: int) -> list[bytes]:
        """The chain keys of the request's first `count` full blocks (computed once, extended lazily)."""
        bs, keys, tokens = self.block_size, request.block_hashes, request.all_token_ids
        while len(keys) < count:
            i = len(keys)
            keys.append(hash_block(keys[-1] if keys else self._root, tokens[i * bs:(i + 1) * bs], request.cache_salt))
        return keys[:count]

    def computed_blocks(self, request: BlockHolder) -> list[tuple[Block | None, ...]]:
        """Cached blocks serving the request's leading full blocks (see `prefix_hits.find_hits`). The last token is
        always left to compute so that there are logits to sample from."""
        if not self.enable_prefix_caching:
            return []
        keys = self._hashes(request, (request.num_tokens - 1) // self.block_size)
        return find_hits(self.pool, self.groups, self.block_size, keys, request.all_token_ids,
                         None if self.states is None else self.checkpoints)

    def common_prefix_blocks(self, request: BlockHolder, other: BlockHolder) -> int:
        """How many leading full prompt blocks two requests share (same salt, same tokens)."""
        bs = self.block_size
        count = min(request.num_prompt_tokens, other.num_prompt_tokens) // bs
        if count == 0 or self._hashes(request, 1)[0] != self._hashes(other, 1)[0]:
            return 0
        mine, theirs = self._hashes(request, count), self._hashes(other, count)
        shared = 0
        while shared < count and mine[shared] == theirs[shared]:
            shared += 1
        return shared

    def can_admit(self, request: BlockHolder, hits: list[tuple[Block | None, ...]]) -> bool:
        """Whether blocks for the whole of `request` fit (in a releasing group, the most it holds at once: see
        `group_bound`), counting hits that would leave the free queue."""
        revived = sum(1 for row in hits for block in row if block is not None and block.ref_count == 0)
        need = 0
        for g in range(len(self.groups)):
            taken = sum(1 for row in hits if row[g] is not None)
            need += max(self.group_bound(g, request.num_tokens) - taken, 0)
        return need <= self.pool.num_free_blocks - revived

    def admit(self, request: BlockHolder, hits: list[tuple[Block | None, ...]]) -> int:
        """Start the request's tables with its prefix hits. Returns how many tokens they hold (computed already)."""
        self.pool.touch([block for row in hits for block in row if block is not None])
        request.block_tables = [[NULL_BLOCK if row[g] is None else row[g].block_id for row in hits]
                                for g in range(len(self.groups))]
        self.take_state_slot(request)
        if hits and self.states is not None:  # the state at the hit point, from its checkpoint
            source = self.checkpoints.find(request.block_hashes[len(hits) - 1])
            self.states.copy_from(self.checkpoints.store, source, request.state_slot)
        return len(hits) * self.block_size

    def reserve_checkpoints(self, request: BlockHolder, num_new_tokens: int) -> list[tuple[int, int]]:
        """Checkpoints the step that runs `num_new_tokens` of `request` is to write: (tokens into the step's rows
        of the request after which the state is taken, checkpoint slot), for each prompt block boundary it crosses
        that is an `interval`-th one, and whose state is not kept already. (Each cut splits a prefill into separate
        calls of the state modules: boundaries are taken sparingly.)"""
        if self.checkpoints is None or request.stale_kv:
            return []
        bs, start = self.block_size, request.num_computed_tokens
        found = []
        for block in range(start // bs + 1, min(start + num_new_tokens, request.num_prompt_tokens) // bs + 1):
            if block % self.checkpoints.interval:
                continue
            slot = self.checkpoints.reserve(self._hashes(request, block)[-1])
            if slot is not None:
                found.append((block * bs - start, slot))
        return found

    def take_state_slot(self, request: BlockHolder) -> None:
        """Give `request` a state slot if the model has state layers and it holds none."""
        if self.states is not None and request.state_slot < 0:
            request.state_slot = self.states.allocate()

    def count_lookup(self, request: BlockHolder, num_hit_tokens: int) -> None:
        """Hit / query counters, once per admission that went through."""
        if self.enable_prefix_caching:
            self.query_tokens += request.num_tokens
            self.hit_tokens += num_hit_tokens

    def cache_full_blocks(self, request: BlockHolder) -> None:
        """Publish the request's newly completed blocks to the prefix map, in every group."""
        if not self.enable_prefix_caching or request.stale_kv:
            return
        full = request.num_computed_tokens // self.block_size
        if full <= request.num_published_blocks:
            return
        bs, tokens = self.block_size, request.all_token_ids
        keys = self._hashes(request, full)
        blocks = self.pool.blocks
        for g, table in enumerate(self.tables(request)):
            for i in range(request.num_published_blocks, full):
                parent = blocks[table[i - 1]] if i > 0 else None
                if table[i] == NULL_BLOCK or (parent is not None and parent.block_hash is None):
                    # released (a swapped-in request's window), or its parent is not findable (released, or its key
                    # already served by another block): no lookup could reach it, so it must not take the key
                    continue
                self.pool.cache(table[i], group_key(g, keys[i]), tokens[i * bs:(i + 1) * bs], parent)
        request.num_published_blocks = full

    # ---- growth and release ------------------------------------------------------------------------
    def num_new_blocks(self, request: BlockHolder, num_new_tokens: int) -> int:
        total = blocks_needed(request.num_computed_tokens + num_new_tokens, self.block_size)
        tables = request.block_tables or [[] for _ in self.groups]
        return sum(max(0, total - len(table)) + (self._shared_write_block(request, table) is not None)
                   for table in tables)

    def _shared_write_block(self, request: BlockHolder, table: list[int]) -> int | None:
        """Index in `table` of the block the next token goes to, if other requests share it."""
        index = request.num_computed_tokens // self.block_size
        if index < len(table) and self.pool.blocks[table[index]].ref_count > 1:
            return index
        return None

    def fork(self, parent: BlockHolder, child: BlockHolder) -> None:
        """Give `child` the parent's tables (one more reference on every block); the caller gives it the parent's
        computed length."""
        tables = self.tables(parent)
        self.pool.touch([self.pool.blocks[i] for table in tables for i in held(table)])
        child.block_tables = [list(table) for table in tables]
        child.block_hashes = list(parent.block_hashes)
        child.num_published_blocks = parent.num_published_blocks
        child.stale_kv = parent.stale_kv
        if self.states is not None:
            self.take_state_slot(child)
            self.states.copy(parent.state_slot, child.state_slot)

    def take_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write block copies to run before the next forward pass."""
        copies, self._copies = self._copies, []
        return copies

    def current_contents(self, block_ids: list[int]) -> list[int]:
        """Where the contents of `block_ids` are before this step's copy-on-write copies run: a pending copy's
        destination holds nothing yet, its source (still intact until the forward pass) holds the data. A request
        swapped out in the step that gave it a private copy must be saved from the source."""
        sources = {destination: source for source, destination in self._copies}
        return [sources.get(b, b) for b in block_ids]

    def allocate_slots(self, request: BlockHolder, num_new_tokens: int) -> bool:
        """Extend every table to hold `num_new_tokens` more tokens; a block the request shares and is about to write
        is first replaced by a private copy. Returns False (and changes nothing) when the pool cannot cover it."""
        if self.num_new_blocks(request, num_new_tokens) > self.pool.num_free_blocks:
            return False
        total = blocks_needed(request.num_computed_tokens + num_new_tokens, self.block_size)
        for table in self.tables(request):
            shared = self._shared_write_block(request, table)
            if shared is not None:
                self._copies.append(copy_on_write(self.pool, table, shared))
            if total > len(table):
                ids = self.pool.allocate(total - len(table))
                table.extend(ids)
                self._fresh.extend(b for b in ids if not self._clean[b])
        return True

    def allocate_blocks(self, count: int) -> list[int]:
        """`count` new blocks outside any table growth (a swapped request's way back in). Callers check room."""
        ids = self.pool.allocate(count)
        self._fresh.extend(b for b in ids if not self._clean[b])
        return ids

    def take_blocks_to_clear(self) -> list[int]:
        """Blocks handed out since the last call whose memory must be cleared before the next forward pass
        (masked slots are read too, so they must never hold NaN). Each is reported once; it counts as clean
        from then on, since only finite K/V are ever written to it afterwards."""
        fresh, self._fresh = self._fresh, []
        for b in fresh:
            self._clean[b] = 1
        return fresh

    def discard_contents(self, request: BlockHolder) -> None:
        """The request's K/V may be non-finite (its forward pass went wrong): take its blocks out of the prefix
        map, so no later request hits them, and clear each again before it is next handed out. Blocks it shares
        with running requests keep serving them untouched (they are cleared only once handed out anew)."""
        for g, table in enumerate(request.block_tables):
            for block_id in held(table):
                self.pool.uncache(block_id)
                self._clean[block_id] = 0
            for key in request.block_hashes[:released_prefix(table)]:  # released blocks stay in the prefix map
                block = self.pool.cached.get(group_key(g, key))
                if block is not None:
                    self.pool.uncache(block.block_id)
        if self.checkpoints is not None:  # the states its pass cut at its block boundaries may be non-finite too
            for key in request.block_hashes:
                self.checkpoints.forget(key)

    def distrust_tail(self, request: BlockHolder) -> None:
        """A failed forward pass may have written past the request's computed tokens: the block holding its next slot
        is cleared before it is next handed out (the request itself overwrites those slots before reading them)."""
        index = request.num_computed_tokens // self.block_size
        for table in request.block_tables:
            if index < len(table) and table[index] != NULL_BLOCK:
                self._clean[table[index]] = 0

    def free(self, request: BlockHolder) -> None:
        for table in request.block_tables:
            self.pool.free(held(table))
        request.block_tables = []
        request.num_published_blocks = 0
        if getattr(request, "state_slot", -1) >= 0:
            self.states.free(request.state_slot)
            request.state_slot = -1

    def release_behind(self, request: BlockHolder, position: int) -> int:
        """In each group with a window or chunks, give back the blocks holding only slots its queries from `position` on never
        read; their entries become the null block. Only published blocks go (they stay in the prefix map, free to
        serve a later hit until evicted), so the prefix chain of the ones still to publish is intact. They count as
        not clean: a forward pass may have written non-finite K/V into them that no sampled row has revealed yet (a
        prompt's chunks), so each is cleared before it is handed out again. Returns how many blocks went back."""
        released = 0
        for g, table in enumerate(request.block_tables):
            window, chunk = self.windows[g], self.chunks[g]
            if window is None and chunk is None:
                continue
            count = first_needed(position, window, chunk) // self.block_size
            if self.enable_prefix_caching and not request.stale_kv:  # the last published block stays: the next one
                count = min(count, request.num_published_blocks - 1)  # to publish chains to it (a stale one: none)
            if count <= 0:
                continue
            gone = release_leading(self.pool, table, count)
            for block in gone:
                self._clean[block] = 0
            released += len(gone)
        return released

