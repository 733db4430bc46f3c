"""model/gated_delta.py: the gated delta rule's single-token step and chunked form, and the short convolution's
step and sequence form, against transformers' torch reference code (the native steps where they build, and the torch
fallbacks)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_paged.model import gated_delta
from hf_paged.model.state_layers import StateRun
from hf_paged.kv.state import StateSlots


@pytest.fixture(params=["native", "torch"])
def steps(request, monkeypatch):
    """The native steps, or none (the torch fallbacks)."""
    if request.param == "torch":
        monkeypatch.setattr(gated_delta, "native_steps", lambda: None)
    elif gated_delta.native_steps() is None:
        pytest.skip("no C compiler here")
    return request.param


def _native_calls(monkeypatch, steps: str, name: str, what) -> list:
    """What each call of the native steps' `name` was given (`what(args)`), with the native steps in use."""
    calls = []
    if steps == "native":
        native = gated_delta.native_steps()

        class Counting:
            def __getattr__(self, attribute):
                function = getattr(native, attribute)
                return (lambda *args: calls.append(what(args)) or function(*args)) if attribute == name else function

        monkeypatch.setattr(gated_delta, "native_steps", Counting)
    return calls


@pytest.mark.parametrize("length,heads,start,v_dim", [(5, 4, False, 8), (37, 2, True, 40), (48, 4, True, 8),
                                                     (20, 1, True, 64)])
def test_chunk_rule_matches_transformers(steps, monkeypatch, length, heads, start, v_dim):
    """Several chunks, a partial last one, grouped heads, an initial state, value dims in whole blocks of the native
    kernel's columns and past them: transformers' outputs and final state; natively token by token where the native
    steps build (the initial state left as it was), the chunked form without them."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule as reference

    sequences = _native_calls(monkeypatch, steps, "gdn_seq", lambda args: args[7:9])  # batch, length
    gen = torch.Generator().manual_seed(length)
    q, k = (torch.randn(2, length, heads, 16, generator=gen) for _ in range(2))
    v = torch.randn(2, length, 4, v_dim, generator=gen)
    g, beta = -torch.rand(2, length, 4, generator=gen), torch.rand(2, length, 4, generator=gen)
    state = torch.randn(2, 4, 16, v_dim, generator=gen) if start else None
    kept = None if state is None else state.clone()
    args = dict(g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    want_out, want_state = reference(q, k, v, initial_state=state, **args)
    got_out, got_state = gated_delta.chunk_rule(reference, chunk=16)(q, k, v, initial_state=state, **args)
    assert torch.allclose(got_out, want_out, atol=1e-5) and torch.allclose(got_state, want_state, atol=1e-5)
    assert sequences == ([(2, length)] if steps == "native" else [])
    assert state is None or torch.equal(state, kept)


def test_recurrent_step_matches_transformers_in_place():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule as reference

    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(3, 1, 2, 16, generator=gen) for _ in range(2))
    v = torch.randn(3, 1, 4, 8, generator=gen)
    g, beta = -torch.rand(3, 1, 4, generator=gen), torch.rand(3, 1, 4, generator=gen)
    state = torch.randn(3, 4, 16, 8, generator=gen)
    args = dict(g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    want_out, want_state = reference(q, k, v, initial_state=state.clone(), **args)
    got_out, got_state = gated_delta.recurrent_step(reference)(q, k, v, initial_state=state, **args)
    assert got_state is state  # updated in place
    assert torch.allclose(got_out, want_out, atol=1e-5) and torch.allclose(got_state, want_state, atol=1e-5)


def test_recurrent_step_torch_fallback_matches_transformers(monkeypatch):
    monkeypatch.setattr(gated_delta, "native_steps", lambda: None)
    test_recurrent_step_matches_transformers_in_place()


@pytest.mark.parametrize("length,bias,width", [(1, False, 4), (6, True, 4), (1, True, 2), (1, False, 3), (1, True, 5),
                                              (3, True, 3)])
def test_conv_step_continues_the_window(steps, length, bias, width):
    """After a stored window, `length` new tokens: the depthwise causal convolution (+ SiLU) over the window and the
    tokens, and the window's last kernel-size columns kept, as transformers' conv1d path gives (kernel widths the
    native step compiles apart, and one it does not)."""
    from hf_paged.model.state_layers import StateView

    gen = torch.Generator().manual_seed(length)
    conv1d = torch.nn.Conv1d(12, 12, kernel_size=width, groups=12, padding=width - 1, bias=bias)
    with torch.no_grad():
        conv1d.weight.copy_(torch.randn(12, 1, width, generator=gen))
    window = torch.randn(2, 12, width, generator=gen)
    x = torch.randn(2, 12, length, generator=gen)
    slots = StateSlots("cpu", 2)
    slots.write((0, "conv", 0), torch.arange(2), window)
    view = StateView(slots, 0, StateRun(torch.tensor([0, 1]), torch.arange(2), False), "test")
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_forward

    calls = []  # transformers' own (the torch fallback's several tokens go there, on the same view)
    step = gated_delta.conv_step(lambda *a, **k: calls.append(1) or causal_conv1d_forward(*a, **k))
    with torch.no_grad():
        out = step(conv1d, x, view, 0, activation="silu")
        full = torch.cat((window, x), dim=-1)
        want = F.silu(F.conv1d(full, conv1d.weight, conv1d.bias, groups=12)[..., -length:])
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    view.write_back()
    torch.testing.assert_close(slots.tensors[(0, "conv", 0)], full[..., -width:])
    assert bool(calls) == (steps == "torch" and length > 1)


@pytest.mark.parametrize("width,bias", [(4, True), (3, False)])
def test_conv_step_of_a_bf16_model(steps, monkeypatch, width, bias):
    """A bf16 model's single-token step: what a bf16 convolution (fp32 sums and bias, one rounding) and SiLU on its
    bf16 output give, bit for bit; natively where the steps build (transformers' own code not called)."""
    from hf_paged.model.state_layers import StateView
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_forward

    gen = torch.Generator().manual_seed(width)
    channels = 256
    conv1d = torch.nn.Conv1d(channels, channels, kernel_size=width, groups=channels, padding=width - 1, bias=bias)
    with torch.no_grad():
        conv1d.weight.copy_(torch.randn(channels, 1, width, generator=gen))
        if bias:
            conv1d.bias.copy_(torch.randn(channels, generator=gen))
    conv1d = conv1d.to(torch.bfloat16)
    window = torch.randn(3, channels, width, generator=gen).bfloat16()
    x = torch.randn(3, channels, 1, generator=gen).bfloat16()
    slots = StateSlots("cpu", 3)
    slots.write((0, "conv", 0), torch.arange(3), window)
    view = StateView(slots, 0, StateRun(torch.tensor([0, 1, 2]), torch.arange(3), False), "test")
    calls, native = [], _native_calls(monkeypatch, steps, "conv_bf16", lambda args: args[5:8])
    step = gated_delta.conv_step(lambda *a, **k: calls.append(1) or causal_conv1d_forward(*a, **k))
    with torch.no_grad():
        out = step(conv1d, x, view, 0, activation="silu")
        full = torch.cat((window, x), dim=-1)
        want = F.silu(F.conv1d(full, conv1d.weight, conv1d.bias, groups=channels)[..., -1:])
    assert native == ([(3, channels, width)] if steps == "native" else [])
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    view.write_back()
    assert torch.equal(slots.tensors[(0, "conv", 0)], full[..., -width:])
    assert not calls


def test_a_prefill_and_decode_steps_give_a_token_the_same_bits():
    """A token's output and the state after it are the same bits whether a prefill (a recompute after preemption)
    or decode steps compute them: the rule's sequence kernel runs the decode step's code token by token, and the
    convolution's step sums (bias, then the taps in order, nothing reassociated) as its sequence form does."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule as reference

    if gated_delta.native_steps() is None:
        pytest.skip("no C compiler here")
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(2, 7, 2, 32, generator=gen) for _ in range(2))
    v = torch.randn(2, 7, 4, 40, generator=gen)
    g, beta = -torch.rand(2, 7, 4, generator=gen), torch.rand(2, 7, 4, generator=gen)
    start = torch.randn(2, 4, 32, 40, generator=gen)
    args = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, state = gated_delta.chunk_rule(reference)(q, k, v, g=g, beta=beta, initial_state=start, **args)
    stepped, step = start.clone(), gated_delta.recurrent_step(reference)
    outs = [step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], beta[:, t:t + 1],
                 initial_state=stepped, **args)[0] for t in range(7)]
    assert torch.equal(torch.cat(outs, dim=1), out) and torch.equal(stepped, state)

    steps = gated_delta.native_steps()
    for width in (3, 4, 5):
        x = torch.randn(2, 9, 520, generator=gen)  # [B, T, C]: a prompt's columns, channels last
        weight, bias = torch.randn(520, width, generator=gen), torch.randn(520, generator=gen)
        taps, prefill = weight.t().contiguous(), torch.empty(2, 9, 520)
        steps.conv_seq(x.data_ptr(), taps.data_ptr(), bias.data_ptr(), prefill.data_ptr(), 2, 520, 9, width, 9, 1)
        window, decoded = torch.zeros(2, 520, width), []
        for t in range(9):
            token, result = x[:, t].contiguous(), torch.empty(2, 520)
            steps.conv(window.data_ptr(), token.data_ptr(), weight.data_ptr(), bias.data_ptr(), result.data_ptr(), 2,
                       520, width, 1)
            decoded.append(result)
        assert torch.equal(torch.stack(decoded, dim=1), prefill)
