"""Attention sinks, ALiBi and attention chunks (LayerExtras) in the Triton kernel against the float64 reference:
prefill tiles, decodes and split-KV decodes (interpreted on CPU, compiled on a GPU machine)."""
import os

import torch

if not torch.cuda.is_available():  # before the kernels are defined (see tests/test_triton.py)
    os.environ["TRITON_INTERPRET"] = "1"
DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install 'hf_paged[triton]')")

from test_attention import make_case, reference
from test_sinks_alibi_chunked import HEADS, SINKS, SLOPES

from hf_paged.attention import LayerExtras, paged_attention
from hf_paged.attention import triton_backend as tb

SEQS = [(1, 37), (9, 9), (5, 21), (1, 20)]
CASES = {  # name: (window, softcap, sinks, alibi, chunk)
    "sinks": (None, None, SINKS, None, None),
    "sinks+window+softcap": (7, 5.0, SINKS, None, None),
    "alibi": (None, None, None, SLOPES, None),
    "chunk": (None, None, None, None, 8),
    "all": (6, None, SINKS, SLOPES, 4),
}


def run(seqs, case, num_splits=None, seed=2):
    window, softcap, sinks, alibi, chunk = CASES[case]
    query, kc, vc, cu, ctx, tables, keys, values = make_case(seqs, HEADS, 2, 16, 8, torch.float32, seed=seed)
    extras = LayerExtras(sinks=sinks, alibi_slopes=alibi, chunk_size=chunk)
    args = [t.to(DEVICE) for t in (query, kc, vc, cu, ctx, tables)]
    if num_splits is None:
        out = paged_attention(*args, scale=0.3, sliding_window=window, softcap=softcap, backend="triton",
                              extras=extras)
    else:
        from test_triton import metadata_of

        meta = metadata_of(args[3], args[4], args[5], 8)
        out = tb.paged_attention(args[0], args[1], args[2], meta, 0.3, window, softcap, num_splits=num_splits,
                                 extras=extras)
    lens = [q for q, _ in seqs]
    want = reference(query, keys, values, lens, 0.3, window, softcap, sinks, alibi, chunk)
    plain = reference(query, keys, values, lens, 0.3, window, softcap)
    return out.cpu().double(), want, plain


@pytest.mark.parametrize("case", sorted(CASES))
def test_mixed_batch_matches_float64(case):
    out, want, plain = run(SEQS, case)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    assert (out - plain).abs().max() > 1e-2  # the extras really change the result


@pytest.mark.parametrize("case", ["sinks", "all"])
def test_split_kv_decodes_add_the_sink_once(case):
    out, want, _ = run([(1, 70), (1, 33)], case, num_splits=3)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
