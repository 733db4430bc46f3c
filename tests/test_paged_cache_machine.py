"""A stateful (hypothesis) model of a `PagedCache` driven the way HF's loops drive it: writes of one or more positions
to every layer, beam reorders, repeat-interleave and batch selection (rows shared by reference count, copied on
write), crops (assisted decoding's rollbacks, with and without `activate_past_recording`), on full-attention,
all-sliding (mistral) and mixed (gemma2) layer stacks with small windows and blocks.

The model keeps, per row, the value written at every position of every layer (each write a fresh number), and
checks after every rule: what each layer reads back is exactly its row's values at every position its next query can
see (a released slot reads as zero), a crop that would need released slots raises and changes nothing, every block's
reference count is its number of appearances in the tables, the null block is never counted nor freed, the pool's
free count balances, and a sliding window holds no block wholly behind it once it has moved on (unless recording).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hf_paged import PagedCache
from hf_paged.kv import NULL_BLOCK, blocks_needed
from hf_paged.tiny import tiny_config

MAX_ROWS = 6


class PagedCacheMachine(RuleBasedStateMachine):
    @initialize(arch=st.sampled_from(["llama", "mistral", "gemma2"]), window=st.integers(2, 7),
                block_size=st.integers(1, 4), rows=st.integers(1, 3))
    def setup(self, arch, window, block_size, rows):
        self.window = None if arch == "llama" else window
        config = tiny_config(arch, **({} if arch == "llama" else {"sliding_window": window}))
        self.cache = PagedCache(config, block_size=block_size)
        self.num_layers = len(self.cache.layers)
        self.rows = [[[] for _ in range(self.num_layers)] for _ in range(rows)]  # row -> layer -> values
        self.counter = 0
        self.floor = 0  # a sliding window must have released every block wholly before this slot, and no other
        self.null_ref_count = self.cache.store.pool.blocks[NULL_BLOCK].ref_count

    # ---- helpers ------------------------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        return len(self.rows[0][0])

    def visible_from(self, layer, position: int) -> int:
        """HF's window: a query at p sees keys p - window + 1 .. p."""
        return max(0, position - self.window + 1) if layer.sliding_window else 0

    def window_start(self, position: int) -> int:
        return max(0, position - self.window + 1) if self.window else 0

    def recording(self) -> bool:
        return any(layer.record_past for layer in self.cache.layers)

    def check_read(self, layer_index: int, keys: torch.Tensor, values: torch.Tensor, first_query: int) -> None:
        """keys / values [rows, 1, length, 2]: every slot the queries from `first_query` on may see holds its row's
        value; released slots read as zero."""
        layer = self.cache.layers[layer_index]
        start = self.visible_from(layer, first_query)
        released = layer.store.num_released_tokens
        assert released <= start or not layer.sliding_window, (released, start)
        for row, per_layer in enumerate(self.rows):
            expected = torch.tensor(per_layer[layer_index][start:], dtype=torch.float32)
            torch.testing.assert_close(keys[row, 0, start:, 0], expected, rtol=0, atol=0)
            torch.testing.assert_close(values[row, 0, start:, 1], -expected, rtol=0, atol=0)
            assert not keys[row, 0, :released].any()

    # ---- rules ----------------------------------------------------------------------------------------------------
    @rule(new=st.integers(1, 5))
    def write(self, new):
        start = self.length
        for layer_index in range(self.num_layers):
            block = torch.zeros(len(self.rows), 1, new, 2)
            for row, per_layer in enumerate(self.rows):
                fresh = [float(self.counter + i + 1) for i in range(new)]
                self.counter += new
                per_layer[layer_index].extend(fresh)
                block[row, 0, :, 0] = torch.tensor(fresh)
                block[row, 0, :, 1] = -torch.tensor(fresh)
            keys, values = self.cache.update(block, block.clone(), layer_index)
            self.check_read(layer_index, keys, values, start)
        if not self.recording():
            self.floor = max(self.floor, self.window_start(start))
        if any(store.num_released_blocks for store in self.cache.stores):
            event("write: a window has released blocks")
        if any(store.pool.blocks[b].ref_count > 1 for store in self.cache.stores for t in store.tables for b in t
               if b != NULL_BLOCK):
            event("write: rows share blocks")

    @precondition(lambda self: self.length > 0)
    @rule(data=st.data())
    def reorder(self, data):
        picks = data.draw(st.lists(st.integers(0, len(self.rows) - 1), min_size=len(self.rows),
                                   max_size=len(self.rows)))
        self.cache.reorder_cache(torch.tensor(picks))
        self.rows = [[list(values) for values in self.rows[p]] for p in picks]

    @precondition(lambda self: self.length > 0)
    @rule(data=st.data())
    def select(self, data):
        picks = data.draw(st.lists(st.integers(0, len(self.rows) - 1), min_size=1, max_size=MAX_ROWS))
        self.cache.batch_select_indices(torch.tensor(picks))
        self.rows = [[list(values) for values in self.rows[p]] for p in picks]

    @precondition(lambda self: self.length > 0)
    @rule(repeats=st.integers(1, 3))
    def repeat(self, repeats):
        if len(self.rows) * repeats > MAX_ROWS:
            return
        self.cache.batch_repeat_interleave(repeats)
        self.rows = [[list(values) for values in row] for row in self.rows for _ in range(repeats)]

    @rule(remove=st.integers(0, 6))
    def crop(self, remove):
        new_length = max(0, self.length - remove)
        # the model's own account: refused when the next query would see a slot released by the rules above
        blocked = self.window_start(new_length) < self.floor // self.cache.block_size * self.cache.block_size
        before = [(s.num_blocks_in_use, s.pool.num_free_blocks, [list(t) for t in s.tables]) for s in self.cache.stores]
        event(f"crop: {'refused' if blocked else 'done'}")
        if blocked:
            with pytest.raises(RuntimeError, match="sliding window"):
                self.cache.crop(-remove)
            after = [(s.num_blocks_in_use, s.pool.num_free_blocks, [list(t) for t in s.tables])
                     for s in self.cache.stores]
            assert after == before and self.cache.get_seq_length() == self.length
            return
        self.cache.crop(-remove)
        self.rows = [[values[:new_length] for values in row] for row in self.rows]
        self.floor = self.window_start(new_length)  # a crop puts the window back in force, recording or not
        for layer_index, layer in enumerate(self.cache.layers if self.length else []):
            keys, values = layer.store.read(layer_index, self.length)
            self.check_read(layer_index, keys, values, self.length)

    @rule()
    def start_recording(self):
        self.cache.activate_past_recording()

    @rule()
    def stop_recording(self):
        for layer in self.cache.layers:  # what HF's generate does when it hands the cache back
            layer.record_past = False

    # ---- invariants -----------------------------------------------------------------------------------------------
    @invariant()
    def bookkeeping(self):
        if not hasattr(self, "cache"):
            return
        assert self.cache.get_seq_length() == self.length
        for store in self.cache.stores:
            counts: dict[int, int] = {}
            for table in store.tables:
                assert len(table) >= blocks_needed(self.length, store.block_size)
                assert all(b == NULL_BLOCK for b in table[:store.num_released_blocks])
                assert NULL_BLOCK not in table[store.num_released_blocks:]
                for block in table[store.num_released_blocks:]:
                    counts[block] = counts.get(block, 0) + 1
            assert store.pool.blocks[NULL_BLOCK].ref_count == self.null_ref_count
            for block in range(1, store.pool.num_blocks + 1):
                assert store.pool.blocks[block].ref_count == counts.get(block, 0), block
            assert store.pool.num_free_blocks == store.pool.num_blocks - len(counts)
            assert store.num_blocks_in_use == len(counts)

    @invariant()
    def windows_hold_only_what_they_see(self):
        """A sliding window released every block wholly behind it as of its last write (outside recording) or crop,
        and nothing its next query sees."""
        if not hasattr(self, "cache"):
            return
        for layer in self.cache.layers:
            if layer.sliding_window:
                store = layer.store
                assert store.num_released_blocks == self.floor // store.block_size, (store.num_released_blocks,
                                                                                      self.floor)
                assert store.num_released_tokens <= self.visible_from(layer, self.length)
                assert layer.sliding_window == self.window


PagedCacheMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=50, deadline=None,
                                               suppress_health_check=[HealthCheck.too_slow])
test_paged_cache_machine = PagedCacheMachine.TestCase
