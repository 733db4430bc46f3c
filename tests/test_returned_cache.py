"""integrations/returned_cache.py: a finished row's K/V copied out of its blocks before they are freed (a copy: later
writes to the pages do not reach it), placed at the row's real columns of HF's layout (its prompt's unmasked
columns, then its generated ones). (A generate call continuing from it is the feature suites' business.)"""
from types import SimpleNamespace

import torch

from hf_paged.integrations.returned_cache import KVSnapshots, _real_columns
from hf_paged.kv import KVCache, KVCacheSpec


def test_keep_copies_a_rows_computed_kv_out_of_its_blocks():
    cache = KVCache(KVCacheSpec(2, 1, 2, torch.float32, torch.device("cpu"), attention_layers=(1,)), 5, 2)
    cache.storage.copy_(torch.arange(cache.storage.numel(), dtype=torch.float32).view(cache.storage.shape))
    request = SimpleNamespace(num_computed_tokens=3, block_tables=[[4, 2]], index=7, state_slot=-1)
    snapshots = KVSnapshots(cache)
    snapshots.keep(request)
    layers = snapshots.rows[7]
    assert layers[0] is None  # a layer without K/V
    keys, values = layers[1]
    pages = cache.key_caches[1]
    assert torch.equal(keys, torch.stack([pages[4, 0], pages[4, 1], pages[2, 0]]))
    assert torch.equal(values, torch.stack([cache.value_caches[1][b, o] for b, o in ((4, 0), (4, 1), (2, 0))]))
    cache.storage.zero_()  # the blocks are reused: the snapshot keeps what they held
    assert keys.abs().sum() > 0


def test_a_rows_real_columns_skip_its_padding():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert _real_columns(mask, 0, 4, 3).tolist() == [2, 3, 4, 5, 6]
    assert _real_columns(mask, 1, 4, 1).tolist() == [0, 1, 2, 3, 4]
    assert _real_columns(None, 0, 2, 2).tolist() == [0, 1, 2, 3]
