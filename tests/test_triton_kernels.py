"""attention/triton_kernels.py, kernel by kernel, called directly (interpreted on CPU, compiled on a GPU machine):
the split combiner against a softmax over all keys, the cache store's slot arithmetic and skipped slots, and the
device helpers (`_find_sequence`'s tile owner, `_e4m3_bits` bit for bit against torch's fp8 cast, `_tanh`).
(tests/test_triton*.py check the attention kernel through its launcher.)"""
import math
import os

import torch

if not torch.cuda.is_available():  # before the kernels are defined (see tests/test_triton.py)
    os.environ["TRITON_INTERPRET"] = "1"
DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")

import pytest

triton = pytest.importorskip("triton", reason="triton is not installed (pip install 'hf_paged[triton]')")
import triton.language as tl

from hf_paged.attention import triton_kernels as kernels
from hf_paged.attention.triton_kernels import _e4m3_bits, _find_sequence, _tanh

LOG2E = 1.4426950408889634


# ---- helpers, through small kernels of this file ------------------------------------------------------------
@triton.jit
def _owner_kernel(cu_ptr, out_ptr, num_seqs, BLOCK_Q: tl.constexpr):
    pid = tl.program_id(0)
    tl.store(out_ptr + pid, _find_sequence(cu_ptr, num_seqs, pid, BLOCK_Q))


@triton.jit
def _e4m3_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, _e4m3_bits(tl.load(x_ptr + offs)))


@triton.jit
def _tanh_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, _tanh(tl.load(x_ptr + offs)))


@pytest.mark.parametrize("query_lens, block_q", [([1, 1, 1], 4), ([5, 1, 9, 4], 4), ([16, 3], 16), ([2, 7, 1], 1)])
def test_find_sequence_gives_each_query_tile_its_sequence(query_lens, block_q):
    """Sequence b owns the tiles [cu[b] // BLOCK_Q + b, cu[b + 1] // BLOCK_Q + b + 1): the launch grid's
    num_tokens // BLOCK_Q + num_seqs programs cover every sequence's tiles."""
    cu = [0]
    for n in query_lens:
        cu.append(cu[-1] + n)
    programs = cu[-1] // block_q + len(query_lens)
    expected = []
    for pid in range(programs):
        starts = [cu[b] // block_q + b for b in range(len(query_lens))]
        expected.append(max(b for b in range(len(query_lens)) if starts[b] <= pid))
    out = torch.full((programs,), -7, dtype=torch.int32, device=DEVICE)
    _owner_kernel[(programs,)](torch.tensor(cu, dtype=torch.int32, device=DEVICE), out, len(query_lens),
                               BLOCK_Q=block_q)
    assert out.tolist() == expected
    for b, n in enumerate(query_lens):  # every token of b lies in one of b's tiles
        tiles = [pid for pid in range(programs) if expected[pid] == b]
        assert len(tiles) * block_q >= n


def test_e4m3_bits_match_torch_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    smallest = 2.0 ** -9  # the smallest e4m3 subnormal
    values = [0.0, -0.0, 448.0, -448.0, 1.0, 1.0625, 1.125 + 0.0625, 240.0, 2.0 ** -6, 2.0 ** -6 * 0.999,
              smallest, smallest / 2, smallest * 1.5, smallest * 2.5, smallest * 0.49, 3 * smallest / 2 * 0.9999,
              1.0 + 1 / 16, 1.0 + 3 / 16, 1.0 + 1 / 32, -(1.0 + 3 / 32), 0.0029296875, 447.0]
    n = 256
    rest = (torch.randn(n - len(values), generator=gen) * torch.logspace(-4, 2.6, n - len(values))).clamp(-448, 448)
    x = torch.cat([torch.tensor(values), rest]).float()
    out = torch.empty(n, dtype=torch.int32, device=DEVICE)
    _e4m3_kernel[(1,)](x.to(DEVICE), out, N=n)
    expected = x.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int32)
    mismatch = (out.cpu() != expected).nonzero().flatten().tolist()
    assert not mismatch, [(x[i].item(), out[i].item(), expected[i].item()) for i in mismatch[:5]]


def test_tanh_is_exact_enough_and_saturates_without_overflow():
    x = torch.tensor([0.0, 1e-4, -0.5, 1.0, 3.0, -7.5, 20.0, -100.0, 1e4, -1e30, 0.25, 2.0, -2.0, 50.0, 5.0, -5.0])
    out = torch.empty_like(x, device=DEVICE)
    _tanh_kernel[(1,)](x.to(DEVICE), out, N=16)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.cpu(), torch.tanh(x), atol=1e-6, rtol=1e-6)


# ---- reduce_splits_kernel ---------------------------------------------------------------------------------
def test_reduce_splits_combines_partial_softmax_states_into_the_full_softmax():
    """Each split's (max, sum, unnormalised sum of values) over its keys, in log2 units: the combination is the
    softmax over all the keys, whatever the split sizes (one split with a single key, one with a very low max)."""
    gen = torch.Generator().manual_seed(3)
    tokens, heads, head_dim, head_pad = 2, 3, 20, 32
    bounds = [0, 1, 9, 30, 31]  # 4 splits over 31 keys
    splits = len(bounds) - 1
    scores = torch.randn(tokens, heads, bounds[-1], generator=gen, dtype=torch.float64) * 3
    scores[..., 30] -= 60.0  # the last split holds one key that barely counts
    values = torch.randn(tokens, heads, bounds[-1], head_dim, generator=gen, dtype=torch.float64)
    part_m = torch.empty(tokens, heads, splits, dtype=torch.float32)
    part_l = torch.empty_like(part_m)
    part_acc = torch.zeros(tokens, heads, splits, head_pad, dtype=torch.float32)
    for s in range(splits):
        s2 = scores[..., bounds[s]:bounds[s + 1]] * LOG2E
        m = s2.amax(-1)
        p = torch.exp2(s2 - m[..., None])
        part_m[..., s], part_l[..., s] = m.float(), p.sum(-1).float()
        part_acc[..., s, :head_dim] = torch.einsum("thk,thkd->thd", p, values[..., bounds[s]:bounds[s + 1], :]).float()
    out = torch.full((tokens, heads, head_dim), float("nan"), device=DEVICE)
    kernels.reduce_splits_kernel[(tokens, heads)](out, part_m.to(DEVICE), part_l.to(DEVICE), part_acc.to(DEVICE),
                                                  splits, out.stride(0), out.stride(1), HEAD_DIM=head_dim,
                                                  HEAD_PAD=head_pad)
    expected = torch.einsum("thk,thkd->thd", scores.softmax(-1), values)
    torch.testing.assert_close(out.cpu().double(), expected, atol=1e-5, rtol=1e-5)


def test_reduce_splits_with_one_split_divides_by_its_sum():
    part_m = torch.tensor([[[2.0]]])
    part_l = torch.tensor([[[4.0]]])
    part_acc = torch.arange(16, dtype=torch.float32).reshape(1, 1, 1, 16)
    out = torch.zeros(1, 1, 16, device=DEVICE)
    kernels.reduce_splits_kernel[(1, 1)](out, part_m.to(DEVICE), part_l.to(DEVICE), part_acc.to(DEVICE), 1,
                                         out.stride(0), out.stride(1), HEAD_DIM=16, HEAD_PAD=16)
    assert out.cpu().flatten().tolist() == [i / 4 for i in range(16)]


# ---- store_kv_kernel --------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_h", [1, 2, 4])
def test_store_kv_writes_each_slot_and_skips_negative_ones(block_h):
    tokens, kv_heads, head_dim, head_pad, block_size, blocks = 5, 3, 12, 16, 4, 3
    gen = torch.Generator().manual_seed(1)
    key = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    value = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    slots = torch.tensor([5, -1, 0, 11, 6])
    k_cache = torch.full((blocks, block_size, kv_heads, head_dim), 7.0)
    v_cache = torch.full_like(k_cache, 7.0)
    k_dev, v_dev = k_cache.clone().to(DEVICE), v_cache.clone().to(DEVICE)  # (on the CPU .to() would not copy)
    kernels.store_kv_kernel[(tokens, triton.cdiv(kv_heads, block_h))](
        key.to(DEVICE), value.to(DEVICE), k_dev, v_dev, slots.to(DEVICE), kv_heads, int(math.log2(block_size)),
        1.0, 1.0, key.stride(0), key.stride(1), value.stride(0), value.stride(1), *k_cache.stride()[:3],
        *v_cache.stride()[:3], HEAD_DIM=head_dim, HEAD_PAD=head_pad, BLOCK_H=block_h, FP8=False, SOFT_FP8=False)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_cache.view(-1, kv_heads, head_dim)[slot] = key[t]
            v_cache.view(-1, kv_heads, head_dim)[slot] = value[t]
    assert torch.equal(k_dev.cpu(), k_cache) and torch.equal(v_dev.cpu(), v_cache)  # nothing else touched
