"""Bad input is refused up front: before any work starts and before anything is queued, with a ValueError
(InputTypeError, a TypeError and a ValueError at once, for a value of the wrong type) naming the request
("request 2: ...") and the problem. The engine holds nothing afterwards and the next good call gives the same tokens as a fresh engine.
docs/reliability.md ("Bad input: what the user sees") holds the same table."""
import math

import numpy as np
import pytest
import torch

import hf_paged.engine.memory as memory_module
from hf_paged import LLM, SamplingParams
from hf_paged.config import InputTypeError

from conftest import cached_model

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
GOOD = [[4, 5, 6], [7, 8]]  # requests 0 and 1 of every call below; the bad one is request 2
OK = [9, 10, 11]  # a good third prompt, for cases where the parameters are what is bad
TYPE, VALUE = InputTypeError, ValueError


def bad_prompt(prompt, **kw):
    return lambda llm: llm.generate(GOOD + [prompt], GREEDY, use_tqdm=False, **kw)


def bad_params(params):
    return lambda llm: llm.generate(GOOD + [OK], [GREEDY, GREEDY, params], use_tqdm=False)


def call(prompts, params=GREEDY, **kw):
    return lambda llm: llm.generate(prompts, params, use_tqdm=False, **kw)


def sp(**kw):
    return SamplingParams(**{"max_tokens": 4, "temperature": 0.0, **kw})


# (input, exception type, message fragment, the request it names: None for a fault of the whole call)
CASES = {
    # prompts
    "empty prompt": (bad_prompt([]), VALUE, "the prompt is empty", 2),
    "token id >= vocab": (bad_prompt([1, 2, 999]), VALUE, "token ids [999] are outside the vocabulary", 2),
    "negative token id": (bad_prompt([4, -1]), VALUE, "token ids [-1] are outside the vocabulary", 2),
    "float token ids": (bad_prompt([4.0, 5.0]), TYPE, "position 0 holds float 4.0", 2),
    "bool token id": (bad_prompt([4, True]), TYPE, "position 1 holds bool True", 2),
    "nested token list": (bad_prompt([[4, 5]]), TYPE, "position 0 holds list", 2),
    "float tensor prompt": (bad_prompt(torch.tensor([4.0, 5.0])), TYPE, "position 0 holds float", 2),
    "2-D tensor as one prompt": (bad_prompt(torch.ones(2, 2, dtype=torch.long)), TYPE, "must be 1-D", 2),
    "text without tokenizer": (bad_prompt("hello"), VALUE, "needs a tokenizer", 2),
    "dict prompt, bad key": (bad_prompt({"ids": [4]}), VALUE, "'prompt' (text) or 'prompt_token_ids'", 2),
    "object as prompt": (bad_prompt(object()), TYPE, "a prompt must be a string or a list of token ids", 2),
    "prompts=None": (call(None), TYPE, "prompts must be a string, a list of token ids", None),
    "prompts=5": (call(5), TYPE, "prompts must be a string, a list of token ids", None),
    "3-D tensor of prompts": (call(torch.ones(2, 2, 2, dtype=torch.long)), TYPE, "got shape (2, 2, 2)", None),
    "prompt too long": (bad_prompt(list(range(3, 253)) * 3), VALUE, "exceeds the model's maximum length 512", 2),
    # sampling parameters
    "logprobs > vocab": (bad_params(sp(logprobs=300)), VALUE, "logprobs=300 asks for more top tokens", 2),
    "logprobs=True": (bad_params(sp(logprobs=True)), TYPE, "logprobs must be an integer >= 0, got bool", 2),
    "stop_token_ids >= vocab": (bad_params(sp(stop_token_ids=[300])), VALUE, "stop_token_ids [300] are outside", 2),
    "stop_token_ids=[True]": (bad_params(sp(stop_token_ids=[True])), TYPE, "stop_token_ids must be a list of", 2),
    "seed str": (bad_params(sp(seed="x")), TYPE, "seed must be an integer in [0, 2**64)", 2),
    "seed float": (bad_params(sp(seed=1.5)), TYPE, "seed must be an integer in [0, 2**64)", 2),
    "seed 2**64": (bad_params(sp(seed=2**64)), VALUE, "seed must be an integer in [0, 2**64 - n]", 2),
    "seed negative": (bad_params(sp(seed=-1)), VALUE, "seed must be an integer in [0, 2**64 - n]", 2),
    "seed + n overflows": (bad_params(sp(seed=2**64 - 1, n=2)), VALUE, "sample i of n uses seed + i", 2),
    "temperature inf": (bad_params(sp(temperature=math.inf)), VALUE, "temperature must be a finite number", 2),
    "temperature str": (bad_params(sp(temperature="hot")), TYPE, "temperature must be a number >= 0", 2),
    "top_p str": (bad_params(sp(top_p="a")), TYPE, "top_p must be a number in (0, 1]", 2),
    "repetition_penalty inf": (bad_params(sp(repetition_penalty=math.inf)), VALUE, "repetition_penalty must be", 2),
    "max_tokens bool": (bad_params(sp(max_tokens=True)), TYPE, "max_tokens must be an integer >= 1, got bool", 2),
    "max_tokens float": (bad_params(sp(max_tokens=2.0)), TYPE, "max_tokens must be an integer >= 1, got float", 2),
    "max_tokens > model length": (bad_params(sp(max_tokens=600)), VALUE, "exceeds the model's maximum length", 2),
    "ignore_eos str": (bad_params(sp(ignore_eos="no")), TYPE, "ignore_eos must be True or False", 2),
    "stop without tokenizer": (bad_params(sp(stop=["x"])), VALUE, "stop strings ['x'] need a tokenizer", 2),
    "stop=5": (bad_params(sp(stop=5)), TYPE, "stop must be a string or a list of strings", 2),
    "params not SamplingParams": (bad_params(5), TYPE, "sampling params must be a SamplingParams or a dict", 2),
    "params dict, unknown key": (bad_params({"max_token": 3}), VALUE, "unknown sampling parameter(s) ['max_token']",
                                 2),
    "params dict, bad value": (bad_params({"temperature": -1.0}), VALUE, "temperature must be a finite number", 2),
    "params list too short": (call(GOOD + [OK], [GREEDY, GREEDY]), VALUE, "got 2 sampling params for 3 prompts",
                              None),
    "params a string": (call(GOOD, "greedy"), TYPE, "sampling_params must be a SamplingParams", None),
    # priority
    "priority str": (call(GOOD + [OK], priority=[0, 0, "high"]), TYPE, "priority must be an integer, got str", 2),
    "priority bool": (call(GOOD + [OK], priority=[0, 0, True]), TYPE, "priority must be an integer, got bool", 2),
    "priority list too short": (call(GOOD + [OK], priority=[0]), VALUE, "got 1 priorities for 3 prompts", None),
    "priority not a list": (call(GOOD + [OK], priority=3), TYPE, "priority must be a list of integers", None),
    # add_request (always request 0)
    "add_request seed str": (lambda llm: llm.add_request(OK, sp(seed="x")), TYPE, "seed must be an integer", 0),
    "add_request priority str": (lambda llm: llm.add_request(OK, GREEDY, priority="high"), TYPE,
                                 "priority must be an integer", 0),
    "add_request text": (lambda llm: llm.add_request("hello", GREEDY), VALUE, "needs a tokenizer", 0),
    "add_request stop": (lambda llm: llm.add_request(OK, {"stop": ["x"]}), VALUE, "need a tokenizer", 0),
    "add_request logprobs": (lambda llm: llm.add_request(OK, {"logprobs": 257}), VALUE, "logprobs=257", 0),
}


@pytest.fixture(scope="module")
def model():
    return cached_model("llama")


@pytest.fixture(scope="module")
def shared_llm(model):
    """One engine for the whole matrix: every refusal must leave it exactly as usable as a fresh one."""
    return LLM(model, block_size=8, num_blocks=64)


@pytest.fixture(scope="module")
def fresh_tokens(model):
    return [o.token_ids for o in LLM(model, block_size=8, num_blocks=64).generate(GOOD, GREEDY, use_tqdm=False)]


def assert_holds_nothing_and_still_serves(llm, fresh_tokens):
    stats = llm.stats()
    assert stats["num_waiting"] == stats["num_running"] == 0
    llm.engine.check_idle()
    assert [o.token_ids for o in llm.generate(GOOD, GREEDY, use_tqdm=False)] == fresh_tokens


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_refused_up_front(case, shared_llm, fresh_tokens):
    run, kind, fragment, request = CASES[case]
    before = shared_llm.stats()
    with pytest.raises(kind) as err:
        run(shared_llm)
    after = shared_llm.stats()
    assert after["num_steps"] == before["num_steps"] and after["num_finished"] == before["num_finished"]  # no work
    message = str(err.value)
    assert fragment in message
    if request is not None:
        assert message.startswith(f"request {request}: ")
    else:
        assert not message.startswith("request ")
    if kind is TYPE:  # a wrong type is a TypeError, and a ValueError for callers that catch only those
        assert isinstance(err.value, TypeError) and isinstance(err.value, ValueError)
    assert_holds_nothing_and_still_serves(shared_llm, fresh_tokens)


# ---- what is accepted (and served as its plain form) --------------------------------------------------------------
ACCEPTED = {
    "params as a dict": (call(GOOD, {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}), None),
    "params as a list of dicts": (call(GOOD, [{"max_tokens": 4, "temperature": 0, "ignore_eos": True}] * 2), None),
    "numpy token ids": (call([[np.int64(t) for t in p] for p in GOOD]), None),
    "2-D numpy array of prompts": (call(np.array([[4, 5, 6], [4, 5, 6]])), "rows"),
    "a generator of prompts": (call(p for p in GOOD), None),
    "dict prompts (vLLM style)": (call([{"prompt_token_ids": p} for p in GOOD]), None),
    "tiny temperature is greedy": (call(GOOD, sp(temperature=1e-40, ignore_eos=True)), None),
    "numpy priorities": (call(GOOD, priority=np.array([1, 0])), None),
}


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_accepted_forms_give_the_plain_result(case, shared_llm, fresh_tokens):
    run, kind = ACCEPTED[case]
    got = [o.token_ids for o in run(shared_llm)]
    assert got == ([fresh_tokens[0]] * 2 if kind == "rows" else fresh_tokens)
    assert_holds_nothing_and_still_serves(shared_llm, fresh_tokens)


def test_one_prompt_forms_and_empty_list(shared_llm, fresh_tokens):
    one = [fresh_tokens[0]]
    for prompt in ([4, 5, 6], (4, 5, 6), torch.tensor([4, 5, 6]), np.array([4, 5, 6]), {"prompt_token_ids": [4, 5, 6]}):
        assert [o.token_ids for o in shared_llm.generate(prompt, GREEDY, use_tqdm=False)] == one
    assert shared_llm.generate([], GREEDY, use_tqdm=False) == []  # no prompts: no outputs, nothing queued
    assert_holds_nothing_and_still_serves(shared_llm, fresh_tokens)


def test_sampled_forms_equal_their_plain_form(shared_llm):
    """A seed given as a numpy integer, top_k beyond the vocabulary (= no top-k) and one stop token id given bare."""
    plain = SamplingParams(max_tokens=6, temperature=0.9, seed=3, stop_token_ids=[7])
    forms = [SamplingParams(max_tokens=6, temperature=0.9, seed=np.int64(3), stop_token_ids=[7]),
             SamplingParams(max_tokens=6, temperature=0.9, seed=3, stop_token_ids=7, top_k=10_000),
             {"max_tokens": 6, "temperature": 0.9, "seed": 3, "stop_token_ids": (7,)}]
    want = shared_llm.generate(GOOD, plain, use_tqdm=False)
    for form in forms:
        assert [o.token_ids for o in shared_llm.generate(GOOD, form, use_tqdm=False)] == [o.token_ids for o in want]
    shared_llm.engine.check_idle()


def test_largest_seed_is_served(shared_llm):
    out = shared_llm.generate([OK], sp(temperature=1.0, seed=2**64 - 2, n=2), use_tqdm=False)[0]
    assert [len(o.token_ids) for o in out.outputs] == [4, 4]


def test_more_samples_than_free_blocks_are_all_served(model):
    """n=5 samples of a prompt shorter than one block, in a pool of 4: they fork from one computed prompt and each
    needs a private copy of the shared block on its first write; the fifth is preempted and served after the others.
    All samples equal those of a roomy pool. (It crashed with "asked for 1 KV blocks, only 0 free" while
    KVCacheManager.num_new_blocks took a shared block at table index 0 for no shared block.)"""
    params = SamplingParams(n=5, max_tokens=2, temperature=0.9, seed=7)
    roomy = LLM(model, num_blocks=64).generate([[5, 6, 7]], params, use_tqdm=False)[0]
    tight = LLM(model, num_blocks=4)
    out = tight.generate([[5, 6, 7]], params, use_tqdm=False)[0]
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in roomy.outputs]
    assert tight.stats()["num_preemptions"] >= 1
    tight.engine.check_idle()


# ---- construction-time checks -------------------------------------------------------------------------------------
@pytest.mark.parametrize("options, kind, fragment", [
    (dict(enable_chunked_prefill="no"), TYPE, "enable_chunked_prefill must be True or False, got 'no'"),
    (dict(enable_prefix_caching=1), TYPE, "enable_prefix_caching must be True or False, got 1"),
    (dict(seed="x"), TYPE, "seed must be an integer in [0, 2**64) or None, got 'x'"),
    (dict(seed=-1), VALUE, "seed must be an integer in [0, 2**64) or None, got -1"),
    (dict(seed=2**64), VALUE, "seed must be an integer in [0, 2**64) or None"),
    (dict(block_size=True), TYPE, "block_size must be an integer >= 1, got bool"),
    (dict(swap_space=True), TYPE, "swap_space must be an integer >= 0, got bool"),
    (dict(long_prefill_token_threshold=True), TYPE, "long_prefill_token_threshold must be an integer >= 0"),
    (dict(max_num_seqs=2.5), TYPE, "max_num_seqs must be an integer >= 1, got float"),
    (dict(max_model_len=513), VALUE, "max_model_len=513 exceeds the model's maximum length "
                                     "(max_position_embeddings=512)"),
    (dict(num_blocks=10**9), VALUE, "the KV cache (num_blocks=1000000000: 1000000001 blocks x 8192 bytes"),
    (dict(kv_cache_memory=10**15), VALUE, "the KV cache (kv_cache_memory=1000000000000000:"),
    (dict(num_blocks=8, preemption_mode="swap", swap_space=10**15), VALUE, "swap_space (931322.57 GiB)"),
])
def test_bad_engine_options_are_refused_at_construction(model, options, kind, fragment):
    with pytest.raises(kind) as err:
        LLM(model, **options)
    assert fragment in str(err.value)
    if "available host memory" in str(err.value):
        assert "GiB); lower" in str(err.value)


def test_kv_budget_is_checked_against_available_host_memory(model, monkeypatch):
    monkeypatch.setattr(memory_module, "available_host_memory", lambda: 100 * 8192)  # room for 100 blocks of 8 KiB
    with pytest.raises(ValueError, match=r"101 blocks x 8192 bytes = 0\.00 GiB\) exceeds the available host memory"):
        LLM(model, num_blocks=100)
    LLM(model, num_blocks=99).generate(GOOD, GREEDY, use_tqdm=False)  # 99 + the null block fit exactly


def test_max_model_len_beyond_the_position_table():
    """GPT-2 learns one embedding per position: past the table the forward pass fails mid-step (IndexError)."""
    model = cached_model("gpt2", max_len=32)
    with pytest.raises(ValueError, match=r"max_model_len=64 exceeds .*max_position_embeddings=32"):
        LLM(model, num_blocks=16, max_model_len=64)
    llm = LLM(model, num_blocks=16, max_model_len=32)
    with pytest.raises(ValueError, match="request 0: .*exceeds the model's maximum length 32"):
        llm.generate([list(range(3, 33))], sp(max_tokens=8), use_tqdm=False)
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="max_model_len=64 exceeds"):
        model.generate(ids, max_new_tokens=2, cache_implementation="paged", cache_config={"max_model_len": 64})


@pytest.mark.parametrize("cache_config, kind, fragment", [
    ("no", TYPE, "cache_config must be a dict of hf_paged engine options"),
    ([("num_blocks", 8)], TYPE, "cache_config must be a dict"),
    ({"enable_chunked_prefill": "no"}, TYPE, "enable_chunked_prefill must be True or False"),
    ({"num_block": 8}, VALUE, "unknown hf_paged engine option(s) ['num_block']"),
    ({"num_blocks": 10**9}, VALUE, "exceeds the available host memory"),
])
def test_generate_takeover_refuses_bad_cache_config(model, cache_config, kind, fragment):
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(kind) as err:
        model.generate(ids, max_new_tokens=3, do_sample=False, cache_implementation="paged", cache_config=cache_config)
    assert fragment in str(err.value)
    want = model.generate(ids, max_new_tokens=3, do_sample=False)
    got = model.generate(ids, max_new_tokens=3, do_sample=False, cache_implementation="paged", cache_config={})
    assert torch.equal(got, want)


def test_bad_cache_config_is_refused_even_where_hf_loop_would_run(model):
    """output_attentions sends the call to HF's own loop, which would ignore cache_config: it is checked first."""
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match=r"unknown hf_paged engine option\(s\) \['num_block'\]"):
        model.generate(ids, max_new_tokens=2, do_sample=False, cache_implementation="paged", output_attentions=True,
                       return_dict_in_generate=True, cache_config={"num_block": 8})
