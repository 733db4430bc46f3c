"""transformers' continuous-batching API on hf_paged (integrations/cb_manager.py): `generate_batch`,
`init_continuous_batching` and the manager's public API give HF's tokens, each request exactly one finished output,
streaming, cancellation, failures as FAILED outputs, and what hf_paged cannot run left to transformers' manager."""
from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager
from transformers.generation.continuous_batching.requests import RequestStatus

import hf_paged
from hf_paged.integrations.cb_manager import PagedBatchingManager
from hf_paged.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19, 20], [30, 31]]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def config(**fields):
    return GenerationConfig(**{"max_new_tokens": 10, "do_sample": False, "eos_token_id": None, "pad_token_id": 0,
                               **fields})


def hf_tokens(model, prompt, new=10, eos=None):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=eos,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_generate_batch_gives_hfs_tokens_in_input_order(model):
    outs = model.generate_batch(PROMPTS, generation_config=config())
    assert list(outs) == [f"req_{i}" for i in range(len(PROMPTS))]
    for prompt, out in zip(PROMPTS, outs.values()):
        assert out.status == RequestStatus.FINISHED and out.error is None
        assert out.prompt_ids == prompt
        assert out.generated_tokens == hf_tokens(model, prompt)
        assert len(out.logprobs) == len(out.generated_tokens) and all(lp <= 0 for lp in out.logprobs)


def test_eos_ends_a_request_with_the_token(model):
    eos = hf_tokens(model, PROMPTS[0])[3]
    outs = model.generate_batch(PROMPTS, generation_config=config(eos_token_id=eos))
    for prompt, out in zip(PROMPTS, outs.values()):
        assert out.generated_tokens == hf_tokens(model, prompt, eos=eos)
    assert outs["req_0"].generated_tokens[-1] == eos and len(outs["req_0"].generated_tokens) == 4


def test_num_return_sequences_names_every_sample_as_transformers_does(model):
    outs = model.generate_batch(PROMPTS[:2], generation_config=config(num_return_sequences=3, max_new_tokens=4,
                                                                 do_sample=True, top_k=1))  # sampled, top-1
    assert sorted(outs) == sorted(["req_0", "req_0__child#0", "req_0__child#1", "req_1", "req_1__child#0",
                                   "req_1__child#1"])
    for name, out in outs.items():
        assert out.generated_tokens == hf_tokens(model, PROMPTS[int(name[4])], new=4)


def test_the_manager_streams_cancels_and_is_kept(model):
    manager = model.init_continuous_batching(generation_config=config(max_new_tokens=30))
    assert isinstance(manager, PagedBatchingManager)
    manager.start()
    try:
        streamed = manager.add_request(PROMPTS[0], streaming=True, max_new_tokens=6)
        seen = list(manager.request_id_iter(streamed))
        assert [len(o.generated_tokens) for o in seen] == [1, 2, 3, 4, 5, 6]
        assert [o.status for o in seen] == [RequestStatus.DECODING] * 5 + [RequestStatus.FINISHED]
        assert seen[-1].generated_tokens == hf_tokens(model, PROMPTS[0], new=6)
        long = manager.add_request(PROMPTS[1], request_id="long", max_new_tokens=30)
        manager.cancel_request(long)
        short = manager.add_request(PROMPTS[2], max_new_tokens=3)
        result = None
        while result is None:
            result = manager.get_result(timeout=5)
        assert result.request_id == short and result.generated_tokens == hf_tokens(model, PROMPTS[2], new=3)
        assert manager.get_result(timeout=0.3) is None  # nothing from the cancelled request
    finally:
        manager.stop(block=True, timeout=30, keep_for_next_session=True)
    assert not manager.is_running()
    assert model.init_continuous_batching() is manager  # kept, as transformers keeps a persistent manager
    model.destroy_cached_continuous_batching_manager()
    assert model.init_continuous_batching(generation_config=config()) is not manager


def test_a_refused_request_and_a_failed_step_end_as_failed(model):
    with model.continuous_batching_context_manager(generation_config=config(max_new_tokens=4)) as manager:
        bad = manager.add_request(list(range(3, 9)) * 200, max_new_tokens=4)  # longer than the model takes
        unknown = manager.add_request(PROMPTS[0], max_new_tokens=4, no_such_knob=1.0)
        results = {r.request_id: r for r in (manager.get_result(timeout=10), manager.get_result(timeout=10))}
        assert results[bad].status == RequestStatus.FAILED and "request" in results[bad].error
        assert results[unknown].status == RequestStatus.FAILED and "no_such_knob" in results[unknown].error
        step = manager.llm.step
        calls = []

        def failing_step():
            if not calls:
                calls.append(1)
                raise RuntimeError("injected step failure")
            return step()

        manager.llm.step = failing_step
        victim = manager.add_request(PROMPTS[1], max_new_tokens=4)
        failed = manager.get_result(timeout=10)
        assert failed.request_id == victim and failed.status == RequestStatus.FAILED
        assert "injected step failure" in failed.error
        after = manager.add_request(PROMPTS[2], max_new_tokens=4)  # the loop goes on
        result = manager.get_result(timeout=10)
        assert result.request_id == after and result.generated_tokens == hf_tokens(model, PROMPTS[2], new=4)
        manager.llm.engine.check_idle()


def test_result_handlers_run_on_the_event_loop(model):
    async def main():
        manager = model.init_continuous_batching(generation_config=config(max_new_tokens=5))
        manager.start()
        try:
            got, done = [], asyncio.Event()

            def callback(output):
                got.append(output)
                if output.is_finished():
                    done.set()
            request_id = "handled"
            manager.register_result_handler(request_id, callback)
            manager.add_request(PROMPTS[3], request_id=request_id, streaming=True)
            await asyncio.wait_for(done.wait(), 30)
            return got
        finally:
            manager.stop(block=True, timeout=30)
    got = asyncio.run(main())
    assert [len(o.generated_tokens) for o in got] == [1, 2, 3, 4, 5]
    assert got[-1].generated_tokens == hf_tokens(model, PROMPTS[3], new=5)


def test_what_the_sampler_lacks_goes_to_transformers_manager(model):
    manager = model.init_continuous_batching(generation_config=config(no_repeat_ngram_size=2))
    assert isinstance(manager, ContinuousBatchingManager)
    manager.destroy()
    model.train()
    paged = model.init_continuous_batching(generation_config=config())
    assert isinstance(paged, PagedBatchingManager) and not model.training  # eval, as transformers' manager sets it
    hf_paged.disable()
    try:
        assert isinstance(model.init_continuous_batching(generation_config=config()), ContinuousBatchingManager)
    finally:
        hf_paged.enable()


def finished_results(manager, count, seconds=30):
    """Up to `count` finished outputs, waiting at most `seconds` in all."""
    import time

    results, deadline = {}, time.monotonic() + seconds
    while len(results) < count and time.monotonic() < deadline:
        result = manager.get_result(timeout=0.2)
        if result is not None and result.is_finished():
            results[result.request_id] = result
    return results


def test_num_return_sequences_set_on_a_made_manager_gives_every_sample(model):
    # transformers reads it per request (its own test sets it on a made manager): an n=1 engine request under two
    # names never finished
    manager = model.init_continuous_batching(generation_config=config())
    manager.num_return_sequences = 2
    manager.start()
    try:
        manager.add_request(PROMPTS[0], request_id="r", max_new_tokens=6)
        results = finished_results(manager, 2)
    finally:
        manager.stop(block=True, timeout=30)
    assert sorted(results) == ["r", "r__child#0"]
    assert all(out.generated_tokens == hf_tokens(model, PROMPTS[0], new=6) for out in results.values())
    assert not manager._live


def test_processors_cleared_and_do_sample_turned_off_before_start_apply(model):
    # as transformers' tests do: logit_processor.clear(), then do_sample off, read when the loop starts
    manager = model.init_continuous_batching(generation_config=config(do_sample=True, temperature=5.0, top_k=0,
                                                                      repetition_penalty=1.5))
    manager.logit_processor.clear()
    manager.generation_config.do_sample = False
    manager.start()
    try:
        ids = [manager.add_request(prompt, max_new_tokens=6) for prompt in PROMPTS[:2]]
        results = finished_results(manager, 2)
    finally:
        manager.stop(block=True, timeout=30)
    for request_id, prompt in zip(ids, PROMPTS):  # greedy, without the config's penalty
        assert results[request_id].generated_tokens == hf_tokens(model, prompt, new=6)
    assert manager.current_batch >= 6 and manager.output_router.output_queue is manager.output_queue


def test_sampling_keywords_of_a_request_leave_a_greedy_config_greedy(model):
    # transformers' loop samples only with do_sample (its own test passes temperature / top-k / top-p to greedy runs)
    manager = model.init_continuous_batching(generation_config=config())
    manager.start()
    try:
        ids = [manager.add_request(prompt, max_new_tokens=6, temperature=5.0, top_k=100, top_p=0.99)
               for prompt in PROMPTS[:2]]
        results = finished_results(manager, 2)
    finally:
        manager.stop(block=True, timeout=30)
    for request_id, prompt in zip(ids, PROMPTS):
        assert results[request_id].generated_tokens == hf_tokens(model, prompt, new=6)


def test_generate_batchs_workload_sizes_the_pool_and_a_pool_memory_cannot_hold_falls_back(model):
    # generate_batch passes its workload (4 requests, prompts <= 8, 10 new tokens): 4 x ceil(18 / 16) blocks, not the
    # engine's default pool (its blocks cost a rollout of TRL, which makes a manager per call, more than generating)
    from transformers.generation.continuous_batching.utils import WorkloadHints

    outs = model.generate_batch(PROMPTS, generation_config=config(), persistent_manager=True)
    manager = model.__dict__["_cached_continuous_batching_manager"]
    assert manager.llm.engine.memory.num_blocks == 8
    for prompt, out in zip(PROMPTS, outs.values()):
        assert out.generated_tokens == hf_tokens(model, prompt)
    model.destroy_cached_continuous_batching_manager()
    huge = model.init_continuous_batching(generation_config=config(), workload_hints=WorkloadHints(
        max_prompt_length=8, max_generated_length=10, num_requests=10**12))
    huge.warmup()  # more blocks than memory holds: the engine's own default pool
    assert 8 < huge.llm.engine.memory.num_blocks < 10**12


def test_stop_from_inside_a_pause_raises_and_a_pause_the_loop_dies_before_raises(model):
    import threading

    manager = model.init_continuous_batching(generation_config=config(max_new_tokens=200))
    manager.start()
    manager.add_request(PROMPTS[1], max_new_tokens=200)
    raised = []

    def stop_inside_a_pause():
        with manager.pause():
            try:
                manager.stop(block=True)  # would wait forever for a loop this thread keeps paused
            except RuntimeError as e:
                raised.append(e)

    thread = threading.Thread(target=stop_inside_a_pause, daemon=True)
    thread.start()
    thread.join(20)
    assert not thread.is_alive() and raised and "inside a pause" in str(raised[0])
    manager.stop(block=True, timeout=60)  # outside the pause it finishes the request and ends
    assert not manager.is_running()
    assert finished_results(manager, 1)
    with pytest.raises(RuntimeError):
        with manager.pause():
            pass
    dying = model.init_continuous_batching(generation_config=config(max_new_tokens=200))
    dying.start()

    stepping = threading.Event()

    def step_that_kills_the_loop():  # waits for the pause to be asked, then gives what the loop cannot take
        stepping.set()
        while not dying._paused.is_set():
            threading.Event().wait(0.001)
        return [None]

    dying.llm.step = step_that_kills_the_loop
    dying.add_request(PROMPTS[1], max_new_tokens=200)
    assert stepping.wait(20)
    with pytest.raises(RuntimeError) as caught:  # the loop dies before it pauses: said, not entered
        with dying.pause():
            pass
    assert caught.value.__cause__ is dying.fatal_error is not None
