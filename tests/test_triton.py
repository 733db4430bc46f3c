"""The Triton backend (attention and store kernels) against float64 / torch references, run by the
Triton interpreter on CPU (compiled, on a GPU machine), plus an ahead-of-time sm_90 compile of every kernel variant
class the dispatcher picks."""
import os

import torch  # (importing torch does not import triton)

# Must come before the kernels are defined: @triton.jit decides at decoration time whether a kernel is compiled or
# interpreted, so the interpreter has to be on before hf_paged.attention.triton_kernels is first imported (this
# module imports it at collection). Only where there is no CUDA: on a GPU machine the same tests run the compiled
# kernels, and the interpreter must stay off there, or every later use of the backend in the session (e.g.
# tests/test_gpu.py's triton cases, collected with this file even under `-m gpu`) would get interpreter kernels.
# triton itself may already be loaded at this point (conftest -> transformers -> torch._dynamo imports it); that is
# why the kernels call only tl builtins, never tl's own @jit helpers, which would then be compiled-mode objects.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")

import dataclasses
import itertools
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="triton is not installed (pip install 'hf_paged[triton]'); "
                                              "CI installs it, so there this file runs")

from test_attention import MIXED, make_case, reference

from hf_paged.attention import AttentionMetadata, paged_attention, store_kv
from hf_paged.attention import triton_backend as tb
from hf_paged.attention.backends.triton_varlen import TritonBackend

REPO = Path(__file__).resolve().parents[1]


def metadata_of(cu, context_lens, tables, block_size):
    """Just the varlen tensors the kernel reads (no dense group plans)."""
    bounds = cu.tolist()
    query_lens = [b - a for a, b in itertools.pairwise(bounds)]
    return AttentionMetadata(cu_seqlens_q=cu, context_lens=context_lens, block_tables=tables,
                             slot_mapping=torch.zeros(0, dtype=torch.int64), max_query_len=max(query_lens),
                             max_context_len=int(context_lens.max()), block_size=block_size)


def run_case(seqs, heads, kv_heads, head_dim, block_size, dtype=torch.float32, scale=0.2, window=None, softcap=None,
             num_splits=None, seed=0):
    case = make_case(seqs, heads, kv_heads, head_dim, block_size, dtype, seed)
    query, kc, vc, cu, ctx, tables = (t.to(DEVICE) for t in case[:6])
    meta = metadata_of(cu, ctx, tables, block_size)
    assert TritonBackend().unsupported_reason(query, kc, meta, window, softcap) is None
    out = tb.paged_attention(query, kc, vc, meta, scale, window, softcap, num_splits=num_splits)
    assert out.dtype == dtype and out.shape == query.shape
    return out.cpu(), reference(case[0], case[6], case[7], [q for q, _ in seqs], scale, window, softcap)


def test_backend_is_available():
    assert TritonBackend.unavailable_reason(DEVICE) is None


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (8, 1), (16, 2)])  # MHA, GQA 4, MQA, GQA 8
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_mixed_batch_matches_float64(heads, kv_heads, block_size):
    """Decodes, fresh prompts and chunked prefills over cached context, contexts on and off block boundaries."""
    out, ref = run_case(MIXED, heads, kv_heads, 32, block_size, seed=heads * block_size + kv_heads)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("block_size", [64, 128])
def test_large_blocks(block_size):
    out, ref = run_case([(1, 70), (6, 133), (3, 3)], 4, 2, 32, block_size, seed=block_size)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_many_query_tiles_per_sequence():
    """MHA prefill tiles hold 64 tokens: a 150-token chunk spans three tiles, each skipping the keys after it."""
    out, ref = run_case([(150, 170), (1, 9), (65, 65)], 2, 2, 16, 16, seed=4)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_odd_gqa_ratio_and_padded_head_dim():
    """3 query heads per KV head (a 64-row tile holds 21 tokens, one row idle) and a 40-wide head (padded to 64)."""
    out, ref = run_case(MIXED, 6, 2, 40, 16, seed=9)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window, softcap", [(7, None), (None, 5.0), (12, 3.0)])
def test_sliding_window_and_softcap(window, softcap):
    out, ref = run_case(MIXED, 8, 2, 32, 8, scale=0.25, window=window, softcap=softcap, seed=11)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


# bf16: under the interpreter the kernel upcasts its bf16 loads to fp32 (numpy has no bfloat16, the interpreter
# carries it as raw uint16 and its dot would be garbage; see UPCAST in triton_kernels.py) and rounds the output
# toward zero, so allow ~1 bf16 ulp.
@pytest.mark.parametrize("dtype, tol", [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_half_precision(dtype, tol):
    out, ref = run_case(MIXED, 8, 2, 64, 16, dtype=dtype, scale=0.125, softcap=20.0, seed=3)
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


LONG_DECODES = [(1, n) for n in (300, 1, 77, 520, 129)]


@pytest.mark.parametrize("heads, kv_heads, window, softcap", [(8, 2, None, None), (4, 1, 100, 4.0), (4, 4, None, None)])
def test_split_kv_decode(heads, kv_heads, window, softcap):
    """Long decodes forced through the split-KV path (partials + reduce kernel); the 1-token sequence leaves
    most of its splits empty, the window others."""
    out, ref = run_case(LONG_DECODES, heads, kv_heads, 32, 16, window=window, softcap=softcap, num_splits=5, seed=7)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("num_splits", [1, None])  # None: the split rule (2 splits for these 520 keys)
def test_decode_only_batch(num_splits):
    """Decode-only steps take 16-row tiles (here 2 tokens x 8 heads of a GQA group)."""
    out, ref = run_case(LONG_DECODES, 16, 2, 32, 8, num_splits=num_splits, seed=12)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_split_kv_half_precision():
    out, ref = run_case(LONG_DECODES, 8, 1, 64, 32, dtype=torch.bfloat16, scale=0.125, num_splits=3, seed=8)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


# FP8 caches: pages hold value / scale as float8_e4m3fn. The references read the DEQUANTIZED pages back in float64,
# so all that is left to tolerate is the kernel's arithmetic (as for fp32 caches, relative to V's magnitude).
FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE, V_GAIN = 0.05, 0.2, 8.0
FP8_TOL = 2e-5 * V_GAIN


def test_split_rule():
    # prefill or mixed steps never split; short contexts never; a busy GPU never
    assert tb.split_count(4, 8, 2, 8192, 132) == 1
    assert tb.split_count(4, 8, 1, 300, 132) == 1
    assert tb.split_count(64, 8, 1, 8192, 132) == 1
    assert tb.split_count(4, 8, 1, 8192, 132) == 9  # fill 2 waves of 132 SMs with 32 (seq, kv head) programs
    assert tb.split_count(1, 1, 1, 8192, 132) == tb.MAX_SPLITS
    assert tb.split_count(1, 8, 1, 1024, 132) == 4  # each split keeps >= 256 keys
    assert tb.split_count(1, 8, 1, 100_000, 132, sliding_window=512) == 2


def test_public_entry_point_and_strided_query():
    """backend="triton" through attention.paged_attention (raw varlen tensors), with a query that is a transposed
    view as the HF integration passes it."""
    case = make_case(MIXED, 8, 2, 32, 16, torch.float32, seed=2)
    query, kc, vc, cu, ctx, tables = (t.to(DEVICE) for t in case[:6])
    keys, values = case[6:]
    strided = query.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous()
    out = paged_attention(strided, kc, vc, cu, ctx, tables, scale=0.2, backend="triton").cpu()
    query = query.cpu()
    ref = reference(query, keys, values, [q for q, _ in MIXED], 0.2, None, None)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_reasons(monkeypatch):
    query, kc, _, cu, ctx, tables, *_ = make_case([(1, 4)], 2, 1, 32, 8, torch.float32, seed=0)
    meta = metadata_of(cu, ctx, tables, 8)
    backend = TritonBackend()
    assert backend.unsupported_reason(query, kc, meta, None, None) is None
    assert "block size" in backend.unsupported_reason(query, torch.zeros(3, 12, 1, 32), meta, None, None)
    assert "head dims" in backend.unsupported_reason(query[..., :8], kc[..., :8], meta, None, None)
    assert "float16" in backend.unsupported_reason(query.double(), kc.double(), meta, None, None)
    assert "match" in backend.unsupported_reason(query, kc.half(), meta, None, None)
    assert backend.unsupported_reason(query.bfloat16(), kc.to(FP8), meta, None, None) is None
    assert "float8_e4m3fn" in backend.unsupported_reason(query, kc.to(torch.float8_e5m2), meta, None, None)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert TritonBackend.unavailable_reason(torch.device("cpu")) == "triton needs a CUDA device (or TRITON_INTERPRET=1)"


@pytest.mark.parametrize("key_dtype, cache_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                    (torch.float16, torch.float16)])
def test_store_kv_matches_torch(key_dtype, cache_dtype):
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, kv_heads, head_dim, tokens = 6, 8, 3, 32, 13
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    key = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(key_dtype)
    value = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(key_dtype)
    caches = [torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype) for _ in range(2)]
    expected = [c.clone() for c in caches]
    store_kv(key, value, *expected, slots)
    padded = torch.cat([slots, torch.tensor([-1])])  # a padding row (slot -1) is skipped
    pad_row = torch.full((1, kv_heads, head_dim), 7.0).to(key_dtype)
    strided_key = torch.cat([key, pad_row]).transpose(0, 1).contiguous().transpose(0, 1)  # non-contiguous rows
    assert not strided_key.to(DEVICE).is_contiguous()
    on_device = [c.to(DEVICE) for c in caches]
    tb.triton_store_kv(strided_key.to(DEVICE), torch.cat([value, pad_row]).to(DEVICE), *on_device, padded.to(DEVICE))
    for got, want in zip(on_device, expected):
        got = got.cpu()
        if key_dtype == cache_dtype or DEVICE.type == "cuda":
            assert torch.equal(got, want)
        else:  # the interpreter's fp32 -> bf16 cast rounds toward zero (GPUs round to nearest even): 1 ulp
            torch.testing.assert_close(got, want, atol=0, rtol=2 ** -7)


def test_kernel_configs_cover_dispatch():
    configs = tb.kernel_configs()
    assert len(configs) == len(set(configs))
    assert {c.head_pad for c in configs} == {16, 32, 64, 128, 256}
    assert {(c.dtype, c.kv_dtype, c.split, c.softcap) for c in configs} >= {
        (d, kv, s, c) for d in ("fp16", "bf16", "fp32") for kv in (d, "fp8e4nv") for s in (False, True)
        for c in (False, True)}
    for c in configs:  # power-of-two row tiles holding >= 1 token of the whole GQA group; tl.dot needs >= 16
        assert c.block_m >= 16 and c.block_m & (c.block_m - 1) == 0 and c.block_q >= 1 and c.tile_n >= 16
    assert tb.choose_config("bf16", 128, 4, True, False, True) in configs
    assert tb.choose_config("bf16", 128, 4, False, True, False, "fp8e4nv") in configs


# Ahead-of-time compile for sm_90 (no GPU needed: triton ships ptxas). It runs in a subprocess because this process
# has TRITON_INTERPRET=1, under which @triton.jit gives interpreter functions that cannot be compiled.
COMPILE_SCRIPT = textwrap.dedent("""
    import itertools, json, os, subprocess, sys, tempfile
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from hf_paged.attention import triton_backend as tb, triton_kernels as kernels

    target = GPUTarget("cuda", 90, 32)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")

    def build(fn, signature, constexprs, attrs, num_warps, num_stages=3):
        k = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                           options=dict(num_warps=num_warps, num_stages=num_stages))
        usage = ""
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"]); f.flush()
            out = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
            usage = next((l.strip() for l in out.splitlines() if "REG:" in l), "")
        fields = dict(item.split(":", 1) for item in usage.split() if ":" in item)
        # fp8 stores: IEEE division and a round-to-nearest-even, saturating cast, as torch's quantize
        fp8_rn = "div.rn.f32" in k.asm["ptx"] and "cvt.rn.satfinite.e4m3x2.f32" in k.asm["ptx"]
        return dict(ptx=".target sm_90" in k.asm["ptx"], cubin=len(k.asm["cubin"]), fp8_rn=fp8_rn,
                    regs=int(fields.get("REG", -1)), stack=int(fields.get("STACK", -1)), shared=k.metadata.shared)

    chosen = json.loads(sys.argv[1])
    configs = tb.kernel_configs() if chosen == "all" else [tb.KernelConfig(**c) for c in chosen]
    results = []
    for c in configs:
        sig, constexprs, attrs = tb.kernel_signature(c)
        r = build(kernels.paged_attention_kernel, sig, constexprs, attrs, c.num_warps, c.num_stages)
        results.append(dict(config=repr(c), **r))
    for dtype, head_dim in itertools.product(("fp16", "bf16", "fp32"), (64, 128, 256)):
        pad = tb._pow2(head_dim)
        sig = dict(out_ptr="*" + dtype, part_m_ptr="*fp32", part_l_ptr="*fp32", part_acc_ptr="*fp32",
                   num_splits="i32", stride_ot="i32", stride_oh="i32", HEAD_DIM="constexpr", HEAD_PAD="constexpr")
        r = build(kernels.reduce_splits_kernel, sig, dict(HEAD_DIM=head_dim, HEAD_PAD=pad), {}, 4 if pad >= 256 else 2)
        results.append(dict(config=f"reduce {dtype} {head_dim}", **r))
        for cache in (dtype, "fp8e4nv"):
            names = kernels.store_kv_kernel.arg_names
            sig = {n: "*" + cache if n.endswith("cache_ptr") else "*" + dtype if n in ("key_ptr", "value_ptr")
                   else "*i64" if n.endswith("_ptr") else "constexpr" if n.isupper() else "fp32"
                   if n.endswith("_scale") else "i32" for n in names}
            constexprs = dict(HEAD_DIM=head_dim, HEAD_PAD=pad, BLOCK_H=8, FP8=cache != dtype, SOFT_FP8=False)
            r = build(kernels.store_kv_kernel, sig, constexprs, {}, 4)
            results.append(dict(config=f"store {dtype} -> {cache} {head_dim}", **r))
    print(json.dumps(results))
""")


def representative_configs():
    """Every (dtype, cache dtype, head width, mode) class once, rotating softcap, GQA ratio, exact head dim and the
    layer extras (none / sinks / ALiBi)."""
    chosen, i = [], 0
    for dtype, kv_dtype in itertools.product(("fp16", "bf16", "fp32"), ("same", "fp8e4nv")):
        for head_dim in (16, 32, 64, 128, 256):
            for decode, split in ((False, False), (True, False), (True, True)):
                exact = {64: (64, 80)[i % 2], 128: (128, 96)[i % 2]}.get(head_dim, head_dim)
                cfg = tb.choose_config(dtype, exact, (1, 4, 8, 16)[i % 4], decode, bool(i % 2), split,
                                       dtype if kv_dtype == "same" else kv_dtype)
                chosen.append(dataclasses.replace(cfg, sinks=i % 3 == 1, alibi=i % 3 == 2))  # layer extras too
                i += 1
    return chosen


def _start_compile(cache_dir: str) -> tuple[subprocess.Popen, list]:
    configs = tb.kernel_configs()
    chosen = representative_configs()
    assert all(c in configs for c in chosen)  # each is a variant the dispatcher can pick
    arg = json.dumps([dataclasses.asdict(c) for c in chosen])
    if os.environ.get("HF_PAGED_COMPILE_ALL") == "1":  # "all": the list would exceed the 128 KiB argument limit
        chosen, arg = configs, json.dumps("all")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=cache_dir, TRITON_DEFAULT_FP_FUSION="1")  # a cold cache: really compile
    proc = subprocess.Popen([sys.executable, "-c", COMPILE_SCRIPT, arg],
                            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, chosen


COMPILE = {}


@pytest.fixture(scope="module", autouse=True)
def background_sm90_compile(request, tmp_path_factory):
    """When the compile test is selected, start its subprocess with the module's first test, so it runs on a
    second core while the interpreter tests run (the file stays well under a minute)."""
    if any(item.name == "test_sm90_compile_all_variant_classes" for item in request.session.items):
        COMPILE["run"] = _start_compile(str(tmp_path_factory.mktemp("triton_cache")))
    yield
    run = COMPILE.pop("run", None)
    if run is not None and run[0].poll() is None:
        run[0].kill()
        run[0].wait()


def test_sm90_compile_all_variant_classes(tmp_path):
    """triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32)) of a representative variant per class
    (HF_PAGED_COMPILE_ALL=1: all of kernel_configs()), plus the reduce and store kernels; each must give
    sm_90 PTX and a cubin within 227 KiB of shared memory. Registers / stack (spills) are printed with -s.
    Runs in a subprocess: under TRITON_INTERPRET=1 @triton.jit gives interpreter functions, not compilable ones."""
    proc, chosen = COMPILE.pop("run", None) or _start_compile(str(tmp_path))
    stdout, stderr = proc.communicate(timeout=3600 if os.environ.get("HF_PAGED_COMPILE_ALL") == "1" else 900)
    assert proc.returncode == 0, stderr[-4000:]
    results = json.loads(stdout.strip().splitlines()[-1])
    assert len(results) == len(chosen) + 3 * 3 * 3
    for r in results:
        print(f"{r['config']}: regs {r['regs']} stack {r['stack']} shared {r['shared']}")
        assert r["ptx"] and r["cubin"] > 0, r
        assert r["shared"] <= 232448, r
        assert r["fp8_rn"] == ("-> fp8e4nv" in r["config"]), r


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2"])
def test_engine_greedy_parity_with_triton_backend(arch):
    """The whole engine on the Triton kernels (interpreted on CPU) gives HF generate's tokens."""
    if DEVICE.type != "cpu":
        pytest.skip("covered on GPU by tests/test_gpu.py")
    from conftest import left_padded_batch
    from hf_paged.tiny import tiny_model

    model = tiny_model(arch)
    ids, mask = left_padded_batch([5, 12, 9], seed=4)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, cache_implementation="paged",
                         cache_config={"attention_backend": "triton", "block_size": 8, "max_num_batched_tokens": 16})
    assert torch.equal(out, ref)


def test_blocks_behind_the_window_on_the_triton_kernels(engine_runs):
    """Mistral (one window on every layer) on the Triton kernels: block tables that start with released (null) blocks
    give HF generate's tokens."""
    if DEVICE.type != "cpu":
        pytest.skip("covered on GPU by tests/test_gpu.py")
    from conftest import left_padded_batch
    from hf_paged.tiny import tiny_model

    model = tiny_model("mistral")
    ids, mask = left_padded_batch([5, 14, 9], seed=5)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, cache_implementation="paged",
                         cache_config={"attention_backend": "triton", "block_size": 4, "max_num_batched_tokens": 16})
    assert torch.equal(out, ref)
    assert engine_runs[0].engine.stats()["num_blocks_released"] >= 3
