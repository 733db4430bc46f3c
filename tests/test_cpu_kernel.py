"""attention/cpu_kernel.py: the native CPU decode kernel against the float64 reference (head dims it specializes and
a generic one, GQA / MQA / MHA, window, softcap, HF's key mask with ALiBi or sinks), and its cached build: a damaged
one is rebuilt, never loaded."""
import shutil

import pytest
import torch

from hf_paged import native
from hf_paged.attention import LayerExtras, cpu_kernel, cpu_kernel_status, decode_choice, paged_attention
from hf_paged.attention.cpu_kernel import load_cpu_kernel

from test_attention import make_case, reference


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler here")
@pytest.mark.parametrize("head_dim, heads, kv_heads, window, softcap", [
    (64, 8, 2, None, None), (128, 8, 1, None, None), (80, 4, 4, 37, None), (64, 16, 2, 100, 4.0),
    (40, 6, 3, 50, None), (128, 8, 2, None, 1e5)])  # a cap far above the scores: tanh(x) ~ x, exact to rounding
def test_native_cpu_decode_kernel_builds_and_matches_reference(head_dim, heads, kv_heads, window, softcap):
    """Decodes only (the kernel's case), long uneven contexts over a shuffled pool; the head dims the kernel
    specializes (64, 128) and generic ones (80, 40), GQA / MQA / MHA, sliding window and softcap. 2 sequences (an
    item per kv head, so few sequences still use every thread) and 40 (an item per sequence, all its kv heads)."""
    assert cpu_kernel_status() == "loaded"
    lengths = (1, 15, 16, 17, 100, 257, 64, 3, 190, 33)
    for seqs in ([(1, n) for n in lengths[4:6]], [(1, n) for n in lengths * 4]):
        query, kc, vc, cu, ctx, tables, keys, values = make_case(seqs, heads, kv_heads, head_dim, 16, torch.float32,
                                                                 seed=5 + head_dim)
        scale = head_dim ** -0.5
        ref = reference(query, keys, values, [1] * len(seqs), scale, window, softcap)
        native = paged_attention(query, kc, vc, cu, ctx, tables, scale=scale, sliding_window=window,
                                 softcap=softcap, backend="auto")
        torch.testing.assert_close(native.double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, softcap, extra", [(None, None, None), (50, None, "alibi"), (None, 4.0, "sinks")])
def test_native_cpu_decode_kernel_with_a_key_mask(window, softcap, extra, dtype):
    """The key mask of HF's own loop (padding, gaps): left-out keys take no part, whatever they hold; a sequence
    with every key left out gets zeros (and, with sinks, the sink alone). fp32 pages take the per-key path, bf16
    pages the vector path."""
    seqs = [(1, n) for n in (1, 17, 100, 64, 33, 40)]
    heads, kv_heads, head_dim = 8, 2, 64
    query, kc, vc, cu, ctx, tables, keys, values = make_case(seqs, heads, kv_heads, head_dim, 16, dtype, 9)
    gen = torch.Generator().manual_seed(3)
    masks = [torch.rand(n, generator=gen) > 0.3 for _, n in seqs]
    masks[1][:9] = False  # left padding
    masks[4][:] = False  # nothing to attend
    masks[5][:] = True
    width = max(n for _, n in seqs) + 5
    key_mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for row, m in enumerate(masks):
        key_mask[row, :len(m)] = m
    per_head = torch.linspace(-1.0, 1.0, heads)
    sinks, alibi = (per_head, None) if extra == "sinks" else (None, per_head.abs() * 0.1 if extra else None)
    out = load_cpu_kernel()(query, kc, vc, tables.long(), ctx.long(), head_dim ** -0.5, window, softcap,
                            LayerExtras(sinks=sinks, alibi_slopes=alibi), key_mask=key_mask)
    ref = reference(query, keys, values, [1] * len(seqs), head_dim ** -0.5, window, softcap, sinks=sinks,
                    alibi=alibi, key_masks=masks)
    tolerance = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), ref, atol=tolerance, rtol=tolerance)
    assert not out[4].any()


def test_a_damaged_cached_cpu_kernel_is_rebuilt_not_loaded(tmp_path, monkeypatch):
    """A truncated .so in the cache (an interrupted copy, a full disk) would kill the process when mapped: the
    build's size + hash stamp does not match it, so it is rebuilt instead."""
    monkeypatch.setenv("HF_PAGED_CACHE_DIR", str(tmp_path))
    try:
        built = native.build(cpu_kernel.SOURCE)
    except (RuntimeError, OSError) as e:  # no C compiler here: nothing to check
        pytest.skip(f"no C compiler: {e}")
    whole = built.read_bytes()
    built.write_bytes(whole[: len(whole) // 3])  # truncated in place
    assert not native.is_complete(built)
    again = native.build(cpu_kernel.SOURCE)
    assert again == built and len(again.read_bytes()) > len(whole) // 3 and native.is_complete(again)
    built.with_suffix(".sha256").unlink()  # a build without its stamp (e.g. from an older version) is rebuilt too
    assert not native.is_complete(built)
    cpu_kernel.CpuDecodeKernel(native.build(cpu_kernel.SOURCE))  # and loads


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler here")
@pytest.mark.parametrize("head_dim, heads, kv_heads, window", [
    (64, 8, 2, None), (80, 8, 2, 37), (128, 8, 1, None), (96, 12, 2, None), (256, 7, 1, 50), (40, 6, 3, None)])
def test_native_cpu_decode_kernel_reads_bf16_pages(head_dim, heads, kv_heads, window, monkeypatch):
    """bf16 pages (a bf16 model's cache): the kernel widens each element as it reads it and sums in fp32, so its
    output is the float64 reference on the same bf16 values up to the output's bf16 rounding; "auto" takes it. Head
    dims that are a multiple of 16 take the vector path (the specialized 64 and 128, generic ones, tails of heads
    per KV head and of 64-dim blocks: 12 / 2 heads of 96, 7 / 1 of 256), 40 the per-key one; 1-17 keys are the
    16-key chunks' tails."""
    seqs = [(1, n) for n in (1, 17, 100, 257, 64, 33, 15, 16) * 3]
    query, kc, vc, cu, ctx, tables, keys, values = make_case(seqs, heads, kv_heads, head_dim, 16, torch.bfloat16,
                                                             seed=11)
    ref = reference(query, keys, values, [1] * len(seqs), head_dim ** -0.5, window, None)
    assert cpu_kernel.usable(query, kc)
    direct = load_cpu_kernel()(query, kc, vc, tables.long(), ctx.long(), head_dim ** -0.5, window, None)
    monkeypatch.setenv(decode_choice.SWITCH, "kernel")  # the kernel's own default path, not a timed trial's pick
    decode_choice.TABLE.clear()
    auto = paged_attention(query, kc, vc, cu, ctx, tables, scale=head_dim ** -0.5, sliding_window=window,
                           backend="auto")
    assert direct.dtype == torch.bfloat16
    torch.testing.assert_close(direct.double(), ref, atol=1e-2, rtol=1e-2)
    decode_choice.TABLE.clear()  # the forced choice stays with this test
    assert torch.equal(auto, direct)


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler here")
def test_a_step_of_decodes_only_reaches_the_kernel_without_a_decode_tile(monkeypatch):
    """A step of decodes only calls the kernel with the step's own tables (`AttentionMetadata.decode_tables`: no
    per-step tile of the decodes is built), columns past every context (blocks held ahead, the null block) included:
    the same output as the reference."""
    from hf_paged.attention import AttentionMetadata

    seqs = [(1, n) for n in (1, 15, 16, 17, 100, 33)]
    query, kc, vc, cu, ctx, tables, keys, values = make_case(seqs, 8, 2, 64, 16, torch.float32, seed=3)
    wider = torch.cat([tables, torch.randint(0, kc.shape[0], (tables.shape[0], 3), dtype=tables.dtype)], dim=1)
    ref = reference(query, keys, values, [1] * len(seqs), 0.125, None, None)

    def no_tile(self):
        raise AssertionError("a decode tile was built for a step of decodes only")
    monkeypatch.setattr(AttentionMetadata, "all_decodes", no_tile)
    monkeypatch.setattr(AttentionMetadata, "decode_tiles", no_tile)
    monkeypatch.setenv(decode_choice.SWITCH, "kernel")
    decode_choice.TABLE.clear()
    try:
        out = paged_attention(query, kc, vc, cu, ctx, wider, scale=0.125, backend="auto")
    finally:
        decode_choice.TABLE.clear()
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
