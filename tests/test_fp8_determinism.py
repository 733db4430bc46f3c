"""fp8 KV caches: a request's tokens depend on the model and its own prompt only, never on what else ran (earlier
requests, the rest of its batch, their order). The per-layer scales are fixed when the engine starts (calibrated
from a fixed forward, or given as `kv_scales`); K/V beyond their range saturate instead of turning NaN."""
import math

import pytest
import torch

import hf_paged  # noqa: F401  (registers the take-over)
from hf_paged import LLM, SamplingParams
from hf_paged.attention import store_kv
from hf_paged.attention.torch_backend import FP8_MAX, dequantize
from hf_paged.kv import KVCache, KVCacheSpec
from hf_paged.model import describe_model
from hf_paged.model.kv_calibration import HEADROOM, calibration_sequences, measure_kv_maxima
from hf_paged.tiny import tiny_model



GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
OPTIONS = dict(block_size=8, num_blocks=128, kv_cache_dtype="fp8_e4m3", attention_backend="torch")
HOT = 7  # the token id whose layer-0 K/V the `hot_llama` model blows up
GAIN = 1e4


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    yield


def prompts(count=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [[t for t in torch.randint(3, 256, (int(n),), generator=gen).tolist() if t != HOT]
            for n in torch.randint(3, 30, (count,), generator=gen)]


def greedy(llm, batch):
    return [o.token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def hot_llama():
    """A tiny llama (its own instance) whose layer 0 multiplies the K and V of token HOT by 1e4 once `switch["on"]`
    is set (after the engine calibrated): a request with activations far beyond anything the calibration saw."""
    model = tiny_model("llama")
    attention, switch, rows = model.model.layers[0].self_attn, {"on": False}, {}

    def remember(module, args):
        rows["hot"] = args[0] == HOT  # [1, T]

    def blow_up(module, args, out):
        return out * (1 + (GAIN - 1) * rows["hot"][..., None]) if switch["on"] else out

    model.model.embed_tokens.register_forward_pre_hook(remember)
    attention.k_proj.register_forward_hook(blow_up)
    attention.v_proj.register_forward_hook(blow_up)
    model.hot_switch = switch
    return model


def hot_engine(model):
    model.hot_switch["on"] = False
    llm = LLM(model, **OPTIONS)
    model.hot_switch["on"] = True
    return llm


def test_tokens_do_not_depend_on_an_earlier_one_token_request(llama):
    batch = prompts()
    fresh = greedy(LLM(llama, **OPTIONS), batch)
    served = LLM(llama, **OPTIONS)
    greedy(served, [[5]])
    assert greedy(served, batch) == fresh


def test_tokens_do_not_depend_on_an_earlier_request_with_huge_activations(hot_llama):
    batch = prompts(seed=1)
    fresh = greedy(hot_engine(hot_llama), batch)
    served = hot_engine(hot_llama)
    hot = served.generate([[HOT, 9, HOT, 11]], GREEDY, use_tqdm=False)[0]
    assert hot.finish_reason == "length" and len(hot.token_ids) == GREEDY.max_tokens  # saturated, not NaN
    assert greedy(served, batch) == fresh


def test_tokens_do_not_depend_on_the_rest_of_the_batch(hot_llama):
    """The same prompts alone and batched with a huge-activation request (prefilled in the same steps)."""
    batch = prompts(6, seed=2)
    alone = greedy(hot_engine(hot_llama), batch)
    mixed = hot_engine(hot_llama).generate([[HOT] * 5] + batch, GREEDY, use_tqdm=False)
    assert mixed[0].finish_reason == "length"
    assert [o.token_ids for o in mixed[1:]] == alone


def test_tokens_do_not_depend_on_batch_order(llama):
    """A small token budget: the first steps prefill different prompts depending on the order."""
    batch = prompts(seed=3)
    options = dict(OPTIONS, max_num_batched_tokens=24, max_num_seqs=4)
    forward = greedy(LLM(llama, **options), batch)
    backward = greedy(LLM(llama, **options), batch[::-1])[::-1]
    assert forward == backward


def test_scales_are_calibrated_at_start_and_never_change(llama):
    first, second = LLM(llama, **OPTIONS), LLM(llama, **OPTIONS)
    cache = first.engine.memory.cache
    scales, fingerprint = list(cache.kv_scales), cache.scales_fingerprint()
    assert None not in scales and scales == second.engine.memory.cache.kv_scales
    spec = describe_model(llama)
    maxima = measure_kv_maxima(llama, spec, calibration_sequences(spec, llama.config.bos_token_id, 128))
    for scale, top in zip((s for pair in scales for s in pair), (m for pair in maxima for m in pair)):
        assert math.log2(scale).is_integer() and top * HEADROOM <= scale * FP8_MAX < 2 * top * HEADROOM
    greedy(first, prompts(4, seed=4))
    assert cache.kv_scales == scales and cache.scales_fingerprint() == fingerprint


def test_given_kv_scales_are_used_and_checked(llama):
    layers = describe_model(llama).kv.num_layers
    pairs = [(0.01 * (i + 1), 0.02 * (i + 1)) for i in range(layers)]
    assert LLM(llama, kv_scales=pairs, **OPTIONS).engine.memory.cache.kv_scales == pairs
    assert LLM(llama, kv_scales=1.0, **OPTIONS).engine.memory.cache.kv_scales == [(1.0, 1.0)] * layers
    for bad in (0.0, -1.0, math.nan, [(1.0, 1.0)] * (layers + 1), [(1.0,)] * layers, "big"):
        with pytest.raises(ValueError, match="kv_scales"):
            LLM(llama, kv_scales=bad, **OPTIONS)
    with pytest.raises(ValueError, match="kv_scales applies to kv_cache_dtype='fp8_e4m3' only"):
        LLM(llama, kv_scales=1.0, block_size=8, num_blocks=16)


def fp8_cache(layers=2, blocks=4, block_size=4):
    return KVCache(KVCacheSpec(layers, 2, 8, torch.float8_e4m3fn, torch.device("cpu")), blocks, block_size)


def test_values_beyond_the_scales_saturate_and_in_range_values_survive():
    cache = fp8_cache()
    cache.set_scales([(0.01, 0.02), (0.5, 0.25)])
    k_scale, v_scale = cache.scales_for(0, torch.empty(0), torch.empty(0))
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(6, 2, 8, generator=gen)  # |K| < 4.48 = 448 x 0.01: representable
    value = torch.randn(6, 2, 8, generator=gen)
    key[0], value[0] = 1e6, -1e9  # far beyond the range
    key[1, 0, 0], value[1, 0, 0] = math.inf, -math.inf
    store_kv(key, value, cache.key_caches[0], cache.value_caches[0], torch.arange(6), k_scale, v_scale)
    k = dequantize(cache.key_caches[0].view(-1, 2, 8)[:6], torch.float32, k_scale)
    v = dequantize(cache.value_caches[0].view(-1, 2, 8)[:6], torch.float32, v_scale)
    assert torch.isfinite(k).all() and torch.isfinite(v).all()
    assert (k[0] == FP8_MAX * k_scale).all() and (v[0] == -FP8_MAX * v_scale).all()
    assert k[1, 0, 0] == FP8_MAX * k_scale and v[1, 0, 0] == -FP8_MAX * v_scale
    torch.testing.assert_close(k[2:], key[2:], rtol=0.07, atol=2 ** -9 * k_scale)
    torch.testing.assert_close(v[2:], value[2:], rtol=0.07, atol=2 ** -9 * v_scale)
