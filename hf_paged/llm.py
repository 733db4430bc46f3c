"""`LLM`: the offline batch API (vLLM-style) on top of the engine, streaming (`stream`, `astream`) and data parallel
`generate` under `torchrun` / `accelerate launch`."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator, Sequence

import torch

from .distributed import World, gather_in_order, plan_processes
from .engine import Engine
from .engine.intake import (as_params, as_params_list, as_priorities, as_priority, as_prompt_list, check_request,
                            prompt_text)
from .request import RequestGroup, RequestOutput
from .sampling import SamplingParams


class LLM:
    """Generate for many prompts at once with continuous batching over a paged KV cache.

    `LLM(model, tokenizer=tok, block_size=16, max_num_seqs=128)` takes the same keys as
    `generate(..., cache_config={...})` (see `EngineConfig`).

    Under `torchrun` / `accelerate launch` (torch.distributed initialized, or WORLD_SIZE > 1) `generate` is data
    parallel: every process serves every world_size-th prompt and every process returns all outputs, in input order;
    without a pool size each process of a host takes its share of the default KV budget. `data_parallel=False` makes
    each process run every prompt it is given. A model loaded with transformers' `tp_plan="auto"` is tensor parallel
    instead: every process runs every prompt on its share of the model, in lockstep (see `hf_paged.distributed`).
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, *, data_parallel: bool = True, **options):
        device = next(model.parameters()).device
        self.world, options = plan_processes(model, options, device, data_parallel)
        self.engine = Engine(model, tokenizer, **options)
        self._driver: _AsyncDriver | None = None  # steps the engine for `astream` consumers (one event loop)

    # streaming-style access -----------------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams | dict | None = None, *, request_id: str | None = None,
                    priority: int = 0) -> str:
        """Queue one prompt; returns its request id. Invalid input raises ValueError (InputTypeError for a wrong type)
        before anything is queued. `params` may also be a dict of SamplingParams fields."""
        engine = self.engine
        params = as_params(params, 0)
        priority = as_priority(priority, 0)
        token_ids = engine.tokenize(prompt, 0)
        check_request(engine.limits, 0, token_ids, params, has_tokenizer=engine.tokenizer is not None)
        return engine.add_request(token_ids, params, request_id=request_id, priority=priority,
                                  prompt_text=prompt_text(prompt)).request_id

    def step(self) -> list[RequestOutput]:
        """One engine step; an output for every sample that received a token or finished (with `n` > 1, one per
        sample: `outputs[0].index` says which). A prompt whose samples have all finished is forgotten."""
        outputs = []
        for request in self.engine.step():
            outputs.append(self.engine.output(request.group, [request]))
            if request.group.is_finished:
                self.engine.release(request.group)
        return outputs

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished

    def stats(self) -> dict:
        return self.engine.stats()

    # streaming ------------------------------------------------------------------------------------
    def stream(self, prompts: str | Sequence, sampling_params: SamplingParams | dict | Sequence | None = None,
               *, priority: Sequence[int] | None = None) -> Iterator[RequestOutput]:
        """Yield a snapshot of every prompt of this call that changed, after each engine step: cumulative
        `outputs[i].token_ids` and `text` (the text so far), `finished` on a prompt's last snapshot. Validation as in
        `generate` (a bad prompt raises before anything is queued, at the first `next`). Closing the iterator, or
        an exception, aborts this call's unfinished requests and frees their blocks at once. Not data parallel."""
        groups, _ = self._queue(prompts, sampling_params, priority)
        unfinished = {group.request_id for group in groups}
        try:
            while unfinished:
                for out in self._step_snapshots(unfinished.__contains__):
                    if out.finished:
                        unfinished.discard(out.request_id)
                    yield out
                unfinished.intersection_update(self.engine.groups)  # aborted meanwhile (`abort`): nothing to wait for
        finally:
            for request_id in unfinished:
                self.engine.abort(request_id)

    async def astream(self, prompts: str | Sequence,
                      sampling_params: SamplingParams | dict | Sequence | None = None,
                      *, priority: Sequence[int] | None = None) -> AsyncIterator[RequestOutput]:
        """`stream` for asyncio servers: `async for out in llm.astream(prompts, params)`. Engine steps run in a worker
        thread, driven by one task per LLM that serves every concurrent `astream` of the event loop, each getting
        only its own prompts' snapshots. Closing or cancelling the iterator aborts its unfinished requests and frees
        their blocks at once (after the step in flight, if any). While it streams, nothing else may step this LLM
        (`generate`, `stream`, `step` from another thread); `add_request` / `abort` may be called."""
        groups, _ = self._queue(prompts, sampling_params, priority)
        driver = self._async_driver()
        queue: asyncio.Queue = asyncio.Queue()
        unfinished = {group.request_id for group in groups}
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
            for group in groups:
                driver.queues.pop(group.request_id, None)
            for request_id in unfinished:
                self.engine.abort(request_id)

    def _async_driver(self) -> "_AsyncDriver":
        loop = asyncio.get_running_loop()
        if self._driver is None or not self._driver.is_running():
            self._driver = _AsyncDriver(loop)
        elif self._driver.loop is not loop:
            raise RuntimeError("astream: this LLM is already streaming on another event loop")
        return self._driver

    def _step_snapshots(self, owned) -> list[RequestOutput]:
        """One engine step; a snapshot of every prompt that changed and `owned(request_id)` says is the caller's
        (finished ones are released). Other prompts' tokens stay in the engine for their own consumers."""
        with self.engine.lock:
            stepped = self.engine.step()
            groups = list({id(r.group): r.group for r in stepped if owned(r.group.request_id)}.values())
            outs = [self.engine.output(group, partial=True) for group in groups]
            for group in groups:
                if group.is_finished:
                    self.engine.release(group)
        return outs

    # offline batch ---------------------------------------------------------------------------------
    def generate(self, prompts: str | Sequence, sampling_params: SamplingParams | dict | Sequence | None = None,
                 *, use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Outputs in input order. Every prompt and its parameters are validated before any work starts: a bad one
        raises ValueError (InputTypeError, also a TypeError, for a wrong type) naming it ("request 2: ...") and nothing
        is queued. `sampling_params`: None, one SamplingParams (or dict of its fields) for all, or one per prompt.
        In a multi-process run this process runs its share and the outputs of all are gathered (see the class)."""
        world = self.world
        groups, count = self._queue(prompts, sampling_params, priority, world)
        try:
            self._run(groups, use_tqdm and world.rank == 0)
        except BaseException:
            for group in groups:  # an exception (or Ctrl-C) leaves none of this call's requests behind
                self.engine.abort(group.request_id)
            raise
        mine = [(group.index, self.engine.output(group)) for group in groups]
        for group in groups:
            self.engine.release(group)
        return gather_in_order(world, mine, count) if world.is_parallel else [out for _, out in mine]

    def _queue(self, prompts, sampling_params, priority, world: World | None = None) -> tuple[list[RequestGroup], int]:
        """Validate every prompt, then queue them (in a multi-process `world`, only this process's share, with the
        ids a single process would give them). On any error nothing of this call stays queued.
        Returns the queued groups and the number of prompts."""
        prompts = as_prompt_list(prompts)
        params_list = as_params_list(sampling_params, len(prompts))
        priorities = as_priorities(priority, len(prompts))
        engine = self.engine
        has_tokenizer = engine.tokenizer is not None
        tokenized = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            tokenized.append(engine.tokenize(prompt, i))
            check_request(engine.limits, i, tokenized[-1], params, has_tokenizer=has_tokenizer)
        parallel = world is not None and world.is_parallel
        ids = engine.new_request_ids(len(prompts)) if parallel else [None] * len(prompts)
        groups: list[RequestGroup] = []
        try:
            for i, (token_ids, params) in enumerate(zip(tokenized, params_list)):
                if not parallel or world.owns(i):
                    groups.append(engine.add_request(token_ids, params, index=i, prompt_text=prompt_text(prompts[i]),
                                                     priority=priorities[i], request_id=ids[i]))
        except BaseException:
            for group in groups:
                engine.abort(group.request_id)
            raise
        return groups, len(prompts)

    def _run(self, groups: list[RequestGroup], use_tqdm: bool) -> None:
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(groups), desc="Processed prompts", unit="req", dynamic_ncols=True)
        counted: set[int] = set()
        start = time.perf_counter()
        prompt_tokens = output_tokens = 0
        while self.engine.has_unfinished:
            stepped = self.engine.step()
            if bar is None:
                continue
            for request in stepped:
                group = request.group
                if id(group) not in counted and group.is_finished:
                    counted.add(id(group))
                    prompt_tokens += len(group.prompt_token_ids)
                    output_tokens += sum(r.num_output_tokens for r in group.samples)
                    elapsed = max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(f"est. input {prompt_tokens / elapsed:.0f} tok/s, "
                                        f"output {output_tokens / elapsed:.0f} tok/s", refresh=False)
                    bar.update(1)
        if bar is not None:
            bar.close()


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
            if not (self.queues and llm.engine.has_unfinished):
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
        for request_id in [r for r in self.queues if r not in llm.engine.groups]:
            self.queues.pop(request_id).put_nowait(_Gone(request_id))


@dataclass(slots=True, frozen=True)
class _Gone:
    """Queued to an `astream` consumer for a request aborted elsewhere."""

    request_id: str
