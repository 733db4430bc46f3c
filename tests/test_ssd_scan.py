"""A Mamba-2 mixer's selective scan, native (`model.ssd_scan`, cpu/ssd_scan.c): the kernel against float64 sums,
the decode and prefill substitutes of `mamba2_scan_forward` taken by every Mamba-2 family where they agree, exact
against HF (also under chunking, preemption and prefix hits), transformers' own code wherever they do not apply."""
from __future__ import annotations

import pytest
import torch

import hf_paged
from hf_paged.kv.state import StateSlots
from hf_paged.model import ssd_scan, state_fast
from hf_paged.model.state_layers import StateRun, StateView
from hf_paged.model.state_modules import find_state_modules
from hf_paged.tiny import tiny_hybrid

from conftest import assert_same_as_hf, exact_under_pressure, left_padded_batch, wrong_substitute_refused

pytestmark = pytest.mark.usefixtures("one_torch_thread")
MAMBA2 = ("nemotron_h", "falcon_h1", "bamba", "granitemoehybrid", "zamba2", "mamba2")  # every family calling it
DECODE, PREFILL = "mamba2_scan_forward@decode", "mamba2_scan_forward@prefill"
needs_kernel = pytest.mark.skipif(ssd_scan.native_scan() is None, reason="no C compiler")


def native_calls(monkeypatch) -> list:
    """(tokens, fresh, half) of every native scan call from now on."""
    calls, real = [], ssd_scan.native_scan()

    class Counted:
        def scan(self, state, fresh, x, *args):
            calls.append((args[-6], fresh, args[-1]))
            return real.scan(state, fresh, x, *args)
    monkeypatch.setattr(ssd_scan, "native_scan", lambda: Counted())
    return calls


def reference(state, x, dt, decay, B, C, D):
    """The scan token by token in float64: (outputs [B, T, H, P], final state [B, H, P, N])."""
    state, x, dt, decay, B, C = (t.double() for t in (state, x, dt, decay, B, C))
    heads, groups = x.shape[2], B.shape[2]
    B, C = (t.repeat_interleave(heads // groups, dim=2) for t in (B, C))  # [B, T, H, N]
    outs = []
    for t in range(x.shape[1]):
        state = state * decay[:, t, :, None, None] + (dt[:, t, :, None] * B[:, t])[:, :, None, :] * x[:, t, ..., None]
        out = (state * C[:, t, :, None, :]).sum(-1)
        outs.append(out if D is None else out + x[:, t] * D.double()[:, None])
    return torch.stack(outs, dim=1), state


@needs_kernel
@pytest.mark.parametrize("length,fresh,state_size,with_d", [(1, False, 20, True), (7, True, 32, True),
                                                            (5, False, 5, False), (3, True, 16, False)])
def test_kernel_matches_float64_sums(length, fresh, state_size, with_d):
    """Every head of a group reads its group's B and C; state sizes past the 16 lanes and below them; the state left
    is the final one, the one given read unless fresh; D added where given."""
    gen = torch.Generator().manual_seed(length * 7 + state_size)
    batch, heads, head_dim, groups = 3, 4, 6, 2
    x = torch.randn(batch, length, heads, head_dim, generator=gen)
    dt = torch.rand(batch, length, heads, generator=gen)
    decay = torch.rand(batch, length, heads, generator=gen)
    B, C = (torch.randn(batch, length, groups, state_size, generator=gen) for _ in range(2))
    D = torch.randn(heads, generator=gen) if with_d else None
    given = torch.randn(batch, heads, head_dim, state_size, generator=gen)
    state = torch.full_like(given, float("nan")) if fresh else given.clone()
    out = torch.empty_like(x)
    ssd_scan.native_scan().scan(state.data_ptr(), int(fresh), x.data_ptr(), dt.data_ptr(), decay.data_ptr(),
                                B.data_ptr(), C.data_ptr(), None if D is None else D.data_ptr(), out.data_ptr(),
                                batch, length, heads, head_dim, groups, state_size, 0)
    want_out, want_state = reference(torch.zeros_like(given) if fresh else given, x, dt, decay, B, C, D)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.double(), want_state, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_bf16_decode_rounds_as_transformers_recurrent_form():
    """A bf16 model's decode (`half`): transformers' own `mamba2_selective_state_update` on bf16 inputs and an fp32
    state gives the same new state (every rounding the same; exp(dt A) computed alike) and an output within one bf16
    spacing (its product's sum in another order)."""
    import transformers.models.bamba.modeling_bamba as modeling

    gen = torch.Generator().manual_seed(9)
    batch, heads, head_dim, groups, size = 3, 4, 8, 2, 40
    x, dt = torch.randn(batch, heads, head_dim, generator=gen), torch.randn(batch, heads, generator=gen) - 2
    B, C = (torch.randn(batch, groups, size, generator=gen) for _ in range(2))
    x, dt, B, C = (t.bfloat16() for t in (x, dt, B, C))
    A, D, bias = -torch.rand(heads, generator=gen) * 4, torch.randn(heads).bfloat16(), torch.randn(heads).bfloat16()
    state = torch.randn(batch, heads, head_dim, size, generator=gen)
    want_state = state.clone()
    want = modeling.mamba2_selective_state_update(
        want_state, x, dt[..., None].expand(-1, -1, head_dim), A[:, None, None].expand(-1, head_dim, size), B, C,
        D[:, None].expand(-1, head_dim), z=None, dt_bias=bias[:, None].expand(-1, head_dim), dt_softplus=True)
    step = torch.nn.functional.softplus(dt + bias)
    decay = torch.exp(step.float() * A)
    out = torch.empty(batch, heads, head_dim)
    wide = [t.float().contiguous() for t in (x, step, B, C, D)]
    ssd_scan.native_scan().scan(state.data_ptr(), 0, wide[0].data_ptr(), wide[1].data_ptr(), decay.data_ptr(),
                                wide[2].data_ptr(), wide[3].data_ptr(), wide[4].data_ptr(), out.data_ptr(),
                                batch, 1, heads, head_dim, groups, size, 1)
    assert torch.equal(state, want_state)
    assert torch.equal(out, out.bfloat16().float())  # bf16 values
    spacing = want.float().abs().clamp_min(1e-2) * 2 ** -7
    assert ((out - want.float()).abs() <= spacing).all()


@needs_kernel
@pytest.mark.parametrize("model_type", ["nemotron_h", "falcon_h1"])
def test_bf16_models_take_the_native_scan(monkeypatch, always_fast, model_type):
    """A bf16 model takes both parts (within the agreement check's bf16 tolerance of its own forward), passes the
    start-up check and runs its decodes with bf16 rounding, its prefills in fp32."""
    calls = native_calls(monkeypatch)
    model = tiny_hybrid(model_type, dtype=torch.bfloat16)
    assert all(path is not None for path in state_fast.fast_paths(model, find_state_modules(model)).values())
    llm = hf_paged.LLM(model, num_blocks=32, block_size=4)
    out = llm.generate([[5, 6, 7, 8], [9, 10]], hf_paged.SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]
    assert (1, 0, 1) in calls and any(length > 1 and not half for length, _, half in calls)


@needs_kernel
@pytest.mark.parametrize("model_type", MAMBA2)
def test_every_mamba2_family_takes_both_parts_exactly(monkeypatch, always_fast, model_type):
    """With the timing skipped, each family's mixer takes the decode and the prefill substitute (they agree with its
    own forward), the engine's prefills and decodes run through them, and the tokens are HF's on a left-padded
    batch."""
    calls = native_calls(monkeypatch)
    model = tiny_hybrid(model_type)
    paths = state_fast.fast_paths(model, find_state_modules(model))
    assert paths and all(path is not None for path in paths.values())
    ids, mask = left_padded_batch([5, 11, 17])
    assert_same_as_hf(model, ids, mask, max_new_tokens=12, do_sample=False)
    assert (1, 0, 0) in calls and any(length > 1 for length, _, _ in calls)  # decodes and prefills, natively


def scan_on_views(scan, mixer, inputs: list, fresh: bool) -> list:
    """`scan` (transformers' `mamba2_scan_forward` or a substitute) on `inputs` [(x, B, C, dt)] in turn, each a call
    on a new `StateView` of the same slots (2 sequences): [(output, stored state)]."""
    slots, results = StateSlots(torch.device("cpu"), 2), []
    for x, B, C, dt in inputs:
        run = StateRun(torch.arange(2), torch.arange(2), fresh)
        view = StateView(slots, mixer.layer_idx, run, "bamba")
        out = scan(mixer, x, B, C, dt, view)
        results.append((out.clone(), view.values[("recurrent", 0)].clone()))
        view.write_back()
        fresh = False
    return results


@needs_kernel
def test_the_prefills_time_step_limit():
    """transformers clamps dt to the mixer's `time_step_limit` in its chunked form (prefills, and a fresh sequence's
    single token) but not in its recurrent form (one token after a state): so does the native scan."""
    import transformers.models.bamba.modeling_bamba as modeling

    mixer = tiny_hybrid("bamba").model.layers[0].mamba
    mixer.time_step_limit = (0.0, 0.045)  # dt = softplus(-3 + ...) ~ 0.05: the clamp bites on about half
    gen = torch.Generator().manual_seed(4)
    width, state = mixer.num_heads * mixer.head_dim, mixer.n_groups * mixer.ssm_state_size

    def inputs(length):
        return (torch.randn(2, length, width, generator=gen), torch.randn(2, length, state, generator=gen),
                torch.randn(2, length, state, generator=gen), torch.randn(2, length, mixer.num_heads, generator=gen))

    own, ours = modeling.mamba2_scan_forward, ssd_scan.prefill_scan(ssd_scan.decode_scan(modeling.mamba2_scan_forward))
    with torch.no_grad():
        for lengths in ((1, 1, 1), (5, 1, 3)):  # a fresh token, then decodes; a prefill, a decode, a continuation
            steps = [inputs(n) for n in lengths]
            for (want, want_state), (got, got_state) in zip(scan_on_views(own, mixer, steps, True),
                                                            scan_on_views(ours, mixer, steps, True)):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(got_state, want_state, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_exact_under_pressure(monkeypatch, always_fast):
    """Chunked prefill smaller than a prompt (the prefill scan continuing a stored state), preemption by recompute and
    by swap, prefix hits (the state restored from a checkpoint): the tokens of HF alone."""
    calls = native_calls(monkeypatch)
    exact_under_pressure(tiny_hybrid("nemotron_h"), seed=5)
    assert any(length > 1 and not fresh for length, fresh, _ in calls)  # prefills continuing a stored state


@needs_kernel
@pytest.mark.parametrize("entry,wrong", [
    (DECODE, lambda scan: lambda module, x, B, C, dt, cache, **kw: scan(module, x, B, C.flip(-1), dt, cache, **kw)),
    (PREFILL, lambda scan: lambda module, x, B, C, dt, cache, **kw: scan(module, x, B, C, dt * 0.5, cache, **kw)),
])
def test_a_wrong_substitute_is_not_taken(monkeypatch, always_fast, entry, wrong):
    """A substitute that computes something else (C reversed, half the time step) fails the agreement check: the
    mixer keeps its own forward and the engine stays exact."""
    wrong_substitute_refused(monkeypatch, entry, wrong, "bamba")


def test_transformers_own_code_where_the_scan_does_not_apply(monkeypatch, always_fast):
    """No native build (HF_PAGED_SSD_KERNEL=0), an fp16 model, or every token's state asked for: transformers' own
    `mamba2_scan_forward` computes the call (the substitute declines), and the engine stays exact in fp32."""
    import transformers.models.bamba.modeling_bamba as modeling

    own = []
    monkeypatch.setattr(modeling, "mamba2_scan_forward",
                        lambda *args, _own=modeling.mamba2_scan_forward, **kw: own.append(1) or _own(*args, **kw))
    ssd_scan.native_scan.cache_clear()
    monkeypatch.setenv("HF_PAGED_SSD_KERNEL", "0")
    try:
        model = tiny_hybrid("bamba")
        ids, mask = left_padded_batch([6, 10])
        assert_same_as_hf(model, ids, mask, max_new_tokens=6, do_sample=False)
        assert own
    finally:
        ssd_scan.native_scan.cache_clear()
    monkeypatch.delenv("HF_PAGED_SSD_KERNEL")
    mixer = tiny_hybrid("bamba").model.layers[0].mamba
    view = type("View", (ssd_scan.StateView,), {"__init__": lambda self: None})()
    view.get_recurrent_state = lambda layer, state_idx=0: None
    view.get_recurrent_states_to_keep = lambda layer=None: 1
    x = torch.randn(1, 4, mixer.num_heads * mixer.head_dim)
    B = C = torch.randn(1, 4, mixer.n_groups * mixer.ssm_state_size)
    dt = torch.randn(1, 4, mixer.num_heads)
    assert ssd_scan._native(mixer, x, B, C, dt, view, prefill=True) is None  # every token's state asked for
    view.get_recurrent_states_to_keep = lambda layer=None: 0
    assert ssd_scan._native(mixer.to(torch.float16), x.half(), B.half(), C.half(), dt.half(), view,
                            prefill=True) is None
