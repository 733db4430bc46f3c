"""`LLM`: the offline batch API (vLLM-style) on top of the engine, streaming (`stream`, `astream`) and data parallel
`generate` under `torchrun` / `accelerate launch`."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator, Sequence

import torch

from .chat import as_conversations, chat_prompts
from .distributed import World, gather_in_order, plan_processes, split_world
from .engine import Engine
from .engine.intake import (as_params, as_params_list, as_priorities, as_priority, as_prompt_list, check_request,
                            prompt_text)
from .request import ParentRequest, RequestOutput
from .sampling import SamplingParams


class LLM:
    """Generate for many prompts at once with continuous batching over a paged KV cache.

    `LLM(model, tokenizer=tok, block_size=16, max_num_seqs=128)` takes the same keys as
    `generate(..., cache_config={...})` (see `EngineConfig`).

    Under `torchrun` / `accelerate launch` (torch.distributed initialized, or WORLD_SIZE > 1) `generate` is data
    parallel, and every process must call it (each call starts with one collective): when every process passed the
    same prompts and parameters, each serves every world_size-th prompt and every process returns all outputs, in
    input order; when they differ (e.g. accelerate's `with state.split_between_processes(prompts) as mine:
    llm.generate(mine)`, also with an uneven or empty share), each process serves exactly its own prompts and returns
    their outputs, in its input order. Without a pool size each process of a host takes its share of the default KV
    budget. `data_parallel=False` opts out (no collective: each process runs every prompt it is given). A model
    loaded with transformers' `tp_plan="auto"` is tensor parallel instead: every process runs every prompt on its
    share of the model, in lockstep (see `hf_paged.distributed`).
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, *, data_parallel: bool = True, **options):
        device = next(model.parameters()).device
        self.world, options = plan_processes(model, options, device, data_parallel)
        self.engine = Engine(model, tokenizer, **options)
        self._claimed: set[str] = set()  # ids of requests a generate / stream / astream call owns (not `step`'s)
        self._driver: _AsyncDriver | None = None  # steps the engine for `astream` consumers (one event loop)

    # streaming-style access -----------------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams | dict | None = None, *, request_id: str | None = None,
                    priority: int = 0) -> str:
        """Queue one prompt; returns its request id. Invalid input raises ValueError (InputTypeError for a wrong type)
        before anything is queued. `params` may also be a dict of SamplingParams fields."""
        engine = self.engine
        if request_id is not None and str(request_id) in self._claimed:
            raise ValueError(f"request 0: request_id {str(request_id)!r} still belongs to an open generate / stream "
                             f"call (aborted, not yet closed); use another id")
        params = as_params(params, 0)
        priority = as_priority(priority, 0)
        token_ids = engine.tokenize(prompt, 0)
        check_request(engine.limits, 0, token_ids, params, has_tokenizer=engine.tokenizer is not None)
        return engine.add_request(token_ids, params, request_id=request_id, priority=priority,
                                  prompt_text=prompt_text(prompt)).request_id

    def step(self) -> list[RequestOutput]:
        """One engine step; an output for every sample of a request queued by `add_request` that received a token or
        finished since the last `step` (with `n` > 1, one per sample: `outputs[0].index` says which), whoever ran the
        steps (a `generate` or `stream` in another thread drives them too). Requests of `generate` / `stream` /
        `astream` calls go to those calls, never here. A prompt whose samples have all finished is forgotten once
        reported; an output not reported because of an error (e.g. Ctrl-C while decoding its text) comes next time."""
        self._advance()
        return self._collect(self._unclaimed, _per_sample)

    def _unclaimed(self, request_id: str) -> bool:
        return request_id not in self._claimed

    def _collect(self, owned, build) -> list[RequestOutput]:
        """Outputs of the requests `owned(request_id)` accepts that changed since they were last collected: `build`
        (parent, sample indices) gives each one's outputs. Nothing is taken until all are built (an error while
        decoding leaves every mark for the next call); finished parents are then forgotten."""
        engine = self.engine
        with engine.lock:
            taken = [(rid, samples) for rid, samples in engine.dirty.items() if owned(rid)]
            if not taken:
                return []
            outs, done = [], []
            for request_id, samples in taken:
                parent = engine.parents.get(request_id)
                if parent is not None:
                    outs.extend(build(engine, parent, samples))
                    if parent.is_finished:
                        done.append(parent)
            ids = {request_id for request_id, _ in taken}
            engine.dirty = {rid: samples for rid, samples in engine.dirty.items() if rid not in ids}
            for parent in done:
                engine.release(parent)
            return outs

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        """Whether the engine has work, or `step` has outputs still to report."""
        engine = self.engine
        return engine.has_unfinished or any(self._unclaimed(rid) for rid in engine.dirty)

    def stats(self) -> dict:
        return self.engine.stats()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix: later requests compute their K/V anew. The engine notices by itself when the
        model's parameters, buffers or PEFT adapters change (see `hf_paged.model.fingerprint`); call this after
        changes it cannot see (writes through `.data`, patched code). Packed copies of bf16 weights
        (`hf_paged.model.packed_linear`) are dropped too."""
        self.engine.reset_prefix_cache()

    def sleep(self) -> None:
        """Give the KV cache's memory back while no request runs (e.g. between RL rollouts, so training gets the
        device's memory); the next `generate` / `step` takes it again (or `wake_up`). Forgets cached prefixes."""
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()

    # streaming ------------------------------------------------------------------------------------
    def stream(self, prompts: str | Sequence, sampling_params: SamplingParams | dict | Sequence | None = None,
               *, priority: Sequence[int] | None = None) -> Iterator[RequestOutput]:
        """Yield a snapshot of every prompt of this call that changed, after each engine step: cumulative
        `outputs[i].token_ids` and `text` (the text so far), `finished` on a prompt's last snapshot. Validation as in
        `generate` (a bad prompt raises before anything is queued, at the first `next`). Closing the iterator, or
        an exception, aborts this call's unfinished requests and frees their blocks at once. Not data parallel."""
        parents, unfinished = self._queue_claimed(prompts, sampling_params, priority)
        try:
            while unfinished:
                outs = self._collect(unfinished.__contains__, _snapshot)
                for out in outs:
                    if out.finished:
                        unfinished.discard(out.request_id)
                    yield out
                unfinished.intersection_update(self.engine.parents)  # aborted meanwhile (`abort`): nothing to wait for
                if unfinished and not outs:
                    self._advance(unfinished)
        finally:
            for request_id in unfinished:
                self.engine.abort(request_id)
            self._claimed.difference_update(parent.request_id for parent in parents)

    def _queue_claimed(self, prompts, sampling_params, priority) -> tuple[list[ParentRequest], set[str]]:
        """Queue a call's prompts and claim them at once (no `step` caller in another thread sees them unclaimed)."""
        with self.engine.lock:
            parents = self._add(self._validated(prompts, sampling_params, priority)[0])
            return parents, self._claim(parents)

    def _claim(self, parents: list[ParentRequest]) -> set[str]:
        """Mark a call's requests as its own (no `step` caller gets them). Returns their ids."""
        ids = {parent.request_id for parent in parents}
        self._claimed.update(ids)
        return set(ids)

    def _advance(self, waiting: set[str] = frozenset()) -> None:
        """One engine step if the engine has work. With none, the results of `waiting` (a call's requests still
        unfinished) must already be marked (another caller stepped), else something is broken: say so instead of
        spinning."""
        with self.engine.lock:
            if self.engine.has_unfinished:
                self.engine.step()
            elif not any(rid in self.engine.dirty for rid in waiting) and \
                    any(not self.engine.parents[rid].is_finished for rid in waiting if rid in self.engine.parents):
                raise RuntimeError(f"hf_paged: requests {sorted(waiting)[:5]} are unfinished but the engine has no "
                                   f"work for them")

    async def astream(self, prompts: str | Sequence,
                      sampling_params: SamplingParams | dict | Sequence | None = None,
                      *, priority: Sequence[int] | None = None) -> AsyncIterator[RequestOutput]:
        """`stream` for asyncio servers: `async for out in llm.astream(prompts, params)`. Engine steps run in a worker
        thread, driven by one task per LLM that serves every concurrent `astream` of the event loop, each getting
        only its own prompts' snapshots. Closing or cancelling the iterator aborts its unfinished requests and frees
        their blocks at once (after the step in flight, if any). Other callers (`generate`, `stream`, `step`, other
        threads) may use the LLM meanwhile: each gets only its own requests' results."""
        parents, unfinished = self._queue_claimed(prompts, sampling_params, priority)
        driver = self._async_driver()
        queue: asyncio.Queue = asyncio.Queue()
        for request_id in unfinished:
            driver.queues[request_id] = queue
        driver.start(self)
        try:
            while unfinished:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                if isinstance(out, _Gone):  # aborted meanwhile (`abort`): nothing to wait for
                    unfinished.discard(out.request_id)
                    continue
                if out.finished:
                    unfinished.discard(out.request_id)
                yield out
        finally:
            for parent in parents:
                driver.queues.pop(parent.request_id, None)
            for request_id in unfinished:
                self.engine.abort(request_id)
            self._claimed.difference_update(parent.request_id for parent in parents)

    def _async_driver(self) -> "_AsyncDriver":
        loop = asyncio.get_running_loop()
        if self._driver is None or not self._driver.is_running():
            self._driver = _AsyncDriver(loop)
        elif self._driver.loop is not loop:
            raise RuntimeError("astream: this LLM is already streaming on another event loop")
        return self._driver

    def _step_snapshots(self, owned) -> list[RequestOutput]:
        """One engine step (if there is work), then a snapshot of every prompt `owned(request_id)` says is the
        caller's that changed since it was last collected (finished ones are forgotten)."""
        self._advance()
        return self._collect(owned, _snapshot)

    # offline batch ---------------------------------------------------------------------------------
    def generate(self, prompts: str | Sequence, sampling_params: SamplingParams | dict | Sequence | None = None,
                 *, use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Outputs in input order. Every prompt and its parameters are validated before any work starts: a bad one
        raises ValueError (InputTypeError, also a TypeError, for a wrong type) naming it ("request 2: ...") and nothing
        is queued. `sampling_params`: None, one SamplingParams (or dict of its fields) for all, or one per prompt.
        In a multi-process run, the same prompts on every process are split and gathered; different prompts are each
        process's own (see the class)."""
        batch, world = split_world(self.world, lambda: self._validated(prompts, sampling_params, priority))
        with self.engine.lock:  # queued and claimed at once: no `step` caller in another thread sees them unclaimed
            parents = self._add(batch, world)
            self._claim(parents)
        try:
            finished = self._run(parents, use_tqdm and self.world.rank == 0)
        except BaseException:
            for parent in parents:  # an exception (or Ctrl-C) leaves none of this call's requests behind
                self.engine.abort(parent.request_id)
            raise
        finally:
            self._claimed.difference_update(parent.request_id for parent in parents)
        mine = [(parent.index, finished[parent.request_id]) for parent in parents]
        return gather_in_order(world, mine, len(batch.prompts)) if world.is_parallel else [out for _, out in mine]

    def chat(self, messages: Sequence, sampling_params: SamplingParams | dict | Sequence | None = None, *,
             use_tqdm: bool = True, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """`generate` for chat conversations (vLLM's `LLM.chat`): `messages` is one conversation (a list of
        {"role", "content"} dicts) or a list of them; each is rendered with the tokenizer's chat template (or
        `chat_template`), then generated as `generate` does. One output per conversation, in input order."""
        prompts = chat_prompts(self.engine.tokenizer, as_conversations(messages), chat_template,
                               add_generation_prompt, continue_final_message, tools, chat_template_kwargs)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _validated(self, prompts, sampling_params, priority) -> tuple["_Batch", tuple]:
        """One call's prompts, every one validated (ValueError / InputTypeError naming the first bad one), and what
        identifies them for `split_world` (token ids, texts, parameters, priorities)."""
        prompts = as_prompt_list(prompts)
        params_list = as_params_list(sampling_params, len(prompts))
        priorities = as_priorities(priority, len(prompts))
        engine = self.engine
        has_tokenizer = engine.tokenizer is not None
        tokenized = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            tokenized.append(engine.tokenize(prompt, i))
            check_request(engine.limits, i, tokenized[-1], params, has_tokenizer=has_tokenizer)
        batch = _Batch(prompts, params_list, priorities, tokenized)
        return batch, (len(prompts), tokenized, [prompt_text(p) for p in prompts], params_list, priorities)

    def _add(self, batch: "_Batch", world: World | None = None) -> list[ParentRequest]:
        """Queue a validated call (in a multi-process `world`, only this process's share, with the ids a single
        process would give them). On any error nothing of this call stays queued. Returns the queued parents."""
        engine = self.engine
        parallel = world is not None and world.is_parallel
        count = len(batch.prompts)
        ids = engine.new_request_ids(count) if parallel else [None] * count
        parents: list[ParentRequest] = []
        try:
            for i, (token_ids, params) in enumerate(zip(batch.token_ids, batch.params)):
                if not parallel or world.owns(i):
                    parents.append(engine.add_request(token_ids, params, index=i, request_id=ids[i],
                                                     prompt_text=prompt_text(batch.prompts[i]),
                                                     priority=batch.priorities[i], checked=True))
        except BaseException:
            for parent in parents:
                engine.abort(parent.request_id)
            raise
        return parents

    def _run(self, parents: list[ParentRequest], use_tqdm: bool) -> dict[str, RequestOutput]:
        """Step until every one of `parents` has finished (other callers' requests progress too, and go to them).
        Returns each parent's final output by request id."""
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(parents), desc="Processed prompts", unit="req", dynamic_ncols=True)
        pending = {parent.request_id for parent in parents}
        finished: dict[str, RequestOutput] = {}
        start = time.perf_counter()
        prompt_tokens = output_tokens = 0
        seen = -1
        while pending:
            marks = self.engine.finish_marks
            outs = self._collect(pending.__contains__, _final) if marks != seen else []
            seen = marks
            for out in outs:
                pending.discard(out.request_id)
                finished[out.request_id] = out
                if bar is not None:
                    prompt_tokens += len(out.prompt_token_ids)
                    output_tokens += sum(len(c.token_ids) for c in out.outputs)
                    elapsed = max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(f"est. input {prompt_tokens / elapsed:.0f} tok/s, "
                                        f"output {output_tokens / elapsed:.0f} tok/s", refresh=False)
                    bar.update(1)
            missing = pending.difference(self.engine.parents)
            if missing:  # aborted by another caller: nothing will come
                raise RuntimeError(f"requests {sorted(missing)[:5]} of this generate call were aborted meanwhile")
            if pending and not outs:
                self._advance(pending)
        if bar is not None:
            bar.close()
        return finished


def _per_sample(engine: Engine, parent: ParentRequest, samples: frozenset[int]) -> list[RequestOutput]:
    """`step`'s outputs: one per changed sample."""
    return [engine.output(parent, [parent.samples[i]]) for i in sorted(samples)]


def _snapshot(engine: Engine, parent: ParentRequest, samples: frozenset[int]) -> list[RequestOutput]:
    """`stream`'s outputs: one snapshot of the whole prompt (text so far)."""
    return [engine.output(parent, partial=True)]


def _final(engine: Engine, parent: ParentRequest, samples: frozenset[int]) -> list[RequestOutput]:
    """`generate`'s outputs: the prompt's output once all its samples have finished."""
    return [engine.output(parent)] if parent.is_finished else []


@dataclass(slots=True, eq=False)
class _AsyncDriver:
    """Steps one LLM's engine for every `astream` consumer of one event loop, routing each snapshot to the queue of
    the consumer whose prompt it is. Invariant: `task` runs while some consumer is registered in `queues` and the
    engine has work; an error in a step reaches every registered consumer."""

    loop: asyncio.AbstractEventLoop
    queues: dict[str, asyncio.Queue] = field(default_factory=dict)  # request id -> its consumer's queue
    task: asyncio.Task | None = None

    def is_running(self) -> bool:
        return not self.loop.is_closed() and self.task is not None and not self.task.done()

    def start(self, llm: LLM) -> None:
        if self.task is None or self.task.done():
            self.task = self.loop.create_task(self._drive(llm))

    async def _drive(self, llm: LLM) -> None:
        while True:
            self._tell_gone(llm)
            engine = llm.engine
            if not (self.queues and (engine.has_unfinished or any(rid in self.queues for rid in engine.dirty))):
                return
            try:
                outs = await self.loop.run_in_executor(None, llm._step_snapshots, self.queues.__contains__)
            except Exception as e:  # noqa: BLE001 - handed to every consumer, which raises it
                for queue in set(self.queues.values()):
                    queue.put_nowait(e)
                return
            for out in outs:
                queue = self.queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)

    def _tell_gone(self, llm: LLM) -> None:
        """Consumers of requests that left the engine without a final snapshot (aborted through `LLM.abort`; finished
        ones had theirs routed first) are told so instead of waiting forever."""
        for request_id in [r for r in self.queues if r not in llm.engine.parents]:
            self.queues.pop(request_id).put_nowait(_Gone(request_id))


@dataclass(slots=True, frozen=True)
class _Batch:
    """One call's validated prompts: as given, their parameters, priorities and token ids (one of each per prompt)."""

    prompts: list
    params: list[SamplingParams]
    priorities: list[int]
    token_ids: list[list[int]]


@dataclass(slots=True, frozen=True)
class _Gone:
    """Queued to an `astream` consumer for a request aborted elsewhere."""

    request_id: str
