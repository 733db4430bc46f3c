"""The native attention of fresh prompts (hf_paged/attention/prefill_kernel.py, cpu/prefill_attention.c): SDPA's
results up to rounding (fp32, bf16; head dims 64, 80, 96, 128 and 256; GQA groups; lengths around its 16-row
blocks), and torch's path's with sliding windows, chunks, soft-caps and sinks; only where it applies, chosen only by
its trial (one per shape and limits), switchable, and engines that take it give HF's tokens (Llama; gemma2's windows and
soft-caps, gpt-oss's sinks, llama4's chunks, gemma3's head dim 256). Speeds are never measured here: a fake clock
advances by fixed costs."""
import itertools

import pytest
import torch
import torch.nn.functional as F

import hf_paged
from hf_paged import trials
from hf_paged.attention import prefill_kernel
from hf_paged.attention.extras import LayerExtras
from hf_paged.attention.metadata import AttentionMetadata
from hf_paged.attention.torch_backend import _attend_fresh, torch_paged_attention
from hf_paged.tiny import tiny_mixed, tiny_model

pytestmark = pytest.mark.skipif(prefill_kernel.load_prefill_kernel() is None, reason="no C compiler")


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.delenv(prefill_kernel.SWITCH, raising=False)
    prefill_kernel.TABLE.clear()
    yield
    prefill_kernel.TABLE.clear()


def sdpa(q, k, v, scale):
    qq, kk, vv = (t.transpose(0, 1)[None] for t in (q, k, v))
    return F.scaled_dot_product_attention(qq, kk, vv, scale=scale, is_causal=True, enable_gqa=True)[0].transpose(0, 1)


def inputs(length, heads, kv_heads, head_dim, dtype, seed=0):
    torch.manual_seed(seed)
    return (torch.randn(length, heads, head_dim, dtype=dtype) * 2, torch.randn(length, kv_heads, head_dim, dtype=dtype),
            torch.randn(length, kv_heads, head_dim, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length, heads, kv_heads, head_dim", [(1, 8, 2, 64), (15, 4, 4, 64), (16, 6, 3, 64),
                                                               (17, 8, 2, 128), (100, 8, 1, 64), (40, 2, 2, 128),
                                                               (33, 4, 1, 256), (37, 8, 2, 80), (70, 6, 2, 96),
                                                               (1, 4, 4, 96), (16, 4, 1, 80)])
def test_sdpas_attention_up_to_rounding(dtype, length, heads, kv_heads, head_dim):
    q, k, v = inputs(length, heads, kv_heads, head_dim, dtype)
    scale = head_dim ** -0.5
    got = prefill_kernel.load_prefill_kernel()(q, k, v, scale)
    want = sdpa(q, k, v, scale)
    assert got.shape == want.shape and got.dtype is dtype
    if dtype is torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # both round an fp32 result to bf16: at most a spacing or two apart
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -7)
    strided = prefill_kernel.load_prefill_kernel()(q.transpose(0, 1).contiguous().transpose(0, 1), k, v, scale)
    assert torch.equal(strided, got)


# window, chunk, soft-cap (1000: scores far below it, where tanh(x) ~ x must stay exact to rounding), sinks
LIMITS = list(itertools.product((None, 5, 40), (None, 16), (None, 3.0, 1000.0), (False, True)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 96, 256])
@pytest.mark.parametrize("length", [1, 17, 100])
def test_windows_chunks_softcaps_and_sinks_as_torchs_path(monkeypatch, dtype, head_dim, length):
    """`_attend_fresh` with the kernel forced against the same call on torch's path (SDPA with a mask, or the
    explicit scores), every combination of a window (shorter or longer than some prompts), chunks, soft-cap, sinks."""
    q, k, v = inputs(length, 8, 2, head_dim, dtype)
    for window, chunk, softcap, sinks in LIMITS:
        extras = LayerExtras(sinks=torch.randn(8) * 2 if sinks else None, chunk_size=chunk)
        monkeypatch.setenv(prefill_kernel.SWITCH, "0")
        want = _attend_fresh(q, k, v, head_dim ** -0.5, window, softcap, extras)
        monkeypatch.setenv(prefill_kernel.SWITCH, "kernel")
        got = _attend_fresh(q, k, v, head_dim ** -0.5, window, softcap, extras)
        tolerance = 1e-5 if dtype is torch.float32 else 2 ** -6  # bf16: both round an fp32 result
        torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance,
                                   msg=lambda m: f"window {window} chunk {chunk} cap {softcap} sinks {sinks}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("keys, new", [(40, 8), (100, 33), (16, 16), (200, 1)])
def test_queries_after_cached_keys_are_the_whole_prompts_last_rows(monkeypatch, dtype, keys, new):
    """Causal attention of a row reads only its own query and the keys up to it: `new` queries after `keys - new`
    cached keys give the last rows of the whole prompt's attention, with every window, chunk, soft-cap and sinks."""
    q, k, v = inputs(keys, 8, 2, 64, dtype, seed=keys)
    monkeypatch.setenv(prefill_kernel.SWITCH, "0")
    for window, chunk, softcap, sinks in LIMITS:
        sinks = torch.randn(8) if sinks else None
        want = _attend_fresh(q, k, v, 0.125, window, softcap, LayerExtras(sinks=sinks, chunk_size=chunk))[-new:]
        got = prefill_kernel.load_prefill_kernel()(q[-new:], k, v, 0.125, window, chunk, softcap, sinks)
        tolerance = 1e-5 if dtype is torch.float32 else 2 ** -6
        torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance,
                                   msg=lambda m: f"window {window} chunk {chunk} cap {softcap} sinks {sinks}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompts_after_cached_keys_read_from_the_pages(monkeypatch, dtype):
    """A step's tile of prompts with cached keys (pages of 4 in a shuffled pool): the kernel once per sequence gives
    torch's padded tile's rows, in its order, with a window, soft-cap and sinks or none."""
    torch.manual_seed(0)
    seqs = [(30, 7), (9, 5), (50, 20), (12, 2)]  # (keys in all, new tokens)
    blocks = sum(-(-keys // 4) for keys, _ in seqs)
    order = torch.randperm(blocks + 3).tolist()
    tables, at = [], 0
    for keys, _ in seqs:
        tables.append(order[at:at + -(-keys // 4)])
        at += len(tables[-1])
    key_cache, value_cache = (torch.randn(blocks + 3, 4, 2, 64, dtype=dtype) for _ in range(2))
    query = torch.randn(sum(new for _, new in seqs), 8, 64, dtype=dtype) * 2
    meta = AttentionMetadata.build([new for _, new in seqs], [keys for keys, _ in seqs], tables, [0] * len(query), 4,
                                   torch.device("cpu"))
    calls, _ = counting(monkeypatch)
    for window, softcap, sinks in [(None, None, None), (6, 3.0, torch.randn(8))]:
        outs = {}
        for switch in ("0", "kernel"):
            monkeypatch.setenv(prefill_kernel.SWITCH, switch)
            outs[switch] = torch_paged_attention(query, key_cache, value_cache, meta, 0.125, window, softcap,
                                                 extras=LayerExtras(sinks=sinks))
        tolerance = 1e-5 if dtype is torch.float32 else 2 ** -6
        torch.testing.assert_close(outs["kernel"].float(), outs["0"].float(), rtol=tolerance, atol=tolerance)
    assert calls["kernel"] == 2 * len(seqs)


def test_only_what_it_implements():
    q, k, v = inputs(20, 8, 2, 64, torch.float32)
    assert prefill_kernel.takes(q, k, v)
    assert not prefill_kernel.takes(*inputs(20, 8, 2, 32, torch.float32))  # head dim
    assert prefill_kernel.takes(*inputs(20, 8, 2, 256, torch.float32))
    assert prefill_kernel.takes(*inputs(20, 8, 2, 80, torch.float32)) and prefill_kernel.takes(*inputs(5, 4, 1, 96,
                                                                                                     torch.bfloat16))
    assert prefill_kernel.takes(q, k, v, softcap=30.0, sinks=torch.zeros(8))
    assert not prefill_kernel.takes(q, k, v, sinks=torch.zeros(4))  # one sink per query head
    assert not prefill_kernel.takes(q, k, v, sinks=torch.tensor([0.0] * 7 + [float("inf")]))
    assert not prefill_kernel.takes(q, k, v, softcap=-1.0) and not prefill_kernel.takes(q, k, v, softcap=float("inf"))
    assert prefill_kernel.takes(q[5:], k, v) and not prefill_kernel.takes(q, k[5:], v[5:])  # keys before the queries
    assert not prefill_kernel.takes(q.half(), k.half(), v.half())
    assert not prefill_kernel.takes(q, k.bfloat16(), v)
    assert not prefill_kernel.takes(*inputs(20, 6, 4, 64, torch.float32))  # heads not a multiple of kv heads
    q.requires_grad_(True)
    assert not prefill_kernel.takes(q, k, v)
    with torch.no_grad():
        assert prefill_kernel.takes(q, k, v)


def counting(monkeypatch, costs=None):
    """Counts the kernel's and SDPA's calls through `attend`; with `costs`, each advances a fake clock."""
    calls = {"kernel": 0, "torch": 0}
    now = [0.0]
    if costs is not None:
        monkeypatch.setattr(trials, "clock", lambda: now[0])
    real = prefill_kernel.PrefillKernel.__call__

    def kernel(self, *args):
        calls["kernel"] += 1
        now[0] += (costs or {}).get("kernel", 0.0)
        return real(self, *args)
    monkeypatch.setattr(prefill_kernel.PrefillKernel, "__call__", kernel)

    def run(q, k, v, scale):
        def baseline():
            calls["torch"] += 1
            now[0] += (costs or {}).get("torch", 0.0)
            return sdpa(q, k, v, scale)
        return prefill_kernel.attend(q, k, v, scale, baseline)
    return calls, run


def peaked(model):
    """`model` with its queries scaled 4x: peaked attention, so the greedy tokens depend on it."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("q_proj"):
                module.weight.mul_(4.0)
    return model


def assert_hfs_tokens(llm, model, prompts: list[list[int]], new: int) -> None:
    """`llm`'s greedy tokens for `prompts` are HF generate's."""
    params = hf_paged.SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        with torch.inference_mode():
            want = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None)
        assert list(out.outputs[0].token_ids) == want[0, len(prompt):].tolist()


@pytest.mark.parametrize("kernel_cost, chosen", [(1.0, "kernel"), (5.0, "torch")])
def test_the_trial_keeps_sdpa_unless_the_kernel_is_faster(monkeypatch, kernel_cost, chosen):
    calls, run = counting(monkeypatch, {"kernel": kernel_cost, "torch": 3.0})
    q, k, v = inputs(40, 8, 2, 64, torch.float32)
    for _ in range(2 * (1 + trials.SAMPLES) + 2):
        torch.testing.assert_close(run(q, k, v, 0.125), sdpa(q, k, v, 0.125), rtol=1e-5, atol=1e-5)
    (entry,) = prefill_kernel.prefill_choices()
    assert entry["path"] == chosen and entry["rows"] == 64 and set(entry["us"]) == {"kernel", "torch"}
    before = dict(calls)
    run(q, k, v, 0.125)
    assert {n: calls[n] - before[n] for n in calls} == {n: int(n == chosen) for n in calls}
    run(*inputs(100, 8, 2, 64, torch.float32), 0.125)  # another length bucket: a trial of its own
    assert len(prefill_kernel.TABLE.trials) == 1


def test_a_trial_per_limit_that_binds():
    """A window shorter than the prompt, a soft-cap, sinks: each a trial of its own; a window as long as the prompt
    binds nothing (the plain key)."""
    q, k, v = inputs(40, 8, 2, 64, torch.float32)

    def call(**limits):
        prefill_kernel.attend(q, k, v, 0.125, lambda: sdpa(q, k, v, 0.125), **limits)
        return set(prefill_kernel.TABLE.trials)

    plain = call()
    assert call(window=64) == plain and len(call(window=8)) == 2
    assert len(call(softcap=5.0)) == 3 and len(call(sinks=torch.zeros(8))) == 4 and len(call(chunk=16)) == 5
    prefill_kernel.attend(q[30:], k, v, 0.125, lambda: sdpa(q, k, v, 0.125)[30:])  # after 30 cached keys
    assert {key[-1] for key in prefill_kernel.TABLE.trials} == {"", "w", "s", "k", "c", "x"}


def test_switched_off_or_forced(monkeypatch):
    calls, run = counting(monkeypatch)
    q, k, v = inputs(24, 4, 2, 64, torch.float32)
    monkeypatch.setenv(prefill_kernel.SWITCH, "0")
    for _ in range(20):
        run(q, k, v, 0.125)
    assert calls == {"kernel": 0, "torch": 20} and not prefill_kernel.TABLE.trials
    monkeypatch.setenv(prefill_kernel.SWITCH, "kernel")
    run(q, k, v, 0.125)
    assert calls == {"kernel": 1, "torch": 20}
    run(*inputs(24, 4, 2, 32, torch.float32), 0.125)  # a head dim it does not take: SDPA even when forced
    assert calls == {"kernel": 1, "torch": 21}


@pytest.mark.parametrize("head_dim", [64, 96])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_engine_that_takes_it_gives_hfs_tokens(monkeypatch, dtype, head_dim):
    """Forced: every fresh prompt's attention in the kernel (head dim 64; 96, Phi-3's), prefill in chunks and whole."""
    calls, _ = counting(monkeypatch)
    monkeypatch.setenv(prefill_kernel.SWITCH, "kernel")
    model = peaked(tiny_model("llama", head_dim=head_dim).to(dtype))
    llm = hf_paged.LLM(model, block_size=4, max_num_batched_tokens=64)
    assert_hfs_tokens(llm, model, [list(range(3, 60)), [5, 9, 13, 2, 7, 11, 3, 8], [4, 4, 9]], 10)
    assert calls["kernel"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_its_threads_give_the_same_bits(dtype):
    """The 16-row blocks spread over torch's threads: each row is computed the same way whichever thread takes it."""
    q, k, v = inputs(150, 8, 2, 64, dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = prefill_kernel.load_prefill_kernel()(q, k, v, 0.125)
        torch.set_num_threads(3)
        assert torch.equal(prefill_kernel.load_prefill_kernel()(q, k, v, 0.125), one)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("model_type, head_dim", [("gemma2", 64), ("gpt_oss", 64), ("llama4_text", 64),
                                                  ("gemma3_text", 256)])
def test_engines_of_windows_softcaps_sinks_and_chunks_give_hfs_tokens(monkeypatch, model_type, head_dim):
    """Forced: every fresh prompt's attention in the kernel; prompts longer than the window / chunk of 8 (gemma2:
    soft-capped scores, gpt-oss: sinks, llama4: chunks, gemma3: head dim 256), prefill in chunks and whole."""
    calls, _ = counting(monkeypatch)
    monkeypatch.setenv(prefill_kernel.SWITCH, "kernel")
    extra = {"query_pre_attn_scalar": head_dim} if model_type.startswith("gemma") else {}
    model = peaked(tiny_mixed(model_type, head_dim=head_dim, **extra))
    llm = hf_paged.LLM(model, block_size=4, max_num_batched_tokens=32)
    prompts = [[(5 * i) % 200 + 3 for i in range(50)], [5, 9, 13, 2, 7, 11, 3, 8, 21, 4, 6, 30, 2, 9], [4, 4, 9]]
    assert_hfs_tokens(llm, model, prompts, 8)
    assert calls["kernel"] > 0


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "gpt_oss"])
def test_prefix_hits_and_later_chunks_give_hfs_tokens(monkeypatch, model_type):
    """Forced: prompts after cached keys too (a prompt in chunks of 16, then the same prompts again: prefix hits)."""
    offsets = []
    real = prefill_kernel.PrefillKernel.__call__

    def kernel(self, query, key, *args):
        offsets.append(key.shape[0] - query.shape[0])
        return real(self, query, key, *args)
    monkeypatch.setattr(prefill_kernel.PrefillKernel, "__call__", kernel)
    monkeypatch.setenv(prefill_kernel.SWITCH, "kernel")
    if model_type == "llama":
        model = peaked(tiny_model("llama", head_dim=64))
    else:
        extra = {"query_pre_attn_scalar": 64} if model_type == "gemma2" else {}
        model = peaked(tiny_mixed(model_type, head_dim=64, **extra))
    llm = hf_paged.LLM(model, block_size=4, max_num_batched_tokens=16)
    prompts = [[(5 * i) % 200 + 3 for i in range(45)], [(7 * i) % 200 + 3 for i in range(21)]]
    for _ in range(2):  # the second time: prefix hits
        assert_hfs_tokens(llm, model, prompts, 6)
    assert any(offset > 0 for offset in offsets) and 0 in offsets
