"""Attention sinks, ALiBi and attention chunks (LayerExtras) in the torch backend and the native CPU decode kernel,
against the float64 reference of test_attention."""
import pytest
import torch
from test_attention import MIXED, make_case, reference

from hf_paged.attention import LayerExtras, cpu_kernel_status, paged_attention
from hf_paged.attention.backends.cuda import CudaBackend

DECODES = [(1, 37), (1, 1), (1, 64), (1, 8), (1, 9), (1, 17)]  # a pure decode step: one native kernel call
HEADS = 8
SLOPES = torch.tensor([2.0 ** -(i + 1) for i in range(HEADS)])
SINKS = torch.linspace(-2.0, 3.0, HEADS)
CASES = {  # name: (window, softcap, sinks, alibi, chunk)
    "alibi": (None, None, None, SLOPES, None),
    "alibi+window": (7, None, None, SLOPES, None),
    "chunk": (None, None, None, None, 8),
    "chunk+sinks": (None, None, SINKS, None, 5),
    "chunk+window": (6, None, None, None, 16),
    "all+softcap": (None, 5.0, SINKS, SLOPES, 8),
}


def run(seqs, backend, window, softcap, sinks, alibi, chunk, seed=3):
    query, kc, vc, cu, ctx, tables, keys, values = make_case(seqs, HEADS, 2, 16, 8, torch.float32, seed=seed)
    extras = LayerExtras(sinks=sinks, alibi_slopes=alibi, chunk_size=chunk)
    out = paged_attention(query, kc, vc, cu, ctx, tables, scale=0.3, sliding_window=window, softcap=softcap,
                          backend=backend, extras=extras)
    lens = [q for q, _ in seqs]
    want = reference(query, keys, values, lens, 0.3, window, softcap, sinks, alibi, chunk)
    plain = reference(query, keys, values, lens, 0.3, window, softcap)
    return out.double(), want, plain


@pytest.mark.parametrize("seqs", [MIXED, DECODES], ids=["mixed", "decodes"])
@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_extras_match_float64(case, backend, seqs):
    """Decodes, fresh prompts and chunked prefills, GQA; "auto" runs decodes on the native kernel where it builds."""
    out, want, plain = run(seqs, backend, *CASES[case])
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    assert (out - plain).abs().max() > 1e-2  # the extras really change the result


def test_native_kernel_is_what_auto_runs():
    if cpu_kernel_status() != "loaded":
        pytest.skip(f"native CPU kernel unavailable: {cpu_kernel_status()}")
    from hf_paged.attention.cpu_kernel import load_cpu_kernel

    query, kc, vc, cu, ctx, tables, keys, values = make_case(DECODES, HEADS, 2, 16, 8, torch.float32, seed=4)
    extras = LayerExtras(sinks=SINKS, alibi_slopes=SLOPES, chunk_size=8)
    out = load_cpu_kernel()(query, kc, vc, tables.long(), ctx.long(), 0.3, None, None, extras)
    want = reference(query, keys, values, [1] * len(DECODES), 0.3, None, None, SINKS, SLOPES, 8)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


def test_backends_without_extras_refuse_them():
    """The CUDA decode kernel (csrc/) has no sink / ALiBi / chunk input: called with them it raises, never ignores."""
    query, kc, vc, cu, ctx, tables, *_ = make_case(DECODES, HEADS, 2, 16, 8, torch.float32, seed=4)
    with pytest.raises(ValueError, match=r"cuda attention backend does not implement \['sinks'\]"):
        CudaBackend().forward(query, kc, vc, None, 0.3, None, None, extras=LayerExtras(sinks=SINKS))


def test_layers_with_extras_never_reach_a_backend_without_them(monkeypatch):
    """A decode-only "cuda" backend without extras serves the plain layers of a decode step; a layer with sinks on
    the same step goes to a backend that implements them (here, on CPU, torch), exactly."""
    from test_dispatch import DecodeOnly, call

    from hf_paged.attention import dispatch

    real = dispatch.backend_class
    monkeypatch.setattr(dispatch, "backend_class", lambda name: DecodeOnly if name == "cuda" else real(name))
    backends = dispatch.AttentionBackends("cuda", "cpu")
    query, kc, vc, meta = call([(1, 9), (1, 17)])
    backends.attend(query, kc, vc, meta, 0.3)
    assert backends.named.calls == 1
    sinks = torch.linspace(-1.0, 1.0, query.shape[1])
    out = backends.attend(query, kc, vc, meta, 0.3, extras=LayerExtras(sinks=sinks))
    assert backends.named.calls == 1
    want = paged_attention(query, kc, vc, metadata=meta, scale=0.3, backend="torch", sinks=sinks)
    torch.testing.assert_close(out, want)
