"""A learned relative-position bias (`LayerExtras.relative_logits`: inkling's) in the paged attention, against a dense
float64 reference, and inkling's attention on the engine where its logits are scaled by position.

Each query row carries [H, E] logits; the score of the key d = q - k positions back gains entry d (0 <= d < E),
nothing from E positions back."""
import pytest
import torch
from test_attention import MIXED, make_case
from test_hybrid_engine import strong_relative_bias

import hf_paged
from hf_paged.attention import LayerExtras, dispatch, paged_attention
from hf_paged.attention.backends.torch_sdpa import TorchBackend
from hf_paged.attention.backends.triton_varlen import TritonBackend
from hf_paged.tiny import tiny_hybrid

pytestmark = pytest.mark.usefixtures("one_torch_thread")
DECODES = [(1, 37), (1, 1), (1, 64), (1, 8), (1, 9), (1, 17)]  # a pure decode step (the native kernel's, without it)
HEADS = 8


def reference(query, keys, values, query_lens, scale, window, relative):
    """Per sequence, dense float64 (keys / values: each sequence's whole context [C, H_kv, D]; `relative` [T, H, E]
    one row per query row)."""
    outs, start = [], 0
    extent = relative.shape[-1]
    for q_len, k, v in zip(query_lens, keys, values):
        q, rows = query[start:start + q_len].double(), relative[start:start + q_len].double()
        start += q_len
        ctx, per_kv = k.shape[0], HEADS // k.shape[1]
        scores = torch.einsum("qhd,khd->hqk", q, k.double().repeat_interleave(per_kv, 1)) * scale
        distance = torch.arange(ctx - q_len, ctx)[:, None] - torch.arange(ctx)[None, :]  # [Q, C]
        for d in range(extent):
            scores += torch.where(distance == d, rows.permute(1, 0, 2)[:, :, d:d + 1], 0.0)
        allowed = distance >= 0
        if window:
            allowed &= distance < window
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, v.double().repeat_interleave(per_kv, 1)))
    return torch.cat(outs)


@pytest.mark.parametrize("seqs", [MIXED, DECODES], ids=["mixed", "decodes"])
@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("extent, window", [(5, None), (12, 7), (100, None)])
def test_relative_logits_match_float64(seqs, backend, extent, window):
    """Decodes, fresh prompts and chunked prefills, GQA, an extent shorter and longer than the contexts, with a
    window: the reference's output ("auto": the native decode kernel, which has no relative logits, is passed by)."""
    query, kc, vc, cu, ctx, tables, keys, values = make_case(seqs, HEADS, 2, 16, 8, torch.float32, seed=extent)
    relative = torch.randn(query.shape[0], HEADS, extent, generator=torch.Generator().manual_seed(1))
    out = paged_attention(query, kc, vc, cu, ctx, tables, scale=0.3, sliding_window=window, backend=backend,
                          extras=LayerExtras(relative_logits=relative))
    lens = [q for q, _ in seqs]
    torch.testing.assert_close(out.double(), reference(query, keys, values, lens, 0.3, window, relative),
                               atol=2e-5, rtol=2e-5)
    plain = reference(query, keys, values, lens, 0.3, window, torch.zeros_like(relative))
    assert (out.double() - plain).abs().max() > 1e-2  # the logits really change the result


def test_no_backend_without_relative_logits_gets_them():
    """Triton implements every other extra but not these: a layer with relative logits goes to the torch backend on
    an accelerator too, while a layer with sinks still goes to triton."""
    assert "relative" in TorchBackend.extras and "relative" not in TritonBackend.extras

    class Triton(TritonBackend):
        def unsupported_reason(self, *args):
            return None

    backends = dispatch.AttentionBackends("auto", "cpu")
    backends.device = torch.device("cuda")  # (only the choice is asked for: nothing runs)
    backends._candidates["triton"] = Triton()
    chosen = {frozenset(names): backends._extras_backend(None, None, None, None, None, frozenset(names)).name
              for names in ({"relative"}, {"sinks"}, {"sinks", "relative"})}
    assert chosen == {frozenset({"relative"}): "torch", frozenset({"sinks"}): "triton",
                      frozenset({"sinks", "relative"}): "torch"}


def test_log_scaled_logits_take_each_sequences_own_positions():
    """Full-attention layers scaling logits by log(position) (`log_scaling_n_floor`): prompts packed together, in
    chunks, decoding side by side give each prompt's tokens from HF generate alone."""
    model = tiny_hybrid("inkling_text", log_scaling_n_floor=2, log_scaling_alpha=1.0)
    strong_relative_bias(model)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 19, 11)]
    params = hf_paged.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    llm = hf_paged.LLM(model, num_blocks=64, block_size=4, max_num_batched_tokens=8)
    got = [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params, use_tqdm=False)]
    want = [model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    assert got == want
