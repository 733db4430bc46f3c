"""kv/paged_store.py: a PagedCache's block tables and pages: reads give back exactly what was written, rows share
blocks until one writes (copy-on-write), released and truncated blocks go back to the pool, a fixed pool refuses to
grow."""
import pytest
import torch

from hf_paged.kv import NULL_BLOCK, PagedStore


def kv(rows, new, heads=2, dim=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, heads, new, dim, generator=g), torch.randn(rows, heads, new, dim, generator=g)


def test_reads_return_what_was_written_across_blocks_and_layers():
    store = PagedStore(block_size=4)
    k0, v0 = kv(2, 6)
    k1, v1 = kv(2, 6, seed=1)
    store.write(0, k0[:, :, :5], v0[:, :, :5], 0)
    store.write(0, k0[:, :, 5:], v0[:, :, 5:], 5)  # a second write appends
    store.write(1, k1, v1, 0)
    for layer, (k, v) in enumerate([(k0, v0), (k1, v1)]):
        got_k, got_v = store.read(layer, 6)
        assert torch.equal(got_k, k) and torch.equal(got_v, v) and got_k.is_contiguous()
    assert store.num_blocks_in_use == 4  # 2 rows x 2 blocks, shared by both layers


def test_selected_rows_share_blocks_until_one_writes():
    store = PagedStore(block_size=4)
    k, v = kv(1, 6)
    store.write(0, k, v, 0)
    store.select_rows([0, 0])
    assert store.tables[0] == store.tables[1] and store.num_blocks_in_use == 2
    k2, v2 = kv(2, 1, seed=2)
    store.write(0, k2, v2, 6)  # both rows write into the shared second block: each gets its own copy
    assert store.tables[0][0] == store.tables[1][0] and store.tables[0][1] != store.tables[1][1]
    got_k, _ = store.read(0, 7)
    assert torch.equal(got_k[:, :, :6], k.expand(2, -1, -1, -1)) and torch.equal(got_k[:, :, 6:], k2)


def test_release_before_and_truncate_give_blocks_back():
    store = PagedStore(block_size=4, num_blocks=8)
    k, v = kv(1, 12)
    store.write(0, k, v, 0)
    store.release_before(9)  # blocks of slots 0-7 are never read again
    assert store.tables[0][:2] == [NULL_BLOCK, NULL_BLOCK] and store.num_released_tokens == 8
    assert store.pool.num_free_blocks == 7
    with pytest.raises(RuntimeError, match="given back"):
        store.write(0, *kv(1, 1), 3)
    store.truncate(0)
    assert store.tables == [[]] and store.pool.num_free_blocks == 8 and store.num_released_tokens == 0


def test_a_fixed_pool_refuses_and_a_growable_one_grows():
    fixed = PagedStore(block_size=4, num_blocks=2)
    with pytest.raises(MemoryError):
        fixed.write(0, *kv(1, 9), 0)
    growing = PagedStore(block_size=4, initial_blocks=2)
    k, v = kv(1, 9)
    growing.write(0, k, v, 0)
    assert growing.pool.num_blocks >= 3 and torch.equal(growing.read(0, 9)[0], k)


def test_the_batch_size_is_fixed_by_the_first_write():
    store = PagedStore(block_size=4)
    store.write(0, *kv(2, 3), 0)
    with pytest.raises(ValueError, match="holds 2 rows"):
        store.write(0, *kv(3, 1), 3)
