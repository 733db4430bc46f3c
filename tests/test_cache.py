"""kv/cache.py: the KV tensors' layout (a view per attention layer, none for others), their size, release and
restore, how many blocks a memory budget holds, and an fp8 cache's per-layer scales."""
import math

import pytest
import torch

from hf_paged.kv import KVCache, KVCacheSpec, choose_num_blocks
from hf_paged.kv.cache import NO_KV_BLOCKS
from hf_paged.kv.groups import KVGroup

CPU = torch.device("cpu")


def fp8_cache(layers=2, blocks=4, block_size=4):
    return KVCache(KVCacheSpec(layers, 2, 8, torch.float8_e4m3fn, CPU), blocks, block_size)


def test_every_attention_layer_views_its_own_pages_and_other_layers_none():
    spec = KVCacheSpec(4, 2, 8, torch.float32, CPU, attention_layers=(0, 2, 3))
    cache = KVCache(spec, 5, 4)
    assert cache.value_caches[1] is None and cache.key_caches[1] is None
    for layer in (0, 2, 3):
        assert cache.key_caches[layer].shape == (5, 4, 2, 8)
    cache.key_caches[0].fill_(1.0)
    for layer in (0, 2, 3):
        cache.value_caches[layer].zero_()
    for layer in (2, 3):
        cache.key_caches[layer].zero_()
    assert cache.key_caches[0].eq(1.0).all()  # K and V of different layers never alias
    assert cache.num_bytes == 5 * spec.bytes_per_block(4) == 3 * 2 * 5 * 4 * 2 * 8 * 4


def test_release_gives_the_memory_back_and_restore_takes_it_again():
    cache = KVCache(KVCacheSpec(2, 2, 8, torch.float32, CPU), 4, 4)
    cache.release()
    assert cache.num_bytes == 0 and cache.key_caches == [None, None]
    cache.restore()
    assert cache.key_caches[1].shape == (4, 4, 2, 8) and cache.num_bytes == 4 * cache.spec.bytes_per_block(4)


def test_choose_num_blocks_from_a_count_or_a_budget():
    spec = KVCacheSpec(2, 2, 8, torch.float32, CPU)
    per_block = spec.bytes_per_block(4)
    assert choose_num_blocks(spec, 4, 7, 0) == 7
    assert choose_num_blocks(spec, 4, None, 10 * per_block + per_block - 1) == 10
    with pytest.raises(ValueError, match="holds no block"):
        choose_num_blocks(spec, 4, None, per_block - 1)
    stateless = KVCacheSpec(2, 2, 8, torch.float32, CPU, attention_layers=())
    assert choose_num_blocks(stateless, 4, None, 0) == NO_KV_BLOCKS


def test_with_several_groups_a_block_id_holds_a_groups_worth_of_layers():
    groups = (KVGroup((0, 1)), KVGroup((2, 3), window=8))
    spec = KVCacheSpec(4, 2, 8, torch.float32, CPU, groups=groups)
    assert spec.num_tensors == 2 and spec.blocks_for_layer_blocks(10) == 20  # the memory of 10 blocks of 4 layers
    assert spec.positions() == {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)}
    cache = KVCache(spec, 3, 4)
    assert cache.layer_group == [0, 0, 1, 1]
    assert cache.key_caches[0].data_ptr() == cache.key_caches[2].data_ptr()  # one tensor, a block in one group


def test_scales_must_be_set_and_their_fingerprint_follows_them():
    cache = fp8_cache()
    with pytest.raises(RuntimeError, match="set_scales"):
        cache.scales_for(0, torch.zeros(1), torch.zeros(1))
    cache.set_scales([(0.1, 0.2), (0.3, 0.4)])
    first = cache.scales_fingerprint()
    same = fp8_cache()
    same.set_scales([(0.1, 0.2), (0.3, 0.4)])
    assert same.scales_fingerprint() == first and len(first) == 16
    cache.set_scales([(0.1, 0.2), (0.3, 0.4000001)])
    assert cache.scales_fingerprint() != first
    for bad in ([(0.1, 0.2)], [(0.1, 0.0), (0.3, 0.4)], [(0.1, math.inf), (0.3, 0.4)]):
        with pytest.raises(ValueError):
            cache.set_scales(bad)
    plain = KVCache(KVCacheSpec(2, 2, 8, torch.float32, torch.device("cpu")), 4, 4)
    assert plain.scales_fingerprint() == "" and plain.scales_for(1, torch.zeros(1), torch.zeros(1)) == (1.0, 1.0)
