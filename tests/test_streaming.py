"""`LLM.stream` / `LLM.astream`: snapshots as each step completes, final outputs equal `generate`'s (and HF's), an
abandoned or cancelled stream frees its blocks at once, concurrent async consumers each get exactly their own."""
from __future__ import annotations

import asyncio

import pytest
import torch

from hf_paged import LLM, SamplingParams
from hf_paged.tiny import tiny_model
from test_pipeline import make_tokenizer

PROMPTS = ["abc", "helloWorld", "x", "pagedAttention42"]
GREEDY = SamplingParams(max_tokens=7, temperature=0.0)


@pytest.fixture(scope="module")
def llm(one_torch_thread):
    return LLM(tiny_model("llama"), make_tokenizer())


def assert_idle(llm: LLM) -> None:
    llm.engine.check_idle()
    stats = llm.stats()
    assert stats["num_blocks_free"] == stats["num_blocks_total"] and not llm.engine.parents


def finals(snapshots):
    return {out.request_id: out for out in snapshots if out.finished}


def test_stream_equals_generate_and_hf(llm):
    tok = llm.engine.tokenizer
    params = [GREEDY, GREEDY, SamplingParams(max_tokens=5, temperature=0.9, n=2, seed=7), GREEDY]
    ref = llm.generate(PROMPTS, params, use_tqdm=False)
    snapshots = list(llm.stream(PROMPTS, params))
    done = sorted(finals(snapshots).values(), key=lambda out: int(out.request_id))
    assert [[(c.token_ids, c.text, c.finish_reason) for c in out.outputs] for out in done] == \
        [[(c.token_ids, c.text, c.finish_reason) for c in out.outputs] for out in ref]
    for prompt, out in zip(PROMPTS, done):  # greedy prompts: HF's own tokens
        if out is not done[2]:
            ids = torch.tensor([tok(prompt)["input_ids"]])
            hf = llm.engine.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=7, do_sample=False)
            assert out.token_ids == hf[0, ids.shape[1]:].tolist()
    seen: dict[str, int] = {}
    for out in snapshots:  # cumulative: one more token per snapshot, text = the tokens decoded so far
        final = finals(snapshots)[out.request_id]
        for sample, done_sample in zip(out.outputs, final.outputs):
            assert done_sample.token_ids[:len(sample.token_ids)] == sample.token_ids
            assert sample.text == tok.decode(sample.token_ids, skip_special_tokens=True)
        assert len(out.token_ids) == seen.get(out.request_id, 0) + 1
        seen[out.request_id] = len(out.token_ids)
        assert out.finished == (out is final)
    assert_idle(llm)


def test_closing_the_stream_frees_its_blocks(llm):
    stream = llm.stream(PROMPTS, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    for _ in range(6):
        out = next(stream)
    assert not out.finished and llm.stats()["num_blocks_free"] < llm.stats()["num_blocks_total"]
    stream.close()
    assert_idle(llm)


async def consume(llm: LLM, prompts, params, stop_after: int | None = None):
    outs = []
    async for out in llm.astream(prompts, params):
        outs.append(out)
        await asyncio.sleep(0)  # let the other consumers run between snapshots
        if stop_after is not None and len(outs) >= stop_after:
            break
    return outs


def test_concurrent_astream_consumers_get_their_own(llm):
    ref = {p: out for p, out in zip(PROMPTS, llm.generate(PROMPTS, GREEDY, use_tqdm=False))}
    groups = [[PROMPTS[0]], [PROMPTS[1], PROMPTS[2]], [PROMPTS[3]]]

    async def main():
        return await asyncio.gather(*(consume(llm, group, GREEDY) for group in groups))

    results = asyncio.run(main())
    for group, outs in zip(groups, results):
        done = sorted(finals(outs).values(), key=lambda out: int(out.request_id))
        assert [(out.prompt, out.token_ids, out.text) for out in done] == \
            [(p, ref[p].token_ids, ref[p].text) for p in group]
        assert {out.prompt for out in outs} == set(group)  # nobody else's snapshots
    assert_idle(llm)


def test_cancelled_astream_frees_blocks_at_once(llm):
    long = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)

    async def main():
        started = asyncio.Event()

        async def endless():
            async for _ in llm.astream(PROMPTS, long):
                started.set()

        task = asyncio.create_task(endless())
        other = asyncio.create_task(consume(llm, [PROMPTS[1]], GREEDY))  # keeps running, unaffected
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        held = [g.request_id for g in llm.engine.parents.values() if g.prompt != PROMPTS[1]]
        assert not held, f"cancelled requests still held: {held}"
        partial = await consume(llm, PROMPTS[:1], long, stop_after=3)  # aclose via break
        return await other, partial

    other, partial = asyncio.run(main())
    expected = llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0].token_ids
    assert finals(other)[other[-1].request_id].token_ids == expected
    assert len(partial) == 3 and not partial[-1].finished
    assert_idle(llm)


def test_abort_elsewhere_ends_the_streams(llm):
    """A request aborted through `LLM.abort` while it streams ends its stream instead of leaving it waiting."""
    long = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    outs = []
    for out in llm.stream(PROMPTS[:2], long):
        outs.append(out)
        if len(outs) == 3:
            llm.abort(out.request_id)
    aborted = [out for out in outs if out.request_id == outs[2].request_id]
    assert len(aborted) == 2 and not aborted[-1].finished  # the other prompt ran to its end
    assert [out.finished for out in outs if out.request_id != outs[2].request_id][-1]

    async def main():
        outs = []

        async def aborter():
            while not outs:
                await asyncio.sleep(0.001)
            llm.abort(outs[0].request_id)

        async def reader():
            async for out in llm.astream(PROMPTS[0], long):
                outs.append(out)

        await asyncio.wait_for(asyncio.gather(reader(), aborter()), timeout=60)
        return outs

    assert not asyncio.run(main())[-1].finished
    assert_idle(llm)
