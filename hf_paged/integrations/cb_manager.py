"""transformers' continuous-batching API on hf_paged's engine.

`model.init_continuous_batching(...)` (and through it `continuous_batching_context_manager` and `generate_batch`, which
TRL's `use_transformers_continuous_batching` and `transformers serve --continuous-batching` call) returns a
`PagedBatchingManager` while hf_paged is enabled: the public API of transformers' `ContinuousBatchingManager`
(`start` / `stop` / `join` / `destroy` / `is_running` / `warmup` / `pause`, `add_request(s)`, `cancel_request`,
`get_result`, iteration, `request_id_iter`, `register_result_handler`) producing transformers' own `GenerationOutput`
objects, served by an `hf_paged.LLM` stepped in a background thread.

Invariants: only the background thread touches the engine while it runs (requests and cancellations reach it through
queues, taken between steps); every request added gets exactly one finished output (FINISHED, or FAILED with its
error: a request the engine refuses, a step that raised) unless it is cancelled, which (as in transformers) delivers
nothing more; with `num_return_sequences` n a request's samples are reported under transformers' names (sample 0
as the request id, sample i as `{request_id}__child#{i-1}`).

What transformers' manager would run differently is left to it (`reason_to_decline`): logits processors hf_paged's
sampler does not have, beam search, tensor parallel models. Log-probs are the model's (log-softmax of the raw
logits, as vLLM reports them); transformers reports them after its logits processors: the same for greedy runs.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
import weakref
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, Callable

import torch

from ..config import logger
from .cb_params import REQUEST_KEYWORD_TYPES, engine_options, reason_to_decline, sampling_params

CACHE_ATTRIBUTE = "_cached_continuous_batching_manager"  # where transformers keeps a persistent manager
_LIVE: weakref.WeakSet = weakref.WeakSet()  # the managers of this process (`live_managers`)


def live_managers() -> list["PagedBatchingManager"]:
    """This process' managers still alive, oldest first (what `hf-paged serve`'s stats endpoint reads)."""
    return sorted(_LIVE, key=lambda manager: manager._born)


class PagedBatchingManager:
    """transformers' ContinuousBatchingManager API over an hf_paged engine (see the module docstring)."""

    def __init__(self, model, generation_config, continuous_batching_config=None, workload_hints=None):
        from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

        self._output_class, self._status = GenerationOutput, RequestStatus
        self.model = model.eval()  # as transformers' manager does
        self.generation_config = generation_config
        self.continuous_batching_config = continuous_batching_config
        self.num_return_sequences = getattr(generation_config, "num_return_sequences", None) or 1
        self._options = engine_options(continuous_batching_config, workload_hints)
        self._base_params = sampling_params(generation_config, model)
        self.llm = None  # made by warmup / start (the engine's start-up check runs then)
        self.warmed_up = False
        self.output_queue: queue.Queue = queue.Queue()
        self.result_handlers: dict[str, tuple[Callable, Any]] = {}
        self._handlers_lock = threading.Lock()
        self._inputs: queue.Queue = queue.Queue()
        self._cancels: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._stop_mode: str | None = None  # None, "flush" or "hard"
        self._paused = threading.Event()
        self._at_rest = threading.Event()  # set by the loop while it is paused (between steps)
        self._pausers = 0
        self._holders: dict[int, int] = {}  # thread id -> the pauses it holds (stop() inside one would never end)
        self._pause_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._counter = 0
        self._counter_lock = threading.Lock()
        self._live: dict[str, dict] = {}  # engine request id -> what its outputs need (background thread only)
        # what transformers' serving code reads from its manager: the per-request keywords and their types, the
        # status holding a fatal error, and its batch processor (None: the server then reports no KV usage)
        self.logit_processor = SimpleNamespace(supported_keys=dict(REQUEST_KEYWORD_TYPES), do_processing=True,
                                               clear=self._clear_processors)
        self.background_thread_status = SimpleNamespace(fatal_error=None)
        self.batch_processor = None
        # and what its tests and clients of its 5.25 layout read: the output queue behind `output_router`, the count
        # of steps run (`current_batch`)
        self.output_router = SimpleNamespace(output_queue=self.output_queue, result_handlers=self.result_handlers,
                                             _lock=self._handlers_lock)
        self.current_batch = 0
        self._plain = False  # logit_processor.clear() was called: no processor of the generation config applies
        self._born = time.monotonic()
        _LIVE.add(self)

    @property
    def fatal_error(self) -> BaseException | None:
        return self.background_thread_status.fatal_error

    @fatal_error.setter
    def fatal_error(self, error: BaseException | None) -> None:
        self.background_thread_status.fatal_error = error

    def _clear_processors(self) -> None:
        """`logit_processor.clear()`: as in transformers, the generation config's processors (temperature, top-k / p,
        min-p, repetition penalty, min length) no longer apply to the requests the loop takes from now on."""
        self._plain, self.logit_processor.do_processing = True, False
        self._base_params = sampling_params(self.generation_config, self.model, plain=True)

    # ---- control ---------------------------------------------------------------------------------------------
    def _ensure_llm(self):
        if self.llm is None:
            from ..llm import LLM

            options = {k: v for k, v in self._options.items() if k != "hinted"}
            try:
                self.llm = LLM(self.model, data_parallel=False, **options)
            except ValueError:  # e.g. a pool sized from the workload that memory cannot hold: the engine's default
                if "hinted" not in self._options:
                    raise
                del options["num_blocks"]
                self.llm = LLM(self.model, data_parallel=False, **options)
        return self.llm

    def warmup(self) -> None:
        """Start the engine (its start-up check runs here rather than on the first request)."""
        self._ensure_llm()
        self.warmed_up = True

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self.is_running():
            logger.warning("hf_paged: the continuous-batching manager is already running")
            return
        self._ensure_llm()
        # the generation config as it is now (transformers reads do_sample when its loop starts, not when made)
        self._base_params = sampling_params(self.generation_config, self.model, plain=self._plain)
        self._stop_mode, self.fatal_error = None, None
        inference = torch.is_inference_mode_enabled()
        self._thread = threading.Thread(target=self._run, args=(inference,), name="hf_paged-cb", daemon=True)
        self._thread.start()

    def stop(self, block: bool = True, timeout: float | None = None, keep_for_next_session: bool = False,
             hard_stop: bool = False) -> None:
        """Stop the loop: after finishing what was added (or at once, failing it, with `hard_stop`). With
        `keep_for_next_session` the manager (and its engine, with its prefix cache) is kept on the model and
        `init_continuous_batching` returns it next time. Raises RuntimeError from inside a pause of this thread."""
        if self._holders.get(threading.get_ident()):
            raise RuntimeError("stop() called from inside a pause: the loop cannot finish while this thread holds it "
                               "paused; leave the pause first")
        if self._thread is None:
            logger.warning("hf_paged: the continuous-batching manager was not started")
            return
        self._stop_mode = "hard" if hard_stop else "flush"
        self._wake.set()
        if block:
            self.join(timeout=timeout)
        if keep_for_next_session:
            self.model.__dict__[CACHE_ATTRIBUTE] = self
        elif self.model.__dict__.get(CACHE_ATTRIBUTE) is self:
            del self.model.__dict__[CACHE_ATTRIBUTE]

    def join(self, stop_trigger_time: float | None = None, timeout: float | None = None) -> None:
        if self._thread is None:
            return
        self._thread.join(timeout=timeout)
        if self._thread.is_alive():
            logger.warning("hf_paged: the continuous-batching thread did not stop within %s s", timeout)
        else:
            self._thread = None

    def destroy(self) -> None:
        if self.is_running():
            self.stop(block=True)
        self.llm = None

    @contextmanager
    def pause(self):
        """The loop stops between steps while inside (e.g. to change the weights); requests stay queued / running."""
        if not self.is_running():
            raise RuntimeError("Cannot pause generation while no generation loop is running.")
        me = threading.get_ident()
        with self._pause_lock:
            self._pausers += 1
            self._holders[me] = self._holders.get(me, 0) + 1
            self._paused.set()
            self._at_rest.clear()
        self._wake.set()
        try:
            while not self._at_rest.wait(0.05):  # entered only between steps
                if not self.is_running():  # the loop ended (stopped, or died: its error is the cause)
                    raise RuntimeError("the continuous-batching loop ended before it paused") from self.fatal_error
            yield
        finally:
            with self._pause_lock:
                self._pausers -= 1
                self._holders[me] -= 1
                if not self._holders[me]:
                    del self._holders[me]
                if not self._pausers:
                    self._paused.clear()
            self._wake.set()

    # ---- requests --------------------------------------------------------------------------------------------
    def _new_id(self) -> str:
        with self._counter_lock:
            self._counter += 1
            return f"req_{self._counter - 1}"

    def add_request(self, input_ids: list[int], request_id: str | None = None, max_new_tokens: int | None = None,
                    streaming: bool = False, record_timestamps: bool = False, eos_token_id=None,
                    **logit_processor_kwargs) -> str | None:
        if self._stop_mode is not None:
            logger.warning("hf_paged: the continuous-batching manager is stopping; request dropped")
            return None
        request_id = self._new_id() if request_id is None else str(request_id)
        self._inputs.put((request_id, list(input_ids), max_new_tokens, streaming, record_timestamps, eos_token_id,
                          logit_processor_kwargs, time.perf_counter()))
        self._wake.set()
        return request_id

    def add_requests(self, inputs: list[list[int]], max_new_tokens: int | None = None, streaming: bool = False,
                     record_timestamps: bool = False, **logit_processor_kwargs) -> list[str]:
        eos = self.generation_config.eos_token_id
        eos = self.model.config.eos_token_id if eos is None else eos
        return [self.add_request(ids, None, max_new_tokens, streaming, record_timestamps,
                                 -1 if eos is None else eos, **logit_processor_kwargs) for ids in inputs]

    def cancel_request(self, request_id: str) -> None:
        self._cancels.put(str(request_id))
        self._wake.set()

    # ---- results ---------------------------------------------------------------------------------------------
    def get_result(self, request_id: str | None = None, timeout: float | None = None):
        if self.output_queue.empty() and (self._thread is None or self.fatal_error is not None):
            return None
        try:
            result = self.output_queue.get(block=True, timeout=timeout)
        except queue.Empty:
            return None
        if request_id is not None and result.request_id != request_id:
            self.output_queue.put(result)
            return None
        return result

    def __iter__(self):
        while self.is_running() or not self.output_queue.empty():
            result = self.get_result(timeout=0.1)
            if result is not None:
                yield result

    def request_id_iter(self, request_id: str):
        while self.is_running() or not self.output_queue.empty():
            result = self.get_result(request_id=request_id, timeout=0.1)
            if result is not None:
                yield result
                if result.is_finished():
                    return

    def register_result_handler(self, request_id: str, callback: Callable) -> None:
        """`callback(output)` on the running event loop for each output of `request_id` (dropped once finished)."""
        loop = asyncio.get_running_loop()
        with self._handlers_lock:
            self.result_handlers[str(request_id)] = (callback, loop)

    def _deliver(self, output) -> None:
        with self._handlers_lock:
            handler = self.result_handlers.get(output.request_id)
            if handler is not None and output.is_finished():
                self.result_handlers.pop(output.request_id, None)
        if handler is None:
            self.output_queue.put(output)
            return
        callback, loop = handler
        if not loop.is_closed():
            loop.call_soon_threadsafe(callback, output)

    # ---- the background thread -------------------------------------------------------------------------------
    def _run(self, inference: bool) -> None:
        context = torch.inference_mode() if inference else torch.no_grad()
        with context:
            try:
                self._loop()
            except BaseException as e:  # noqa: BLE001 - every open request hears of it, then it propagates
                self.fatal_error = e
                self._fail_all(f"{type(e).__name__}: {e}")
                if not isinstance(e, Exception):
                    raise
                logger.error("hf_paged: continuous-batching loop failed: %s", e, exc_info=e)

    def _loop(self) -> None:
        from .cb_outputs import OutputBuilder

        builder = OutputBuilder(self)
        llm = self.llm
        while True:
            if self._paused.is_set():
                self._at_rest.set()
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            self._take_inputs(builder)
            if self._stop_mode == "hard":
                self._fail_all("the continuous-batching manager was stopped (hard_stop)")
                return
            if not llm.has_unfinished_requests():
                if self._stop_mode == "flush" and self._inputs.empty():
                    return
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outs = llm.step()
            except Exception as e:  # noqa: BLE001 - the step changed nothing; its requests end with the error
                self._fail_all(f"{type(e).__name__}: {e}")
                continue
            self.current_batch += 1
            for out in outs:
                builder.emit(out)

    def _take_inputs(self, builder) -> None:
        """New requests, then cancellations (a request cancelled right after it was added is found)."""
        while True:
            try:
                item = self._inputs.get_nowait()
            except queue.Empty:
                break
            builder.add(*item)
        while True:
            try:
                request_id = self._cancels.get_nowait()
            except queue.Empty:
                break
            builder.cancel(request_id)

    def _fail_all(self, message: str) -> None:
        """Every open request ends FAILED with `message` (its engine request aborted)."""
        for request_id in list(self._live):
            info = self._live.pop(request_id)
            if self.llm is not None:
                self.llm.abort(request_id)
            for name in info["names"]:
                self._deliver(self._output_class(request_id=name, prompt_ids=info["prompt"], error=message,
                                                 status=self._status.FAILED, created_time=info["created"]))
        while True:  # and those not yet taken by the loop
            try:
                request_id, prompt, *_rest, created = self._inputs.get_nowait()
            except queue.Empty:
                break
            for name in _names(request_id, self.num_return_sequences):
                self._deliver(self._output_class(request_id=name, prompt_ids=prompt, error=message,
                                                 status=self._status.FAILED, created_time=created))


def _names(request_id: str, n: int) -> list[str]:
    """transformers' names of a request's n samples (sample 0 is the request itself)."""
    return [request_id] + [f"{request_id}__child#{i}" for i in range(n - 1)]


def paged_init_continuous_batching(original: Callable, model, generation_config=None,
                                   continuous_batching_config=None, workload_hints=None):
    """`init_continuous_batching` while hf_paged is enabled: a kept manager if there is one, else a
    `PagedBatchingManager` unless transformers' own manager must run this (then it does, with a log line why)."""
    cached = model.__dict__.get(CACHE_ATTRIBUTE)
    if isinstance(cached, PagedBatchingManager):
        return cached
    config = generation_config if generation_config is not None else model.generation_config
    if config is None:
        raise ValueError("A GenerationConfig must be provided or set in the model.")
    if continuous_batching_config is None:
        continuous_batching_config = getattr(config, "continuous_batching_config", None)
    reason = reason_to_decline(model, config, continuous_batching_config)
    if reason is not None:
        logger.warning("hf_paged: transformers' own continuous batching runs this (%s)", reason)
        return original(model, generation_config, continuous_batching_config, workload_hints)
    return PagedBatchingManager(model, config, continuous_batching_config, workload_hints)


def paged_destroy_cached(original: Callable, model) -> None:
    cached = model.__dict__.get(CACHE_ATTRIBUTE)
    if isinstance(cached, PagedBatchingManager):
        cached.destroy()
        del model.__dict__[CACHE_ATTRIBUTE]
        return
    original(model)


