"""llm.py: the LLM's request-level API: add_request / step / abort with request ids, and queued requests that keep
their own copy of the caller's sampling params (generate, stream and chat are the feature suites')."""
import pytest

from hf_paged import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_streaming_api_add_step_abort(llama):
    llm = LLM(llama)
    a = llm.add_request([3, 4, 5], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    b = llm.add_request([6, 7], GREEDY)
    seen = {a: 0, b: 0}
    for _ in range(3):
        for out in llm.step():
            seen[out.request_id] += 1
    assert seen[a] == seen[b] == 3
    assert llm.abort(a)
    while llm.has_unfinished_requests():
        llm.step()
    assert llm.stats()["num_blocks_free"] == llm.stats()["num_blocks_total"]
    with pytest.raises(ValueError, match="already in use"):
        llm.add_request([1, 2], request_id="x") and llm.add_request([1, 2], request_id="x")


def test_add_request_keeps_its_own_copy_of_the_params(llama):
    """Changing the caller's SamplingParams after add_request changes no queued request (it used to: fewer tokens,
    other stop ids, or a wedged engine)."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[])
    expected = LLM(llama).generate([[3, 4, 5], [6, 7]], params, use_tqdm=False)
    llm = LLM(llama)
    ids = [llm.add_request(p, params) for p in ([3, 4, 5], [6, 7])]
    params.max_tokens = 2
    params.stop_token_ids.append(expected[0].token_ids[3])
    params.n = 3
    params.temperature = 1.0
    finished = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                finished[out.request_id] = out.token_ids
    assert [finished[i] for i in ids] == [o.token_ids for o in expected]


def test_a_call_tokenizes_and_checks_each_prompt_once(llama, monkeypatch):
    """`LLM` validates a whole call before queueing any of it; the engine does not do it again for those prompts
    (a direct `Engine.add_request` still checks)."""
    from hf_paged.engine import engine as engine_module

    calls = []
    check = engine_module.check_request
    monkeypatch.setattr(engine_module, "check_request", lambda *a, **k: calls.append(a[1]) or check(*a, **k))
    import hf_paged.llm as llm_module

    llm_check = llm_module.check_request
    monkeypatch.setattr(llm_module, "check_request", lambda *a, **k: calls.append(a[1]) or llm_check(*a, **k))
    llm = LLM(llama, num_blocks=32, block_size=4)
    llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert sorted(calls) == [0, 1]
    calls.clear()
    llm.engine.add_request([5, 6], SamplingParams(max_tokens=2))
    assert calls == [0]
    with pytest.raises(ValueError, match="request 0"):
        llm.engine.add_request([5, -1], SamplingParams(max_tokens=2))
