"""K/V stored by attention call (model/kv_shapes.number_calls): an attention block shared by several layers (zamba's:
`layer_idx` None, the caller hands each call's layer index to the cache only) and several calls per layer
(diffllama's differential attention: the same Q/K with two halves of V): the engine keeps each call's K/V apart, by
its place in the forward (`paged_forward._layer_of`)."""
from __future__ import annotations

import pytest
import torch

import hf_paged
from hf_paged.tiny import tiny_hybrid

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def zamba():
    return tiny_hybrid("zamba")


@pytest.fixture(scope="module")
def diffllama():
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING["diffllama"](hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                        intermediate_size=128, num_hidden_layers=3, vocab_size=256,
                                        max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model.eval()


def prompts(lengths=(5, 11, 17, 9), seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lengths]


def worst_logprob_gap(model, batch, outs, new: int) -> float:
    """Checks every prompt's tokens equal HF's own greedy `generate`; returns the largest gap between a generated
    token's log-prob and HF's."""
    worst = 0.0
    for prompt, out in zip(batch, outs):
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        sample = out.outputs[0]
        assert list(sample.token_ids) == ref.sequences[0, len(prompt):].tolist()
        for step, token in enumerate(sample.token_ids):
            want = torch.log_softmax(ref.logits[step][0].float(), -1)[token].item()
            worst = max(worst, abs(sample.logprobs[step][token] - want))
    return worst


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
    worst = worst_logprob_gap(model, batch, outs, new=12)
    assert worst < 2e-6, worst
    assert model.generate(torch.tensor([batch[0]]), max_new_tokens=2, cache_implementation="paged",
                          return_dict_in_generate=True).cache is None  # HF's cache keys its K/V by the calling layer


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_two_attention_calls_per_layer_keep_their_own_kv(diffllama, mode):
    """diffllama calls attention twice per layer (same Q and K, the two halves of V): six calls, six stored K/V, under
    chunked prefill, preemption and prefix hits, HF's tokens and log-probs."""
    model = diffllama
    shared = prompts((12,), seed=5)[0]
    batch = [shared + p for p in prompts((5, 11, 3), seed=2)] + prompts((9,), seed=3)
    params = hf_paged.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1)
    llm = hf_paged.LLM(model, num_blocks=14, block_size=4, max_num_batched_tokens=8, long_prefill_token_threshold=6,
                       max_num_seqs=3, preemption_mode=mode, swap_space=1 << 20)
    assert llm.engine.spec.kv.by_call and len(llm.engine.spec.kv.stored_layers) == 6
    outs = llm.generate(batch, params, use_tqdm=False)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0, stats
    worst = worst_logprob_gap(model, batch, outs, new=10)
    assert worst < 1e-4, worst
    llm.engine.check_idle()
