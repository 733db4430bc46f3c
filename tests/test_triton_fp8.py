"""The Triton backend over FP8 KV caches (float8_e4m3fn pages holding value / scale, per-layer scales): attention
(mixed batches, window, softcap, split-KV, half-precision queries) against float64 over the dequantized pages,
the store kernel byte for byte against torch_backend.store_kv, and the engine against the torch backend.
Runs under the Triton interpreter on CPU: importing test_triton first switches it on (see there)."""
from test_triton import DEVICE, FP8, FP8_TOL, K_SCALE, LONG_DECODES, V_GAIN, V_SCALE, metadata_of  # first: interpreter

import pytest
import torch
from test_attention import MIXED, make_case, reference

from hf_paged.attention import paged_attention, store_kv
from hf_paged.attention import triton_backend as tb
from hf_paged.attention.backends.triton_varlen import TritonBackend
from hf_paged.attention.torch_backend import quantize


def sequence_rows(cache, tables, context_lens, block_size):
    """Each sequence's [context, H_kv, D] rows read back from its pages."""
    flat = cache.view(-1, *cache.shape[2:])
    return [flat[[table[p // block_size] * block_size + p % block_size for p in range(ctx)]]
            for table, ctx in zip(tables.tolist(), context_lens.tolist())]


def run_fp8_case(seqs, heads, kv_heads, head_dim, block_size, dtype=torch.float32, scale=0.2, window=None,
                 softcap=None, num_splits=None, seed=0):
    """make_case's pages at realistic magnitudes (K channels spread over ~1.5 decades, a few saturating; V x8),
    quantized as the engine stores them (torch_backend.quantize) with scales 0.05 / 0.2."""
    query, kc, vc, cu, ctx, tables = make_case(seqs, heads, kv_heads, head_dim, block_size, torch.float32, seed)[:6]
    gen = torch.Generator().manual_seed(seed)
    kq = quantize(kc * torch.exp(torch.randn(head_dim, generator=gen) * 0.7), FP8, K_SCALE)
    vq = quantize(vc * V_GAIN, FP8, V_SCALE)
    query = query.to(dtype)
    meta = metadata_of(*(t.to(DEVICE) for t in (cu, ctx, tables)), block_size)
    assert TritonBackend().unsupported_reason(query.to(DEVICE), kq.to(DEVICE), meta, window, softcap) is None
    out = tb.paged_attention(query.to(DEVICE), kq.to(DEVICE), vq.to(DEVICE), meta, scale, window, softcap,
                             num_splits=num_splits, kv_scales=(K_SCALE, V_SCALE))
    assert out.dtype == dtype and out.shape == query.shape
    keys = sequence_rows(kq.float().double() * K_SCALE, tables, ctx, block_size)
    values = sequence_rows(vq.float().double() * V_SCALE, tables, ctx, block_size)
    return out.cpu(), reference(query, keys, values, [q for q, _ in seqs], scale, window, softcap)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (8, 1)])  # MHA, GQA 4, MQA
@pytest.mark.parametrize("block_size", [16, 64])
def test_fp8_mixed_batch_matches_float64(heads, kv_heads, block_size):
    """Decodes, fresh prompts and chunked continuations over fp8 pages."""
    out, ref = run_fp8_case(MIXED, heads, kv_heads, 32, block_size, seed=heads * block_size + kv_heads)
    torch.testing.assert_close(out.double(), ref, atol=FP8_TOL, rtol=2e-5)


@pytest.mark.parametrize("window, softcap", [(7, None), (None, 5.0), (12, 3.0)])
def test_fp8_sliding_window_and_softcap(window, softcap):
    """The K scale is folded into the score scale before the soft-cap's tanh: it must scale the logits."""
    out, ref = run_fp8_case(MIXED, 8, 2, 32, 16, scale=0.25, window=window, softcap=softcap, seed=13)
    torch.testing.assert_close(out.double(), ref, atol=FP8_TOL, rtol=2e-5)


@pytest.mark.parametrize("heads, kv_heads, window, softcap", [(8, 2, None, None), (4, 1, 100, 4.0)])
def test_fp8_split_kv_decode(heads, kv_heads, window, softcap):
    """The V scale is applied to each split's partial output before the splits are combined."""
    out, ref = run_fp8_case(LONG_DECODES, heads, kv_heads, 32, 16, window=window, softcap=softcap, num_splits=5,
                            seed=17)
    torch.testing.assert_close(out.double(), ref, atol=FP8_TOL, rtol=2e-5)


# half-precision queries over fp8 pages (a bf16 model with kv_cache_dtype="fp8_e4m3"): ~1 ulp of the output dtype
@pytest.mark.parametrize("dtype, tol, seqs, num_splits", [(torch.float16, 2e-3, MIXED, None),
                                                          (torch.bfloat16, 2e-2, MIXED, None),
                                                          (torch.bfloat16, 2e-2, LONG_DECODES, 3)])
def test_fp8_half_precision_queries(dtype, tol, seqs, num_splits):
    out, ref = run_fp8_case(seqs, 8, 2, 64, 16, dtype=dtype, scale=0.125, softcap=20.0, num_splits=num_splits,
                            seed=19)
    torch.testing.assert_close(out.double(), ref, atol=tol * V_GAIN, rtol=tol)


def test_fp8_public_entry_point_matches_torch_backend():
    """backend="triton" through attention.paged_attention gets the kv_scales, and agrees with the torch backend on
    the same fp8 pages; without the scales the answer is far off (the scales matter in this data)."""
    query, kc, vc, cu, ctx, tables = make_case(MIXED, 8, 2, 32, 16, torch.float32, seed=23)[:6]
    kq, vq = quantize(kc * 3.0, FP8, K_SCALE), quantize(vc * V_GAIN, FP8, V_SCALE)
    args = (query, kq, vq, cu, ctx, tables)
    want = paged_attention(*args, scale=0.2, backend="torch", kv_scales=(K_SCALE, V_SCALE))
    got = paged_attention(*(t.to(DEVICE) for t in args), scale=0.2, backend="triton", kv_scales=(K_SCALE, V_SCALE))
    torch.testing.assert_close(got.cpu(), want, atol=FP8_TOL, rtol=1e-4)
    assert (want - paged_attention(*args, scale=0.2, backend="torch")).abs().max() > 1.0




def e4m3_test_values(gen, scale):
    """Inputs that, divided by `scale`, hit every quantization rule (exactly, for a power-of-two `scale`): every
    finite e4m3 value, the midpoints between neighbours (ties to even), their fp32 neighbours, subnormals and values
    below them, saturating values, -0.0; then log-uniform magnitudes 2^-12..2^10 with random signs."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[~grid.isnan()].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    special = torch.tensor([449.0, -464.0, 1e4, -1e30, 2.0 ** -10, -(2.0 ** -11), 1e-30, -0.0])
    edges = torch.cat([grid, mids, mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9)), special])
    spread = 2.0 ** (torch.rand(2048, generator=gen) * 22 - 12) * (torch.randint(0, 2, (2048,), generator=gen) * 2 - 1)
    return torch.cat([edges, spread]) * scale


@pytest.mark.parametrize("key_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_kv_into_fp8_matches_torch_bytes(key_dtype):
    """Quantizing into fp8 pages (value / scale, saturated to +-448, nearest even) gives torch_backend.store_kv's
    bytes exactly: the interpreter quantizes with integer ops (SOFT_FP8), a GPU with cvt.rn.satfinite, and both
    round the IEEE quotient like torch's cast. V takes a power-of-two scale so the midpoints stay exact ties."""
    gen = torch.Generator().manual_seed(5)
    num_blocks, block_size, kv_heads, head_dim = 40, 16, 3, 32
    tokens = num_blocks * block_size // 2
    numel = tokens * kv_heads * head_dim
    k_scale, v_scale = 0.05, 0.25
    key, value = (torch.cat([e4m3_test_values(gen, s), torch.randn(numel, generator=gen) * 20 * s])[:numel]
                  for s in (k_scale, v_scale))
    key, value = (x[torch.randperm(numel, generator=gen)].view(tokens, kv_heads, head_dim).to(key_dtype)
                  for x in (key, value))
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    caches = [torch.randint(0, 256, (num_blocks, block_size, kv_heads, head_dim), dtype=torch.uint8,
                            generator=gen).view(FP8) for _ in range(2)]
    expected = [c.clone() for c in caches]
    store_kv(key, value, *expected, slots, k_scale, v_scale)
    pad = torch.full((1, kv_heads, head_dim), 7.0, dtype=key_dtype)
    on_device = [c.to(DEVICE) for c in caches]
    tb.triton_store_kv(torch.cat([key, pad]).to(DEVICE), torch.cat([value, pad]).to(DEVICE), *on_device,
                       torch.cat([slots, torch.tensor([-1])]).to(DEVICE), k_scale, v_scale)
    for got, want in zip(on_device, expected):
        assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))




@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # gemma2: soft-capped logits and sliding-window layers
def test_engine_fp8_cache_triton_matches_torch_backend(arch, monkeypatch):
    """kv_cache_dtype="fp8_e4m3": both backends read the same fp8 pages (stored by torch_backend.store_kv with the
    same scales; fresh prompts too attend over the pages), so the Triton kernel (interpreted) must give the torch
    backend's greedy tokens, and it must really serve the steps."""
    if DEVICE.type != "cpu":
        pytest.skip("the tiny model runs on CPU: interpreter only")
    from conftest import left_padded_batch

    from hf_paged.tiny import tiny_model

    cache_dtypes = []
    triton_attention = tb.paged_attention
    monkeypatch.setattr(tb, "paged_attention", lambda *a, **kw: cache_dtypes.append(a[1].dtype) or
                        triton_attention(*a, **kw))
    model = tiny_model(arch)
    ids, mask = left_padded_batch([5, 12, 9], seed=4)

    def generate(backend):
        return model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                              cache_implementation="paged",
                              cache_config={"attention_backend": backend, "kv_cache_dtype": "fp8_e4m3", "block_size": 8,
                                            "max_num_batched_tokens": 16})

    ref = generate("torch")
    assert not cache_dtypes
    out = generate("triton")
    assert cache_dtypes and set(cache_dtypes) == {FP8}
    assert torch.equal(out, ref)
