"""A Mamba (Mamba-1) mixer's selective scan, native (`model.mamba_scan`, cpu/mamba_scan.c): the kernel against
float64 sums, the decode and prefill substitutes of `mamba_scan_forward` taken by every family calling it where they
agree, exact against HF (also under chunking, preemption and prefix hits), transformers' own code wherever they do
not apply."""
from __future__ import annotations

import pytest
import torch

from hf_paged.kv.state import StateSlots
from hf_paged.model import mamba_scan, state_fast
from hf_paged.model.state_layers import StateRun, StateView
from hf_paged.model.state_modules import find_state_modules
from hf_paged.tiny import tiny_hybrid

from conftest import assert_same_as_hf, exact_under_pressure, left_padded_batch, wrong_substitute_refused

pytestmark = pytest.mark.usefixtures("one_torch_thread")
MAMBA = ("mamba", "falcon_mamba", "jamba")  # every family calling it
DECODE, PREFILL = "mamba_scan_forward@decode", "mamba_scan_forward@prefill"
needs_kernel = pytest.mark.skipif(mamba_scan.native_scan() is None, reason="no C compiler")


def native_calls(monkeypatch) -> list:
    """(tokens, fresh) of every native scan call from now on."""
    calls, real = [], mamba_scan.native_scan()

    class Counted:
        def scan(self, state, fresh, *args):
            calls.append((args[-2], fresh))
            return real.scan(state, fresh, *args)
    monkeypatch.setattr(mamba_scan, "native_scan", lambda: Counted())
    return calls


@needs_kernel
@pytest.mark.parametrize("length,fresh,with_d,with_gate", [(1, False, True, True), (6, True, True, False),
                                                           (4, False, False, True)])
def test_kernel_matches_float64_sums(length, fresh, with_d, with_gate):
    """Each channel's state of `size` floats, token by token, decayed by exp(dt A) (the kernel's own exponential,
    also far down its range); the state left is the final one, the one given read unless fresh; D and the gate
    applied where given."""
    gen = torch.Generator().manual_seed(length)
    batch, channels, size = 3, 5, 7
    x, dt, gate = (torch.randn(batch, channels, length, generator=gen) for _ in range(3))
    A = -torch.rand(channels, size, generator=gen) * 4
    A[0, :3] = torch.tensor([-200.0, -60.0, 0.0])  # exp past its clamp, far down its range, exactly 1
    B, C = (torch.randn(batch, length, size, generator=gen) for _ in range(2))
    D = torch.randn(channels, generator=gen) if with_d else None
    given = torch.randn(batch, channels, size, generator=gen)
    state = torch.full_like(given, float("nan")) if fresh else given.clone()
    out = torch.empty_like(x)
    dt = dt.abs()
    mamba_scan.native_scan().scan(state.data_ptr(), int(fresh), x.data_ptr(), dt.data_ptr(), A.data_ptr(),
                                  B.data_ptr(), C.data_ptr(), None if D is None else D.data_ptr(),
                                  gate.data_ptr() if with_gate else None, out.data_ptr(), batch, channels, length,
                                  size)
    want, outs = (torch.zeros_like(given) if fresh else given).double(), []
    for t in range(length):
        decay = torch.exp(dt[:, :, t, None].double() * A.double())
        want = decay * want + (dt[:, :, t, None] * B[:, None, t]).double() * x[:, :, t, None].double()
        y = (want * C[:, None, t].double()).sum(-1)
        y = y if D is None else y + x[:, :, t].double() * D.double()
        outs.append(y * gate[:, :, t].double() if with_gate else y)
    torch.testing.assert_close(out.double(), torch.stack(outs, dim=-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.double(), want, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("model_type", MAMBA)
def test_every_family_takes_both_parts_exactly(monkeypatch, always_fast, model_type):
    """With the timing skipped, each family's mixer takes the decode and the prefill substitute (they agree with its
    own forward), the engine's prefills and decodes run through them natively, and the tokens are HF's on a
    left-padded batch."""
    calls = native_calls(monkeypatch)
    model = tiny_hybrid(model_type)
    paths = state_fast.fast_paths(model, find_state_modules(model))
    assert paths and all(path is not None for path in paths.values())
    ids, mask = left_padded_batch([5, 11, 17])
    assert_same_as_hf(model, ids, mask, max_new_tokens=12, do_sample=False)
    assert (1, 0) in calls and any(length > 1 and fresh for length, fresh in calls)


@needs_kernel
def test_exact_under_pressure(monkeypatch, always_fast):
    """Chunked prefill smaller than a prompt (later pieces token by token from the stored state), preemption by
    recompute, prefix hits (the state restored from a checkpoint): the tokens of HF alone."""
    calls = native_calls(monkeypatch)
    exact_under_pressure(tiny_hybrid("falcon_mamba"), seed=6, modes=(None,))
    assert (1, 0) in calls and any(length > 1 for length, _ in calls)


@needs_kernel
@pytest.mark.parametrize("entry,wrong", [
    (DECODE, lambda scan: lambda m, x, t, B, C, g, cache, **kw: scan(m, x, t, B, C.flip(-1), g, cache, **kw)),
    (PREFILL, lambda scan: lambda m, x, t, B, C, g, cache, **kw: scan(m, x, t * 0.5, B, C, g, cache, **kw)),
])
def test_a_wrong_substitute_is_not_taken(monkeypatch, always_fast, entry, wrong):
    """A substitute that computes something else (C reversed, half the time step) fails the agreement check: the
    mixer keeps its own forward and the engine stays exact."""
    wrong_substitute_refused(monkeypatch, entry, wrong, "falcon_mamba")


def test_transformers_own_code_where_the_scan_does_not_apply(monkeypatch):
    """A multi-token call after a stored state (transformers' full-sequence form starts from zeros there, and so
    must its substitute: it declines), every token's state asked for, a bf16 model, no native build
    (HF_PAGED_MAMBA_KERNEL=0): transformers' own `mamba_scan_forward` computes the call."""
    import transformers.models.falcon_mamba.modeling_falcon_mamba as modeling

    mixer = tiny_hybrid("falcon_mamba").backbone.layers[0].mixer
    channels, size = mixer.A_log.shape
    gen = torch.Generator().manual_seed(1)

    def inputs(length, dtype=torch.float32):
        return [t.to(dtype) for t in (torch.randn(2, channels, length, generator=gen),
                                      torch.randn(2, channels, length, generator=gen),
                                      torch.randn(2, length, size, generator=gen),
                                      torch.randn(2, length, size, generator=gen),
                                      torch.randn(2, channels, length, generator=gen))]

    own = modeling.mamba_scan_forward
    ours = mamba_scan.prefill_scan(mamba_scan.decode_scan(own))
    calls = [(True, inputs(4)), (False, inputs(3))]  # a fresh sequence's 4 tokens, then 3 more after its state
    with torch.no_grad():
        for scan in (own, ours):
            slots, results = StateSlots(torch.device("cpu"), 2), []
            for fresh, args in calls:
                view = StateView(slots, mixer.layer_idx, StateRun(torch.arange(2), torch.arange(2), fresh), "x")
                results.append(scan(mixer, *args, view))
                results.append(view.values[("recurrent", 0)].clone())
                view.write_back()
            if scan is own:
                want = results
        torch.testing.assert_close(results, want, rtol=1e-5, atol=1e-5)
    view = StateView(slots, mixer.layer_idx, StateRun(torch.arange(2), torch.arange(2), True), "x")
    view.keep = 1
    assert mamba_scan._native(mixer, *inputs(3), view, prefill=True) is None  # every token's state asked for
    view.keep = 0
    assert mamba_scan._native(mixer.to(torch.bfloat16), *inputs(3, torch.bfloat16), view, prefill=True) is None
    mamba_scan.native_scan.cache_clear()
    monkeypatch.setenv("HF_PAGED_MAMBA_KERNEL", "0")
    try:
        assert mamba_scan._native(mixer.float(), *inputs(3), view, prefill=True) is None
    finally:
        monkeypatch.delenv("HF_PAGED_MAMBA_KERNEL")
        mamba_scan.native_scan.cache_clear()
