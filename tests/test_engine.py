"""The LLM / Engine API: outputs, memory accounting, bad input, failures that hit one request only."""
import pytest
import torch

import hf_paged
from hf_paged import LLM, SamplingParams

from conftest import cached_model, left_padded_batch

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def prompts(count=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (int(n),), generator=gen).tolist()
            for n in torch.randint(2, 30, (count,), generator=gen)]


def hf_greedy(model, prompt, max_new):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, min_new_tokens=max_new,
                         do_sample=False)
    return out[0, len(prompt):].tolist()


def test_generate_matches_hf_in_input_order_and_frees_everything(llama):
    llm = LLM(llama, block_size=8, num_blocks=64)
    batch = prompts()
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == batch
    for o, p in zip(outs, batch):
        assert o.token_ids == hf_greedy(llama, p, 12)
        assert o.finish_reason == "length" and o.num_cached_tokens == 0
    assert all(0 < o.metrics["time_to_first_token_s"] <= o.metrics["latency_s"] for o in outs)
    stats = llm.stats()
    assert stats["num_blocks_free"] == stats["num_blocks_total"] == 64
    assert stats["num_running"] == stats["num_waiting"] == 0
    llm.engine.check_idle()


def test_preemption_under_pressure_gives_same_outputs(llama):
    batch = prompts(8, seed=1)
    roomy = LLM(llama, block_size=4, num_blocks=512).generate(batch, GREEDY, use_tqdm=False)
    tight = LLM(llama, block_size=4, num_blocks=24)
    outs = tight.generate(batch, GREEDY, use_tqdm=False)
    assert tight.stats()["num_preemptions"] > 0, "pool was not small enough to force preemption"
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    tight.engine.check_idle()


def test_seeded_sampling_reproducible_regardless_of_batch(llama):
    params = SamplingParams(max_tokens=10, temperature=0.9, top_k=50, top_p=0.9, seed=1234)
    target = [5, 6, 7, 8, 9]
    alone = LLM(llama).generate([target], params, use_tqdm=False)[0].token_ids
    others = [SamplingParams(max_tokens=10, temperature=1.0)] * 3
    mixed = LLM(llama).generate(prompts(3, seed=7) + [target], others + [params], use_tqdm=False)[-1].token_ids
    assert alone == mixed
    different = LLM(llama).generate([target], SamplingParams(max_tokens=10, temperature=0.9, seed=99),
                                    use_tqdm=False)[0].token_ids
    assert different != alone


def test_n_samples_stop_tokens_min_tokens_and_logprobs(llama):
    llm = LLM(llama)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=1.0, n=3, seed=0, logprobs=2),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 3 and len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert all(len(c.logprobs) == len(c.token_ids) and len(c.logprobs[0]) >= 2 for c in out.outputs)
    free = hf_greedy(llama, [5, 6, 7], 8)
    stop = free[3]
    first = free.index(stop)
    stopped = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop]),
                           use_tqdm=False)[0]
    assert stopped.token_ids == free[:first + 1] and stopped.finish_reason == "stop"
    late = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0, min_tokens=6, stop_token_ids=[stop]),
                        use_tqdm=False)[0]
    assert len(late.token_ids) >= 6 and stop not in late.token_ids[:6]


def test_eos_finishes_request(llama):
    free = hf_greedy(llama, [9, 8, 7, 6], 10)
    llama.generation_config.eos_token_id = free[2]
    try:
        out = LLM(llama).generate([[9, 8, 7, 6]], SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)[0]
    finally:
        llama.generation_config.eos_token_id = 2
    assert out.token_ids == free[:free.index(free[2]) + 1] and out.finish_reason == "stop"


@pytest.mark.parametrize("prompt, params, message", [
    ([], GREEDY, "prompt is empty"),
    ([1, 2, 999], GREEDY, "outside the vocabulary"),
    ([1, 2, 3], SamplingParams(max_tokens=600), "maximum length"),
    ([1, 2, 3], SamplingParams(temperature=-1.0), "temperature"),
    ([1, 2, 3], SamplingParams(top_p=0.0), "top_p"),
    ([1, 2, 3], SamplingParams(n=0), "n must"),
    ([1, 2, 3], SamplingParams(max_tokens=0), "max_tokens"),
    ("text without tokenizer", GREEDY, "tokenizer"),
])
def test_bad_input_is_rejected_up_front_naming_the_request(llama, prompt, params, message):
    llm = LLM(llama)
    good = [[4, 5, 6], [7, 8]]
    with pytest.raises(ValueError, match=message) as err:
        llm.generate(good + [prompt], [GREEDY, GREEDY, params], use_tqdm=False)
    assert "request 2" in str(err.value)
    assert llm.stats()["num_waiting"] == 0 and llm.stats()["num_running"] == 0  # nothing was queued
    outs = llm.generate(good, GREEDY, use_tqdm=False)  # the engine is still usable
    assert outs[0].token_ids == hf_greedy(llama, good[0], 12)


def test_request_larger_than_pool_is_rejected(llama):
    llm = LLM(llama, block_size=4, num_blocks=8)
    with pytest.raises(ValueError, match="request 1: .*never fit the KV pool"):
        llm.generate([[3, 4], list(range(3, 30))], SamplingParams(max_tokens=10), use_tqdm=False)


def test_failure_while_running_ends_only_that_request(llama):
    """NaN logits for one request (a poisoned embedding row) end it with an error; the others finish normally."""
    model = cached_model("llama", max_len=256)
    poison = 250
    saved = model.get_input_embeddings().weight[poison].clone()
    model.get_input_embeddings().weight.data[poison] = float("nan")
    try:
        llm = LLM(model)
        outs = llm.generate([[4, 5, 6], [7, poison], [9, 10]], GREEDY, use_tqdm=False)
    finally:
        model.get_input_embeddings().weight.data[poison] = saved
    assert outs[1].finish_reason == "error" and "non-finite" in outs[1].error
    assert outs[0].finish_reason == outs[2].finish_reason == "length"
    assert outs[0].token_ids == hf_greedy(model, [4, 5, 6], 12)
    llm.engine.check_idle()
    assert llm.generate([[7, 8]], GREEDY, use_tqdm=False)[0].finish_reason == "length"


def test_blocks_of_a_failed_request_are_cleared_before_reuse():
    """A request whose K/V went NaN frees its blocks; whoever gets them next must not read that NaN through
    masked positions (the torch backend reads whole pages, masked slots included)."""
    model = cached_model("llama", max_len=256)
    poison = 250
    saved = model.get_input_embeddings().weight[poison].clone()
    llm = LLM(model, block_size=4, num_blocks=8, attention_backend="torch", enable_prefix_caching=False)
    model.get_input_embeddings().weight.data[poison] = float("nan")
    try:
        failed = llm.generate([[poison, poison, poison, 7, 8, poison, poison]], GREEDY, use_tqdm=False)[0]
    finally:
        model.get_input_embeddings().weight.data[poison] = saved
    assert failed.finish_reason == "error"
    prompts = [[4, 5], [6]]  # short prompts: most slots of their blocks stay masked, and all 8 blocks get used
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, 12) for p in prompts]
    llm.engine.check_idle()


def test_unsupported_models_get_a_clear_error():
    from transformers import AutoModelForCausalLM, DeepseekV32Config, T5Config, T5ForConditionalGeneration

    # deepseek_v32's indexed attention keeps an indexer's keys beside its K/V and attends a top-k of them (HF runs it;
    # state layers of mamba, minimax, recurrent_gemma, rwkv & co. are served: test_hybrid_engine)
    deepseek_v32 = AutoModelForCausalLM.from_config(DeepseekV32Config(
        vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=2, num_experts_per_tok=1, n_group=1,
        topk_group=1, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        head_dim=8, index_topk=4, index_head_dim=8, index_n_heads=2, first_k_dense_replace=1,
        max_position_embeddings=64)).eval()
    assert deepseek_v32.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=2, do_sample=False).shape == (1, 5)
    with pytest.raises(ValueError, match="deepseek_v32.*'indexed_attention'.*whose state hf_paged cannot hold"):
        LLM(deepseek_v32)
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=16, num_layers=1, num_heads=2))
    with pytest.raises(ValueError, match="encoder-decoder"):
        t5.generate(torch.tensor([[1, 2]]), max_new_tokens=2, cache_implementation="paged")


def test_cache_config_unknown_key_is_an_error(llama):
    ids, mask = left_padded_batch([3, 5])
    with pytest.raises(ValueError, match="unknown hf_paged engine option"):
        llama.generate(ids, attention_mask=mask, max_new_tokens=2, cache_implementation="paged",
                       cache_config={"blok_size": 16})


def test_default_pool_is_modest(llama):
    from hf_paged.config import available_host_memory

    before = available_host_memory()  # other processes may take or give back memory while the engine is built
    llm = LLM(llama)
    available = max(before, available_host_memory())
    assert llm.stats()["kv_cache_bytes"] <= min(2 << 30, 0.2 * available) + 1
    assert hf_paged.is_enabled()


def test_fp8_kv_cache_quarter_memory_and_close_outputs(llama):
    batch = prompts(4, seed=3)
    full = LLM(llama, block_size=8, num_blocks=64)
    fp8 = LLM(llama, block_size=8, num_blocks=64, kv_cache_dtype="fp8_e4m3")
    assert fp8.stats()["kv_cache_bytes"] * 4 == full.stats()["kv_cache_bytes"]
    a = [o.token_ids for o in full.generate(batch, GREEDY, use_tqdm=False)]
    b = [o.token_ids for o in fp8.generate(batch, GREEDY, use_tqdm=False)]
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    assert same >= 0.75 * sum(map(len, a)), (a, b)
    fp8.engine.check_idle()


def test_unavailable_attention_backend_is_refused_up_front(llama):
    with pytest.raises(ValueError, match="attention_backend 'flash3' cannot run on cpu"):
        LLM(llama, attention_backend="flash3")


def test_a_healthy_retry_after_non_finite_kv_gets_right_tokens():
    """The failed request's blocks leave the prefix cache: retrying the same prompt once the model is healthy again
    recomputes it instead of hitting its NaN blocks."""
    model = cached_model("llama", max_len=256)
    poison = 250
    prompt = [4, 5, 6, poison] + list(range(20, 60))  # several full blocks after the NaN token
    saved = model.get_input_embeddings().weight[poison].clone()
    llm = LLM(model, block_size=4)
    model.get_input_embeddings().weight.data[poison] = float("nan")
    try:
        assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].finish_reason == "error"
    finally:
        model.get_input_embeddings().weight.data[poison] = saved
    retry = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert retry.finish_reason == "length" and retry.token_ids == hf_greedy(model, prompt, 12)
    llm.engine.check_idle()


def test_an_eos_id_outside_the_vocabulary_is_ignored(llama):
    """A generation config whose EOS id the model cannot produce: it can neither stop a request nor be banned
    under min_tokens (banning it indexed past the logits)."""
    saved = llama.generation_config.eos_token_id
    llama.generation_config.eos_token_id = [2, 10_000]
    try:
        out = LLM(llama).generate([[5, 6, 7]], SamplingParams(max_tokens=6, min_tokens=3, temperature=0.0),
                                  use_tqdm=False)[0]
    finally:
        llama.generation_config.eos_token_id = saved
    assert out.finish_reason in ("length", "stop") and len(out.token_ids) >= 3
