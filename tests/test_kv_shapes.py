"""Per-layer K/V shapes (model/kv_shapes.py, kv/cache.py): K and V of different head sizes stored padded to one,
exactly; layers of different page shapes view one storage without touching each other's pages; mimo_v2_flash (both
at once) token-exact with HF is in test_kv_groups (it is one of tiny.MIXED)."""
import pytest
import torch

from hf_paged.attention import AttentionBackends, AttentionMetadata, store_kv
from hf_paged.kv import KVCache, KVCacheSpec
from hf_paged.model.kv_shapes import cut_to_value, fit_to_pages, layer_shapes


def attention(q, k, v, scale):
    return torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1) @ v


@pytest.mark.parametrize("k_size,v_size", [(8, 12), (12, 8), (8, 8)])
@pytest.mark.parametrize("scaling", [None, 0.3])
def test_padding_the_smaller_of_k_and_v_is_exact(k_size, v_size, scaling):
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, k_size, generator=gen), torch.randn(7, k_size, generator=gen)
    v = torch.randn(7, v_size, generator=gen)
    fq, fk, fv, scale = fit_to_pages(q, k, v, scaling)
    assert fk.shape[-1] == fv.shape[-1] == fq.shape[-1] == max(k_size, v_size)
    expected = attention(q, k, v, k_size ** -0.5 if scaling is None else scaling)
    scale = fq.shape[-1] ** -0.5 if scale is None else scale  # the backends' default when given None
    torch.testing.assert_close(cut_to_value(attention(fq, fk, fv, scale), v_size), expected, rtol=0, atol=1e-6)


def test_k_and_v_with_different_head_counts_are_refused():
    shapes, reason = layer_shapes({0: (2, 16, 2, 8), 1: (4, 16, 4, 8)})
    assert shapes == {0: (2, 16, 8), 1: (4, 16, 8)} and reason is None
    shapes, reason = layer_shapes({0: (2, 16, 4, 16)})
    assert not shapes and "layer 0" in reason and "heads" in reason


def spec(shapes):
    return KVCacheSpec(len(shapes), 2, 16, torch.float32, torch.device("cpu"), layer_shapes=shapes)


def test_layers_of_different_page_shapes_keep_their_own_pages():
    cache = KVCache(spec({0: (2, 16, 8), 1: (4, 16, 16), 2: (1, 4, 4)}), num_blocks=6, block_size=2)
    assert not cache.spec.uniform
    assert cache.spec.bytes_per_block(2) == 2 * 3 * 2 * 4 * 16 * 4  # every layer's page the largest (4 heads of 16)
    for layer, (heads, k, v) in cache.spec.layer_shapes.items():
        assert cache.key_caches[layer].shape == (6, 2, heads, max(k, v))
    for layer in range(3):  # every page of every layer gets its own value
        for block in range(6):
            cache.key_caches[layer][block] = 100 * layer + block
            cache.value_caches[layer][block] = -(100 * layer + block)
    for layer in range(3):
        for block in range(6):
            assert (cache.key_caches[layer][block] == 100 * layer + block).all()
            assert (cache.value_caches[layer][block] == -(100 * layer + block)).all()


def test_one_shape_keeps_contiguous_pages():
    cache = KVCache(spec({0: (2, 16, 8), 1: (2, 16, 8)}), num_blocks=4, block_size=2)
    assert cache.spec.uniform and all(c.is_contiguous() for c in cache.key_caches + cache.value_caches)
    assert cache.storage.shape == (2, 2, 4, 2, 2, 16)


def test_strided_pages_store_and_attend_as_contiguous_ones():
    """The torch backend (and "auto", which on CPU may pick the native decode kernel) writes and reads a smaller
    layer's strided pages as it does a contiguous cache's: a prompt, its continuation over the pages, a decode."""
    strided = KVCache(spec({0: (2, 8, 8), 1: (4, 8, 8)}), num_blocks=4, block_size=2)
    plain = KVCache(spec({0: (2, 8, 8)}), num_blocks=4, block_size=2)
    assert not strided.key_caches[0].is_contiguous() and plain.key_caches[0].is_contiguous()
    gen = torch.Generator().manual_seed(1)
    steps = [([3], [3], [[2, 1]], [4, 5, 2]),  # (query lens, context lens, tables, slots)
             ([2], [5], [[2, 1, 3]], [3, 6]),
             ([1, 1], [6, 2], [[2, 1, 3], [0]], [7, 1])]
    inputs = [tuple(torch.randn(sum(q), heads, 8, generator=gen) for heads in (4, 2, 2)) for q, *_ in steps]
    for backend in ("torch", "auto"):
        outs = {}
        for name, cache in (("strided", strided), ("plain", plain)):
            cache.storage.zero_()
            backends = AttentionBackends(backend, "cpu")
            outs[name] = []
            for (qlens, ctx, tables, slots), (q, k, v) in zip(steps, inputs):
                meta = AttentionMetadata.build(qlens, ctx, tables, slots, 2, "cpu")
                store_kv(k, v, cache.key_caches[0], cache.value_caches[0], meta.slot_mapping)
                outs[name].append(backends.attend(q, cache.key_caches[0], cache.value_caches[0], meta))
        for a, b in zip(outs["strided"], outs["plain"]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
