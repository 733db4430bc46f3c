"""GPU checks (`pytest -m gpu`; skipped without CUDA): every available attention backend on CUDA against the float64
reference, the CUDA extension's build and kernels (decode variants, block copies and host <-> device swaps), and the
engine's tokens with "auto" (on a fast backend) against the torch backend; decode steps replayed as CUDA graphs against
the same steps run eagerly (plus their step time with and without graphs, printed), and a capture that fails.

A backend that is not installed is skipped with its reason; the CUDA extension must build wherever its
prerequisites (CUDA torch, nvcc, ninja) are present.
"""
import pytest
import torch
from test_attention import MIXED, make_case, reference

from hf_paged.attention import AttentionMetadata, cuda_backend, paged_attention, unavailable, why_not
from hf_paged.kv.swap import copy_blocks as torch_copy_blocks

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BACKENDS = ["cuda", "flash3", "flash2", "flashinfer", "triton", "torch"]
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2.5e-2}
DECODES = [(1, n) for n in (1, 15, 16, 17, 100, 257, 64, 3, 700, 33, 1500)]


def cuda_case(seqs, heads, kv_heads, head_dim, block_size, dtype, seed):
    query, kc, vc, cu, ctx, tables, keys, values = make_case(seqs, heads, kv_heads, head_dim, block_size, dtype, seed)
    return [t.cuda() for t in (query, kc, vc, cu, ctx, tables)], keys, values


def metadata_for(seqs, ctx, tables, block_size):
    qlens = [q for q, _ in seqs]
    rows = tables.tolist()
    slots = [rows[b][p // block_size] * block_size + p % block_size
             for b, (q, c) in enumerate(seqs) for p in range(c - q, c)]
    return AttentionMetadata.build(qlens, ctx.tolist(), rows, slots, block_size, torch.device("cuda"))


def test_cuda_extension_builds():
    missing = cuda_backend.prerequisites_missing()
    if missing is not None:
        pytest.skip(f"cannot build here: {missing}")
    assert cuda_backend.extension_status() == "loaded"


@pytest.mark.parametrize("window, softcap", [(None, None), (37, None), (None, 20.0), (50, 5.0)])
@pytest.mark.parametrize("heads, kv_heads", [(32, 8), (8, 1), (8, 8), (12, 2)])  # GQA 4, MQA, MHA, GQA 6
@pytest.mark.parametrize("kind", ["mixed", "decode"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_matches_float64(backend, dtype, kind, heads, kv_heads, window, softcap):
    reason = unavailable(backend, torch.device("cuda"))
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")
    seqs = MIXED if kind == "mixed" else DECODES
    block_size = 256 if backend == "flash2" else 16
    (query, kc, vc, cu, ctx, tables), keys, values = cuda_case(seqs, heads, kv_heads, 128, block_size, dtype,
                                                               seed=heads + kv_heads)
    meta = metadata_for(seqs, ctx, tables, block_size)
    reason = why_not(backend, query, kc, meta, window, softcap)
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")
    hf_query = query.transpose(0, 1).contiguous().transpose(0, 1)  # the strides transformers hands over
    out = paged_attention(hf_query, kc, vc, metadata=meta, scale=128 ** -0.5, sliding_window=window, softcap=softcap,
                          backend=backend)
    assert out.dtype == dtype and out.shape == query.shape
    ref = reference(query.cpu(), keys, values, [q for q, _ in seqs], 128 ** -0.5, window, softcap)
    # libraries may soft-cap with tanh.approx (relative error ~5e-4 of each capped logit)
    tol = max(TOL[dtype], 6e-3) if softcap and backend != "cuda" else TOL[dtype]
    torch.testing.assert_close(out.double().cpu(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 4), (6, 2), (16, 4), (24, 3), (32, 2)])  # groups 1-16
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_cuda_decode_kernel_variants(dtype, head_dim, heads, kv_heads):
    if cuda_backend.unavailable_reason(torch.device("cuda")):
        pytest.skip(cuda_backend.extension_status())
    for block_size, window, softcap in ((16, None, None), (7, 100, None), (32, 300, 10.0)):  # 7: not a power of two
        (query, kc, vc, cu, ctx, tables), keys, values = cuda_case(DECODES, heads, kv_heads, head_dim, block_size,
                                                                   dtype, seed=head_dim + heads + block_size)
        meta = metadata_for(DECODES, ctx, tables, block_size)
        ref = reference(query.cpu(), keys, values, [1] * len(DECODES), 0.1, window, softcap)
        for partition_size in (-1, 0, 64):  # one pass, automatic, forced split + reduce
            out = cuda_backend.paged_attention(query, kc, vc, meta, 0.1, window, softcap, partition_size=partition_size)
            where = f"block {block_size} window {window} softcap {softcap} partitions {partition_size}"
            torch.testing.assert_close(out.double().cpu(), ref, atol=TOL[dtype], rtol=TOL[dtype],
                                       msg=lambda m, where=where: f"{where}: {m}")


def test_cuda_decode_plan():
    if cuda_backend.unavailable_reason(torch.device("cuda")):
        pytest.skip(cuda_backend.extension_status())
    assert cuda_backend.decode_plan(64, 32, 8, 128, 100) == (0, 1)  # short: one pass
    size, count = cuda_backend.decode_plan(1, 32, 8, 128, 32768)  # one long sequence: split over the SMs
    assert size > 0 and count == -(-32768 // size)
    assert cuda_backend.decode_plan(1, 32, 8, 128, 32768, sliding_window=1000)[1] == -(-1000 // size)
    assert cuda_backend.decode_plan(4, 32, 8, 128, 1000, partition_size=100) == (100, 10)


def test_cuda_copy_blocks_on_device_and_swaps_through_pinned_memory():
    if cuda_backend.unavailable_reason(torch.device("cuda")):
        pytest.skip(cuda_backend.extension_status())
    shape = (3, 2, 32, 16, 2, 64)  # [layers, 2, blocks, block_size, H_kv, D]
    device = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    src, dst = [3, 4, 5, 9, 0], [10, 11, 12, 1, 31]
    expected = device.clone()
    torch_copy_blocks(expected, expected, src, dst)
    cuda_backend.copy_blocks(device, device, src, dst)
    assert torch.equal(device, expected)
    host = torch.zeros((3, 2, 40, 16, 2, 64), dtype=torch.bfloat16, pin_memory=True)
    host_ids = [7, 8, 9, 39, 2]
    cuda_backend.copy_blocks(device, host, src, host_ids)  # swap out: one launch writing pinned host memory
    torch.cuda.synchronize()
    assert torch.equal(host[:, :, host_ids], device[:, :, src].cpu())
    back = torch.zeros_like(device)
    cuda_backend.copy_blocks(host, back, host_ids, dst)  # swap in
    torch.cuda.synchronize()
    assert torch.equal(back[:, :, dst], device[:, :, src])


FAST_BACKENDS = ("flash3", "flashinfer", "flash2", "cuda", "triton")


def fast_backends_covering(seqs, dtype) -> list[str]:
    """The fast backends that can run a step of `seqs` for the model below (4 heads, 2 KV heads, head_dim 64,
    block 16), asked one by one (not through the chooser)."""
    (query, kc, _, _, ctx, tables), _, _ = cuda_case(seqs, 4, 2, 64, 16, dtype, seed=0)
    meta = metadata_for(seqs, ctx, tables, 16)
    return [name for name in FAST_BACKENDS if why_not(name, query, kc, meta, None, None) is None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_engine_auto_backend_matches_torch_backend(dtype):
    """Greedy tokens with attention_backend="auto" (the fastest available per kind of step) equal the torch backend's:
    all of them in fp32; in bf16 (kernels round differently) every row's first tokens and most rows entirely. "auto"
    must really have run its decode steps on a fast backend (else this compares torch with torch)."""
    import hf_paged
    from hf_paged.tiny import tiny_model

    decode_fast, prefill_fast = fast_backends_covering(DECODES, dtype), fast_backends_covering(MIXED, dtype)
    if not decode_fast:
        pytest.skip("no fast attention backend can run these decodes here: 'auto' would be the torch backend")
    model = tiny_model("llama", hidden=256, layers=2, heads=4, kv_heads=2, vocab_size=512, dtype=dtype).cuda()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 40, 17, 90, 3, 64)]
    params = hf_paged.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "auto"):
        llm = hf_paged.LLM(model, block_size=16, num_blocks=128, attention_backend=backend)
        outputs[backend] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    decisions = llm.engine.runner.backends.decisions
    chosen = {("prefill" if kind.has_prefills else "decode"): backend.name for kind, backend in decisions.items()}
    print(f"\nfast backends for decodes {decode_fast}, for prefills {prefill_fast}; auto chose: {chosen}")
    assert chosen["decode"] == decode_fast[0]  # AUTO_ORDER lists the fast backends in FAST_BACKENDS' order
    assert chosen["prefill"] == (prefill_fast[0] if prefill_fast else "torch")
    if dtype == torch.float32:
        assert outputs["auto"] == outputs["torch"]
    else:
        assert_bf16_flips_only(model, prompts, outputs["auto"], outputs["torch"])


def assert_bf16_flips_only(model, prompts, rows_a, rows_b, spacings: float = 4.0):
    """bf16 rows may part where the two tokens chosen are within a few bf16 spacings of each other in float32 math
    (the kernels round in a different order); a wider gap is a real difference."""
    from conftest import fp32_divergences

    found = fp32_divergences(model, prompts, rows_a, rows_b)
    print(f"\nbf16 divergences (row, step, fp32 gap, bf16 spacing): {found}")
    assert all(gap <= spacings * spacing for _, _, gap, spacing in found), found


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "gpt2", "mixtral"])
def test_generate_takeover_matches_hf_fp32(arch):
    """On CUDA in fp32, generate(cache_implementation="paged") (the engine, "auto" backends) gives HF generate's tokens
    on a left-padded batch (a divergence only on HF's own near tie, bounded as everywhere)."""
    from conftest import assert_same_as_hf, left_padded_batch

    from hf_paged.tiny import tiny_model

    model = tiny_model(arch).cuda()
    ids, mask = left_padded_batch([5, 17, 40, 3, 64, 90])
    assert_same_as_hf(model, ids.cuda(), mask.cuda(), max_new_tokens=24, min_new_tokens=24, do_sample=False)


def test_engine_swaps_through_the_copy_kernel_and_keeps_outputs():
    """On CUDA a pressured pool swaps requests out to pinned host memory and back through the extension's copy kernel
    (engine/memory.py: swap_copy) on the swap pool's side stream; every request keeps the tokens of an unpressured run."""
    import hf_paged
    from hf_paged.engine.memory import swap_copy
    from hf_paged.tiny import tiny_model

    if cuda_backend.unavailable_reason(torch.device("cuda")):
        pytest.skip(cuda_backend.extension_status())
    assert swap_copy(torch.device("cuda"), "auto") is cuda_backend.copy_blocks
    assert swap_copy(torch.device("cuda"), "torch") is not cuda_backend.copy_blocks  # no nvcc build for it
    model = tiny_model("llama", hidden=256, heads=4, kv_heads=2, max_len=512).cuda()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (40, 33, 57, 21, 48, 36)]
    params = hf_paged.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    runs = {}
    for pressured in (False, True):
        options = dict(num_blocks=24, max_num_batched_tokens=64, preemption_mode="swap", swap_space=1 << 24) \
            if pressured else dict(num_blocks=256)
        llm = hf_paged.LLM(model, block_size=4, cuda_graphs=False, **options)
        runs[pressured] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.engine.memory.swap.copy is cuda_backend.copy_blocks
    stats = llm.stats()
    print(f"\nswaps on CUDA: {stats['num_swap_outs']} out, {stats['num_swap_ins']} in, "
          f"{stats['num_blocks_swapped']} blocks")
    assert stats["num_swap_outs"] > 0 and stats["num_recomputed_tokens"] == 0
    assert runs[True] == runs[False]


# ---- decode steps as CUDA graphs (hf_paged/cuda_graphs.py; the padded path itself is tested on CPU) ----------------
def _graph_llm(model, backend, cuda_graphs=True, num_blocks=64, **options):
    import hf_paged

    return hf_paged.LLM(model, block_size=16, num_blocks=num_blocks, attention_backend=backend,
                        cuda_graphs=cuda_graphs, preemption_mode="recompute", **options)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_engine_cuda_graphs_match_eager(monkeypatch, backend, dtype):
    """5 ragged requests finishing at different times (buckets 8, 4, 2, 1): tokens from graph replays equal the same
    padded path run without capture (same kernels, same shapes) and the engine without graphs (fp32: all; bf16: the
    padded batch changes GEMM shapes, so first tokens of every row and most rows entirely)."""
    import hf_paged
    from hf_paged.engine.cuda_graphs import DecodeGraphSettings
    from hf_paged.tiny import tiny_model

    reason = unavailable(backend, torch.device("cuda"))
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")
    model = tiny_model("llama", hidden=256, layers=2, heads=4, kv_heads=2, vocab_size=512, max_len=256,
                       dtype=dtype).cuda()  # head_dim 64; max_len 256 keeps the pinned context to one kernel pass
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 40, 17, 90, 3)]
    params = [hf_paged.SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0) for n in (20, 7, 13, 25, 4)]

    def tokens(llm):
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    replay = _graph_llm(model, backend)
    replayed = tokens(replay)
    graphs = replay.engine.runner.graphs
    assert graphs.off_reason is None, graphs.off_reason
    assert sorted(graphs.captured) == [1, 2, 4, 8] and sum(graphs.steps_per_bucket.values()) == 24
    eager = tokens(_graph_llm(model, backend, cuda_graphs=False))
    build = DecodeGraphSettings.build
    monkeypatch.setattr(DecodeGraphSettings, "for_engine", staticmethod(
        lambda config, device, blocks, max_len: build(config, blocks, max_len, capture=False)))
    uncaptured = _graph_llm(model, backend)
    padded = tokens(uncaptured)
    assert not uncaptured.engine.runner.graphs.captured
    print(f"\n{backend} {dtype}: graphs {graphs.stats()}")
    assert replayed == padded
    if dtype == torch.float32:
        assert replayed == eager
    else:
        assert [row[:4] for row in replayed] == [row[:4] for row in eager]
        assert sum(a == b for a, b in zip(replayed, eager)) >= len(prompts) - 2


def test_cuda_graphs_decode_step_time():
    """Decode step time of 32 sequences with and without graphs (printed for the GPU log; no speed assertion)."""
    import time

    import hf_paged
    from hf_paged.tiny import tiny_model

    backend = next((b for b in ("cuda", "triton") if unavailable(b, torch.device("cuda")) is None), None)
    if backend is None:
        pytest.skip("neither the cuda nor the triton backend is available")
    model = tiny_model("llama", hidden=512, layers=8, heads=8, kv_heads=2, vocab_size=1024, max_len=512,
                       dtype=torch.bfloat16).cuda()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 1024, (32,), generator=gen).tolist() for _ in range(32)]
    params = hf_paged.SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    times = {}
    for cuda_graphs in (False, True):
        engine = _graph_llm(model, backend, cuda_graphs, num_blocks=256, max_num_seqs=32).engine
        for prompt in prompts:
            engine.add_request(prompt, params)
        steps = []
        while engine.has_unfinished:
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
        times[cuda_graphs] = sorted(steps[3:])[len(steps[3:]) // 2] * 1e3  # median decode step (after capture)
        if cuda_graphs:
            assert engine.runner.graphs.off_reason is None and engine.runner.graphs.captured
    print(f"\ndecode step, 32 seqs, 8 layers, bf16, {backend} backend: eager {times[False]:.2f} ms, "
          f"CUDA graphs {times[True]:.2f} ms ({times[False] / times[True]:.2f}x)")


def test_cuda_graphs_fall_back_when_capture_fails(monkeypatch):
    """A forward that syncs cannot be captured (here one MLP reads a value back to the host, as data-dependent MoE
    routing does): the first capture fails, graphs turn off with the reason, nothing is captured, and the tokens are
    those of the engine without graphs. (Last in the file: it runs a capture that fails.)"""
    import hf_paged
    from hf_paged.tiny import tiny_model

    backend = next((b for b in ("cuda", "triton") if unavailable(b, torch.device("cuda")) is None), None)
    if backend is None:
        pytest.skip("neither the cuda nor the triton backend is available")
    model = tiny_model("llama", hidden=256, heads=4, kv_heads=2, max_len=256).cuda()
    mlp = model.model.layers[0].mlp
    mlp_forward = mlp.forward
    host_reads = []

    def syncing_forward(x):
        host_reads.append(x.abs().amax().item())  # .item() waits for the device: not allowed while capturing
        return mlp_forward(x)

    monkeypatch.setattr(mlp, "forward", syncing_forward)
    prompts = [[5, 9, 30, 7], [11, 3, 4, 5, 6, 7, 8, 9, 10]]
    params = hf_paged.SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0)
    outputs = {}
    for cuda_graphs in (False, True):
        llm = _graph_llm(model, backend, cuda_graphs)
        outputs[cuda_graphs] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    graphs = llm.engine.runner.graphs
    print(f"\nsyncing forward: {graphs.stats()}")
    assert host_reads  # the patched forward really ran
    assert graphs.off_reason is not None and "capturing the decode graph" in graphs.off_reason, graphs.off_reason
    assert not graphs.captured
    assert outputs[True] == outputs[False]
