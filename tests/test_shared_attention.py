"""An attention block shared by several layers (zamba's: `layer_idx` None, the caller hands each call's layer index to
the cache only): the engine keeps each call's K/V apart (`paged_forward._layer_of`)."""
from __future__ import annotations

import pytest
import torch

import hf_paged
from hf_paged.tiny import tiny_hybrid

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def zamba():
    return tiny_hybrid("zamba")


def prompts(lengths=(5, 11, 17, 9), seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lengths]


def test_a_shared_attention_block_keeps_each_calls_kv_apart(zamba):
    """zamba's one attention block serves several layers (its `layer_idx` is None: the caller hands each call's layer
    index to the cache only); the engine stores each call's K/V apart, by its place in the forward. A tiny random zamba
    barely reads its attention (removing it moves logits by ~1e-4), so tokens cannot show a mix-up: the log-probs of
    every generated token are compared with HF's own, under chunking and preemption, far below that."""
    model = zamba
    batch = prompts()
    params = hf_paged.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    llm = hf_paged.LLM(model, num_blocks=10, block_size=4, max_num_batched_tokens=6, long_prefill_token_threshold=4,
                       max_num_seqs=3, preemption_mode="recompute")
    outs = llm.generate(batch, params, use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    worst = 0.0
    for prompt, out in zip(batch, outs):
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        sample = out.outputs[0]
        assert list(sample.token_ids) == ref.sequences[0, len(prompt):].tolist()
        for step, token in enumerate(sample.token_ids):
            want = torch.log_softmax(ref.logits[step][0].float(), -1)[token].item()
            worst = max(worst, abs(sample.logprobs[step][token] - want))
    assert worst < 2e-6, worst
    assert model.generate(torch.tensor([batch[0]]), max_new_tokens=2, cache_implementation="paged",
                          return_dict_in_generate=True).cache is None  # HF's cache keys its K/V by the calling layer
