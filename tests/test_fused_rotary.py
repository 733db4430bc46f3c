"""model/fused_rotary.py: the native rotary embedding gives transformers' apply_rotary_pos_emb output bit for bit
(fp32 and bf16, prefill and decode shapes, one cos table or one per batch row), is swapped into the attention
modules' private wrappers only for one forward of the thread that swapped it in, and leaves other shapes, autograd
and other code to the function itself; an engine on a Llama / Qwen3 gives HF's tokens with it."""
import itertools
import threading

import pytest
import torch
from transformers.models.llama import modeling_llama

import hf_paged
from hf_paged.model import FusedRotary, fused_rotary
from hf_paged.model.fused_rotary import is_llama_rotary, load_rotary, verified, wrapped_function
from hf_paged.tiny import tiny_model

pytestmark = pytest.mark.skipif(load_rotary() is None, reason="the native rotary pass does not build here")
REFERENCE = wrapped_function(modeling_llama.apply_rotary_pos_emb)


@pytest.fixture(autouse=True)
def forced(monkeypatch):
    """Used wherever it matches bit for bit, whatever this machine's timing says (that is `verified`'s own)."""
    monkeypatch.setenv("HF_PAGED_FUSED_ROTARY", "force")
    verified.cache_clear()
    yield
    verified.cache_clear()


def case(batch, tokens, dim, dtype, per_row_tables, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = (torch.randn(batch, tokens, 8, dim, generator=generator) * 30).to(dtype).transpose(1, 2)
    k = (torch.randn(batch, tokens, 2, dim, generator=generator) * 30).to(dtype).transpose(1, 2)
    angles = torch.rand(batch if per_row_tables else 1, tokens, dim, generator=generator) * 1000
    return q, k, angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [32, 64, 80, 128])
@pytest.mark.parametrize("batch, tokens, per_row_tables", [(1, 300, False), (5, 1, True), (3, 7, False)])
def test_bit_for_bit_with_transformers(dtype, dim, batch, tokens, per_row_tables):
    q, k, cos, sin = case(batch, tokens, dim, dtype, per_row_tables)
    want = REFERENCE(q, k, cos, sin)
    got = (load_rotary()(q, cos, sin), load_rotary()(k, cos, sin))
    for a, b in zip(got, want):  # the same values, laid out alike (strides of dims of size 1 do not matter)
        assert a.shape == b.shape and torch.equal(a, b)
        assert [s for s, n in zip(a.stride(), a.shape) if n > 1] == [s for s, n in zip(b.stride(), b.shape) if n > 1]


def test_found_swapped_for_one_forward_and_one_thread():
    """Every attention module of a Llama has a private wrapper running Llama's code; during `active()` this thread's
    calls take the native pass (counted), another thread's and every call after it take the function."""
    model = tiny_model("llama")
    rotary = FusedRotary(model)
    attention = [m for m in model.modules() if isinstance(m, modeling_llama.LlamaAttention)]
    assert len(rotary.modules) == len(attention) > 0
    assert all(is_llama_rotary(w) for w in rotary.modules)
    ids = torch.tensor([[5, 9, 13, 2, 7]])
    with torch.inference_mode():
        want = model(ids).logits
    calls, seen = [], {}
    kernel = load_rotary()

    def counting(*args):
        calls.append(threading.get_ident())
        return kernel(*args)

    def other_thread():
        with torch.inference_mode():
            seen["other"] = model(ids).logits

    original = fused_rotary.load_rotary
    fused_rotary.load_rotary = lambda: counting
    try:
        with pytest.raises(RuntimeError, match="boom"):
            with rotary.active(), torch.inference_mode():
                assert torch.equal(model(ids).logits, want)
                thread = threading.Thread(target=other_thread)
                thread.start()
                thread.join()
                raise RuntimeError("boom")
    finally:
        fused_rotary.load_rotary = original
    assert set(calls) == {threading.get_ident()} and len(calls) == 2 * len(attention)  # q and k per layer
    assert torch.equal(seen["other"], want)
    assert all("forward" not in vars(w) for w in rotary.modules)


def test_other_code_shapes_and_autograd_take_the_function():
    """A wrapper of other code is not taken; `unsqueeze_dim` 2 and inputs that need gradients go to the function."""
    def other(q, k, cos, sin, unsqueeze_dim=1):
        return q * 2, k

    wrapper = type(modeling_llama.apply_rotary_pos_emb)()
    assert is_llama_rotary(wrapper)
    def forward(self, *args, **kwargs):  # a kernels-style wrapper whose closure holds `other`
        return func(*args, **kwargs)

    func = other
    stranger = type("Func", (torch.nn.Module,), {"forward": forward})()
    assert not is_llama_rotary(stranger)
    model = tiny_model("llama")
    rotary = FusedRotary(model)
    wrapper = rotary.modules[0]
    q, k, cos, sin = case(1, 4, 64, torch.float32, False)
    with rotary.active():
        original = fused_rotary.load_rotary
        fused_rotary.load_rotary = lambda: pytest.fail("the native pass must not run")
        try:
            layout = (q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [B, T, H, D] with unsqueeze_dim=2
            for a, b in zip(wrapper(*layout, unsqueeze_dim=2), REFERENCE(*layout, unsqueeze_dim=2)):
                assert torch.equal(a, b)
            q.requires_grad_()
            out = wrapper(q, k, cos, sin)[0]
            assert out.grad_fn is not None
        finally:
            fused_rotary.load_rotary = original


@pytest.mark.parametrize("ours_faster", [True, False])
def test_used_only_where_timed_faster(monkeypatch, ours_faster):
    monkeypatch.setenv("HF_PAGED_FUSED_ROTARY", "1")
    verified.cache_clear()
    turns = itertools.count()  # calls alternate: ours, theirs, ours, ...
    monkeypatch.setattr(fused_rotary, "_seconds", lambda call: (1.0 if next(turns) % 2 == 0 else 2.0)
                        if ours_faster else (2.0 if next(turns) % 2 == 0 else 1.0))
    assert verified(torch.float32, 64, 1) is ours_faster
    assert (FusedRotary(tiny_model("llama")).modules != []) is ours_faster


def test_switched_off(monkeypatch):
    monkeypatch.setenv("HF_PAGED_FUSED_ROTARY", "0")
    load_rotary.cache_clear()
    try:
        assert fused_rotary.fused_rotary_status() == "disabled by HF_PAGED_FUSED_ROTARY=0"
        assert FusedRotary(tiny_model("llama")).modules == []
    finally:
        monkeypatch.setenv("HF_PAGED_FUSED_ROTARY", "force")
        load_rotary.cache_clear()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_tokens_match_hf_with_the_pass(arch):
    """Greedy tokens of an engine whose steps take the fused norms and rotary pass (prefill, decode, a chunked
    prompt) against HF's own generate, fp32."""
    model = tiny_model(arch)
    llm = hf_paged.LLM(model, block_size=4, max_num_batched_tokens=16)
    assert llm.engine.runner.rotary.modules
    prompts = [[5, 9, 13, 2, 7, 11, 3, 8, 21, 4, 6, 30, 12, 14, 15, 16, 17, 18, 19, 20, 22], [4, 4, 9]]
    outs = llm.generate(prompts, hf_paged.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():  # no EOS: the engine ignores it too
            want = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None)
        assert list(out.outputs[0].token_ids) == want[0, len(prompt):].tolist()
