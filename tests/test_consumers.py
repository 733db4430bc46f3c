"""Every caller of one LLM gets exactly its own requests' results: `generate`, `stream`, `astream` and
`add_request` / `step` loops, in one thread or several, whoever runs the steps; nothing is lost, duplicated or left
behind (the engine holds no group afterwards)."""
import asyncio
import threading

import pytest

from hf_paged import LLM, SamplingParams

from conftest import cached_model

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
A = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
B = [[20, 21], [22, 23, 24, 25, 26], [27]]
C = [[40, 41, 42], [43]]


class Letters:
    """One letter per token; `decode` can be made to raise once (a Ctrl-C while text is decoded)."""

    eos_token_id = None

    def __init__(self):
        self.interrupt_next = False

    def decode(self, token_ids, skip_special_tokens=True):
        if self.interrupt_next:
            self.interrupt_next = False
            raise KeyboardInterrupt
        return "".join(chr(97 + t % 26) for t in token_ids)


@pytest.fixture(scope="module")
def model():
    return cached_model("llama")


@pytest.fixture(scope="module")
def expected(model):
    llm = LLM(model, Letters())
    return {name: [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
            for name, prompts in (("A", A), ("B", B), ("C", C))}


def final_stream_tokens(iterator):
    last = {}
    for out in iterator:
        last[out.request_id] = out
    return [o.token_ids for o in sorted(last.values(), key=lambda o: int(o.request_id))]


def run_threads(*jobs, timeout=120):
    results, errors = [None] * len(jobs), []

    def work(i, job):
        try:
            results[i] = job()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i, job), daemon=True) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), "a caller never finished (busy loop or hang)"
    assert not errors, errors
    return results


def assert_clean(llm):
    llm.engine.check_idle()
    assert not llm.engine.parents and not llm.engine.dirty


def test_two_threads_streaming_each_get_their_own(model, expected):
    llm = LLM(model, Letters(), max_num_seqs=4)
    a, b = run_threads(lambda: final_stream_tokens(llm.stream(A, GREEDY)),
                       lambda: final_stream_tokens(llm.stream(B, GREEDY)))
    assert a == expected["A"] and b == expected["B"]
    assert_clean(llm)


def test_generate_while_a_stream_is_open_in_the_same_thread(model, expected):
    llm = LLM(model, Letters())
    stream = llm.stream(A, GREEDY)
    first = next(stream)
    assert [o.token_ids for o in llm.generate(B, GREEDY, use_tqdm=False)] == expected["B"]
    last = {first.request_id: first}
    for out in stream:
        last[out.request_id] = out
    assert [last[k].token_ids for k in sorted(last, key=int)] == expected["A"]
    assert all(o.finished for o in last.values())
    assert_clean(llm)


def test_generate_in_one_thread_and_a_stream_in_another(model, expected):
    llm = LLM(model, Letters(), max_num_seqs=3)
    a, b = run_threads(lambda: final_stream_tokens(llm.stream(A, GREEDY)),
                       lambda: [o.token_ids for o in llm.generate(B, GREEDY, use_tqdm=False)])
    assert a == expected["A"] and b == expected["B"]
    assert_clean(llm)


def step_loop(llm, prompts):
    ids = [llm.add_request(p, GREEDY) for p in prompts]
    done, seen = {}, set()
    while llm.has_unfinished_requests():
        for out in llm.step():
            seen.add(out.request_id)
            if out.finished:
                assert out.request_id not in done, "finished twice"
                done[out.request_id] = out.token_ids
    return ids, done, seen


def test_a_step_loop_and_generate_in_other_threads(model, expected):
    llm = LLM(model, Letters(), max_num_seqs=3)
    (ids, done, seen), b = run_threads(lambda: step_loop(llm, A),
                                       lambda: [o.token_ids for o in llm.generate(B, GREEDY, use_tqdm=False)])
    assert [done[i] for i in ids] == expected["A"]
    assert seen == set(ids), "step() returned another call's requests"
    assert b == expected["B"]
    assert_clean(llm)


def test_a_step_loop_gets_results_of_steps_generate_ran(model, expected):
    """Requests queued with add_request finish while a generate call drives the engine: step() reports them."""
    llm = LLM(model, Letters())
    ids = [llm.add_request(p, GREEDY) for p in A]
    assert [o.token_ids for o in llm.generate(B, GREEDY, use_tqdm=False)] == expected["B"]
    done = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert [done[i] for i in ids] == expected["A"]
    assert_clean(llm)


def test_ctrl_c_while_step_decodes_loses_nothing(model, expected):
    tokenizer = Letters()
    llm = LLM(model, tokenizer)
    ids = [llm.add_request(p, GREEDY) for p in A]
    done, interrupted = {}, 0
    tokenizer.interrupt_next = True  # the first decode: the text of the first request to finish
    while llm.has_unfinished_requests():
        try:
            outs = llm.step()
        except KeyboardInterrupt:
            interrupted += 1
            continue
        for out in outs:
            if out.finished:
                assert out.request_id not in done
                done[out.request_id] = out.token_ids
    assert interrupted == 1
    assert [done[i] for i in ids] == expected["A"]
    assert_clean(llm)


def test_astream_and_generate_from_another_thread(model, expected):
    llm = LLM(model, Letters(), max_num_seqs=3)

    async def consume():
        last = {}
        async for out in llm.astream(A, GREEDY):
            last[out.request_id] = out
        return [last[k].token_ids for k in sorted(last, key=int)]

    a, b = run_threads(lambda: asyncio.run(consume()),
                       lambda: [o.token_ids for o in llm.generate(B, GREEDY, use_tqdm=False)])
    assert a == expected["A"] and b == expected["B"]
    assert_clean(llm)


def test_an_id_still_claimed_by_an_open_stream_is_refused(model):
    """Found by review: after LLM.abort of a stream's request, add_request with that id was accepted and the stream
    reported the new request as its own."""
    llm = LLM(model, Letters())
    stream = llm.stream(A, GREEDY)
    first = next(stream)
    assert llm.abort(first.request_id)
    with pytest.raises(ValueError, match="still belongs to an open"):
        llm.add_request([9, 9, 9, 9], GREEDY, request_id=first.request_id)
    assert all(out.request_id != first.request_id or out.prompt_token_ids == first.prompt_token_ids for out in stream)
    llm.add_request([9, 9, 9, 9], GREEDY, request_id=first.request_id)  # free again once the stream closed
    while llm.has_unfinished_requests():
        llm.step()
    assert_clean(llm)


def test_an_abort_from_inside_a_step_waits_for_its_end(model, expected):
    """Found by review: an abandoned stream collected by the garbage collector in the middle of another caller's
    step aborted its requests there (the engine lock is re-entrant): that step failed. Now such an abort (simulated by
    a forward hook) takes effect right after the step."""
    llm = LLM(model, Letters())
    victim = llm.add_request([50, 51, 52], GREEDY)
    keep = [llm.add_request(p, GREEDY) for p in A]
    layer = model.model.layers[0]
    fired = []

    def hook(module, args, output):
        if not fired:
            fired.append(llm.abort(victim))

    handle = layer.register_forward_hook(hook)
    try:
        llm.step()
    finally:
        handle.remove()
    assert fired == [True] and victim not in llm.engine.parents
    done = {}
    while llm.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in llm.step() if o.finished})
    assert [done[i] for i in keep] == expected["A"]
    assert_clean(llm)
