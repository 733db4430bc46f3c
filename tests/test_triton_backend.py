"""attention/triton_backend.py, the launcher's own logic without running a kernel: which variant `choose_config`
picks, the variant list and AOT signature, the split rule's edges, how `paged_attention` launches (grid, scale
folding, window, split buffers, the reduce kernel) and what it refuses. The kernels are replaced by recorders.
(tests/test_triton*.py run the real kernels against float64 references.)"""
import os

import torch

if not torch.cuda.is_available():  # before the kernels are defined (see tests/test_triton.py)
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install 'hf_paged[triton]')")

from hf_paged.attention import triton_backend as tb
from hf_paged.attention.extras import LayerExtras
from hf_paged.attention.metadata import AttentionMetadata


class Recorder:
    """Stands for a @triton.jit kernel: kernel[grid](*args, **kwargs) is recorded."""

    def __init__(self, arg_names=()):
        self.calls = []
        self.arg_names = list(arg_names)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


@pytest.fixture
def recorded(monkeypatch):
    attention, reduce, store = Recorder(), Recorder(), Recorder()
    monkeypatch.setattr(tb.kernels, "paged_attention_kernel", attention)
    monkeypatch.setattr(tb.kernels, "reduce_splits_kernel", reduce)
    monkeypatch.setattr(tb.kernels, "store_kv_kernel", store)
    monkeypatch.setattr(tb, "interpreted", lambda: False)
    return attention, reduce, store


def case(query_lens, context_lens, heads=8, kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16,
         cache_dtype=None):
    tables = [list(range(-(-c // block_size))) for c in context_lens]
    meta = AttentionMetadata.build(query_lens, context_lens, tables, [0] * sum(query_lens), block_size, "cpu")
    query = torch.zeros(sum(query_lens), heads, head_dim, dtype=dtype)
    blocks = max(len(t) for t in tables)
    cache = torch.zeros(blocks, block_size, kv_heads, head_dim, dtype=cache_dtype or dtype)
    return query, cache, cache.clone(), meta


# ---- variants -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n, p", [(1, 1), (2, 2), (3, 4), (16, 16), (17, 32), (80, 128)])
def test_pow2(n, p):
    assert tb._pow2(n) == p


def test_choose_config_tiles():
    prefill = tb.choose_config("fp16", 128, 4, decode_only=False, softcap=False, split=False)
    assert (prefill.block_m, prefill.tile_n, prefill.num_warps, prefill.num_stages) == (64, 64, 4, 3)
    assert prefill.block_q == 16 and prefill.head_pad == 128 and prefill.kv_dtype == "fp16"
    decode = tb.choose_config("bf16", 128, 4, decode_only=True, softcap=True, split=True)
    assert (decode.block_m, decode.block_q, decode.softcap, decode.split) == (16, 4, True, True)
    wide = tb.choose_config("fp16", 256, 1, decode_only=False, softcap=False, split=False)
    assert (wide.tile_n, wide.num_warps) == (32, 8)  # narrower KV steps, more warps for 256-wide heads
    group = tb.choose_config("fp16", 64, 32, decode_only=True, softcap=False, split=False)
    assert group.block_m == 32 and group.block_q == 1  # a whole GQA group in one tile
    padded = tb.choose_config("fp16", 80, 1, decode_only=False, softcap=False, split=False)
    assert padded.head_pad == 128


def test_choose_config_fp32_and_fp8():
    fp32 = tb.choose_config("fp32", 64, 2, decode_only=False, softcap=False, split=False)
    assert (fp32.block_m, fp32.tile_n, fp32.num_stages) == (32, 16, 2)
    assert fp32.constexprs()["DOT_PRECISION"] == "ieee"
    assert tb.choose_config("fp32", 64, 2, False, False, False, "fp8e4nv").num_stages == 1  # unpipelined
    half_fp8 = tb.choose_config("fp16", 64, 2, decode_only=True, softcap=False, split=False, kv_dtype="fp8e4nv")
    assert half_fp8.tile_n == 32 and half_fp8.kv_dtype == "fp8e4nv"  # half-width KV steps for fp8 decodes
    assert tb.choose_config("fp16", 64, 2, False, False, False, "fp8e4nv").tile_n == 64
    assert tb.choose_config("fp16", 64, 2, False, False, False).constexprs()["DOT_PRECISION"] == "tf32"


def test_constexprs_name_every_compile_time_choice():
    cfg = tb.KernelConfig("bf16", "bf16", 96, 4, 64, 64, True, False, 4, 3, sinks=True)
    assert cfg.constexprs(upcast=True) == {
        "HEAD_DIM": 96, "HEAD_PAD": 128, "HEADS_PER_KV": 4, "BLOCK_M": 64, "BLOCK_Q": 16, "TILE_N": 64,
        "USE_SOFTCAP": True, "SPLIT": False, "UPCAST": True, "DOT_PRECISION": "tf32", "HAS_SINKS": True,
        "HAS_ALIBI": False}


def test_kernel_configs_are_distinct_and_cover_extras_and_fp8():
    configs = tb.kernel_configs(head_dims=(64,), heads_per_kv=(1, 8))
    assert len(configs) == len(set(configs))
    assert {c.kv_dtype for c in configs} == {"fp16", "bf16", "fp32", "fp8e4nv"}
    assert {(c.sinks, c.alibi) for c in configs} == {(False, False), (True, False), (False, True)}
    assert {c.split for c in configs} == {False, True}
    assert tb.choose_config("bf16", 64, 8, True, True, True, "fp8e4nv") in configs


def test_kernel_signature_types_every_argument():
    cfg = tb.choose_config("fp16", 64, 2, decode_only=True, softcap=False, split=True, kv_dtype="fp8e4nv")
    signature, constexprs, attrs = tb.kernel_signature(cfg)
    names = tb.kernels.paged_attention_kernel.arg_names
    assert list(signature) == names and constexprs == cfg.constexprs()
    assert signature["q_ptr"] == "*fp16" and signature["k_cache_ptr"] == "*fp8e4nv"
    assert signature["block_tables_ptr"] == "*i32" and signature["part_acc_ptr"] == "*fp32"
    assert signature["scale"] == "fp32" and signature["num_seqs"] == "i32" and signature["HEAD_DIM"] == "constexpr"
    aligned = {names[i] for (i,) in attrs}
    assert "q_ptr" in aligned and "stride_qt" in aligned and "stride_bt" not in aligned and "num_seqs" not in aligned
    odd = tb.kernel_signature(tb.choose_config("fp16", 72, 2, True, False, False))[2]
    assert "stride_qt" not in {names[i] for (i,) in odd}  # strides are 16-aligned only for head dims % 16 == 0


def test_split_count_edges():
    assert tb.split_count(1, 1, 1, 511, 132) == 1  # fewer than 2 * 256 keys
    assert tb.split_count(1, 1, 1, 512, 132) == 2
    assert tb.split_count(1, 1, 1, 100_000, 132, sliding_window=300) == 1  # the window is what is walked
    assert tb.split_count(132, 2, 1, 8192, 132) == 1  # exactly two waves already
    assert tb.split_count(131, 2, 1, 8192, 132) == 2


# ---- the launcher ---------------------------------------------------------------------------------------------
def test_no_tokens_launch_nothing(recorded):
    query, kc, vc, meta = case([1], [5])
    out = tb.paged_attention(query[:0], kc, vc, meta, 0.5)
    assert out.shape == (0, 8, 64) and not recorded[0].calls


def test_key_and_value_caches_must_match(recorded):
    query, kc, vc, meta = case([1], [5])
    with pytest.raises(ValueError, match="one layout and dtype"):
        tb.paged_attention(query, kc, vc.float(), meta, 0.5)
    with pytest.raises(ValueError, match="one layout and dtype"):
        tb.paged_attention(query, kc, vc.transpose(1, 2).contiguous().transpose(1, 2), meta, 0.5)


def test_prefill_launch(recorded):
    attention, reduce, _ = recorded
    query, kc, vc, meta = case([5, 1, 40], [5, 33, 60], block_size=16)
    out = tb.paged_attention(query, kc, vc, meta, 0.125, sliding_window=None, softcap=None)
    (grid, args, kwargs), = attention.calls
    cfg = tb.choose_config("fp16", 64, 4, False, False, False)
    assert grid == (46 // cfg.block_q + 3, 2, 1)  # query tiles (+ one per sequence), KV heads, one split
    assert args[0] is out and args[1] is query and args[2] is kc and args[3] is vc
    num_seqs, scale, v_scale, softcap, window, chunk, log2_block = args[12:19]
    assert (num_seqs, scale, v_scale, softcap, window, chunk, log2_block) == (3, 0.125, 1.0, 0.0, tb.NO_WINDOW,
                                                                             tb.NO_CHUNK, 4)
    assert kwargs["SPLIT"] is False and kwargs["UPCAST"] is False and kwargs["num_warps"] == cfg.num_warps
    assert not reduce.calls


def test_split_decode_launch_and_reduce(recorded):
    attention, reduce, _ = recorded
    query, kc, vc, meta = case([1, 1], [700, 40], head_dim=80, block_size=32)
    out = tb.paged_attention(query, kc, vc, meta, 0.1, sliding_window=600, softcap=30.0, num_splits=3)
    (grid, args, kwargs), = attention.calls
    assert grid[1:] == (2, 3) and kwargs["SPLIT"] is True and kwargs["USE_SOFTCAP"] is True
    part_m, part_l, part_acc = args[7:10]
    assert part_m.shape == part_l.shape == (2, 8, 3) and part_acc.shape == (2, 8, 3, 128)  # padded head dim
    assert args[15:17] == (30.0, 600)
    (rgrid, rargs, rkwargs), = reduce.calls
    assert rgrid == (2, 8) and rargs[0] is out and rargs[1] is part_m and rargs[4] == 3
    assert rkwargs["HEAD_DIM"] == 80 and rkwargs["HEAD_PAD"] == 128


def test_fp8_folds_k_scale_into_the_score_scale(recorded):
    attention = recorded[0]
    query, kc, vc, meta = case([2], [9], dtype=torch.bfloat16, cache_dtype=torch.float8_e4m3fn)
    tb.paged_attention(query, kc, vc, meta, 0.5, kv_scales=(0.25, 3.0))
    args = attention.calls[-1][1]
    assert args[13:15] == (0.125, 3.0)
    query, kc, vc, meta = case([2], [9], dtype=torch.bfloat16)
    tb.paged_attention(query, kc, vc, meta, 0.5, kv_scales=(0.25, 3.0))  # an unquantized cache ignores them
    assert attention.calls[-1][1][13:15] == (0.5, 1.0)


def test_interpreted_kernels_upcast_bf16_and_fp8_only(recorded, monkeypatch):
    attention = recorded[0]
    monkeypatch.setattr(tb, "interpreted", lambda: True)
    for dtype, cache, upcast in [(torch.float32, None, False), (torch.float16, None, False),
                                 (torch.bfloat16, None, True), (torch.float32, torch.float8_e4m3fn, True)]:
        query, kc, vc, meta = case([2], [9], dtype=dtype, cache_dtype=cache)
        tb.paged_attention(query, kc, vc, meta, 0.5)
        assert attention.calls[-1][2]["UPCAST"] is upcast, (dtype, cache)


def test_extras_arguments(recorded):
    attention = recorded[0]
    query, kc, vc, meta = case([2], [9])
    extras = LayerExtras(sinks=torch.arange(8, dtype=torch.float16), alibi_slopes=torch.ones(8, dtype=torch.float64),
                         chunk_size=4)
    tb.paged_attention(query, kc, vc, meta, 0.5, extras=extras)
    grid, args, kwargs = attention.calls[-1]
    sinks, alibi = args[10:12]
    assert sinks.dtype == alibi.dtype == torch.float32 and sinks.tolist() == list(range(8))
    assert args[17] == 4 and kwargs["HAS_SINKS"] and kwargs["HAS_ALIBI"]
    assert tb._extras_arguments(None, 8, torch.device("cpu")) == (None, None, tb.NO_CHUNK)
    with pytest.raises(ValueError, match=r"shape \[8\]"):
        tb._extras_arguments(LayerExtras(sinks=torch.zeros(4)), 8, torch.device("cpu"))


def test_store_kv_checks_and_launch(recorded):
    store = recorded[2]
    key = torch.zeros(3, 2, 64)
    kc = torch.zeros(4, 16, 2, 64)
    tb.triton_store_kv(key[:0], key[:0], kc, kc.clone(), torch.zeros(0, dtype=torch.long))
    assert not store.calls
    with pytest.raises(ValueError, match="power-of-two block size"):
        tb.triton_store_kv(key, key, torch.zeros(4, 12, 2, 64), torch.zeros(4, 12, 2, 64), torch.zeros(3))
    with pytest.raises(ValueError, match="power-of-two block size"):
        tb.triton_store_kv(torch.zeros(3, 2, 128)[..., ::2], key, kc, kc.clone(), torch.zeros(3))
    with pytest.raises(ValueError, match="one dtype"):
        tb.triton_store_kv(key, key, kc, kc.half(), torch.zeros(3))
    with pytest.raises(ValueError, match="1-byte ones only"):
        tb.triton_store_kv(key, key, kc.to(torch.float8_e5m2), kc.to(torch.float8_e5m2), torch.zeros(3))
    slots = torch.tensor([0, -1, 5])
    tb.triton_store_kv(key, key, kc.to(torch.float8_e4m3fn), kc.to(torch.float8_e4m3fn), slots, 0.5, 2.0)
    (grid, args, kwargs), = store.calls
    assert grid == (3, 1) and args[4] is slots and args[5:9] == (2, 4, 0.5, 2.0)
    assert kwargs["FP8"] is True and kwargs["SOFT_FP8"] is False and kwargs["BLOCK_H"] == 2
