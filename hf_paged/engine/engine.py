"""The continuous-batching engine: add requests, step, abort, stats."""
from __future__ import annotations

import itertools
import threading
from typing import Any, Sequence

import torch

from ..attention import choose_backends
from ..attention.dispatch import unavailable
from ..config import EngineConfig, logger
from ..kv import KVCacheManager
from ..kv.groups import plan_groups
from ..kv.state import StateCheckpoints, StateSlots
from ..model import ModelSpec, check_paged_matches_model, describe_model
from ..model.fingerprint import weights_fingerprint
from ..model.kv_calibration import fp8_kv_scales
from ..request import Request, ParentRequest, RequestOutput
from ..sampling import Sampler, SamplingParams
from .cuda_graphs import DecodeGraphSettings
from .host_allocator import tune_host_allocator
from .intake import Limits, check_model_len, check_request, tokenize
from .memory import KVMemory
from .outputs import parent_output
from .plan import PreemptionCosts
from .runner import HeadOutputChanged, ModelRunner
from .scheduler import Scheduler


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def _state_checkpoints(config: EngineConfig, device) -> StateCheckpoints | None:
    """Where a model with state layers keeps states for prefix hits (None: no hits; see EngineConfig)."""
    count = 2 * config.max_num_seqs if config.state_checkpoints is None else config.state_checkpoints
    if not count or not config.enable_prefix_caching:
        return None
    return StateCheckpoints(device, count, config.state_checkpoint_interval)


class Engine:
    """Serves many requests at once on one model.

    `add_request` validates up front (ValueError naming the request) and queues; `step` runs one forward pass for
    every scheduled request: schedule, move blocks, run, update. The scheduler owns every request's state; the
    engine only wires the pieces and turns requests into outputs. A request that fails while running
    (non-finite logits, a sampling hook that raises) ends alone with finish_reason="error".
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, config: EngineConfig | None = None,
                 *, spec: ModelSpec | None = None, **options):
        """`spec`: `describe_model(model)` as the caller just made it (the generate take-over describes the model
        before it decides to build an engine); None: described here."""
        if config is not None and options:
            raise ValueError("pass either an EngineConfig or keyword options, not both")
        self.config = config or EngineConfig.from_dict(options)
        self.config.validate()
        self.model = model
        self.tokenizer = tokenizer
        self.spec = spec if spec is not None else describe_model(model)
        device = self.spec.kv.device
        self.host_allocator = tune_host_allocator() if device.type == "cpu" else "not used (GPU)"
        reason = unavailable(self.config.attention_backend, device)
        if reason is not None:
            raise ValueError(f"attention_backend {self.config.attention_backend!r} cannot run on {device}: {reason}")
        if self.config.kv_cache_dtype == "fp8_e4m3":
            if self.spec.has_state:
                raise ValueError("kv_cache_dtype='fp8_e4m3' is not supported on models with state layers yet")
            self.spec.kv.dtype = torch.float8_e4m3fn
        check_model_len(self.config, self.spec.max_model_len)
        self.max_model_len = self.config.max_model_len or self.spec.max_model_len
        backends = choose_backends(self.config.attention_backend, device)  # decides each kind of attention call once
        # refuse a model we would serve wrong; layers grouped by the window they attend through (blocks behind a
        # sliding group's window go back to the pool)
        windows = self._checked(model, backends)
        self.spec.kv.groups = plan_groups({layer: windows.get(layer) for layer in self.spec.kv.stored_layers})
        self.memory = KVMemory(self.spec.kv, self.config)
        # state layers: one slot per running request (no prefix hits there: see KVCacheManager)
        states = StateSlots(device, self.config.max_num_seqs) if self.spec.has_state else None
        checkpoints = _state_checkpoints(self.config, device) if self.spec.has_state else None
        kv = KVCacheManager(self.memory.num_blocks, self.config.block_size, self.config.enable_prefix_caching, states,
                            checkpoints, self.spec.kv.groups)
        kv.max_chunk = self.config.max_num_batched_tokens  # no step computes more of one sequence
        if self.config.long_prefill_token_threshold and self.config.enable_chunked_prefill:
            kv.max_chunk = min(kv.max_chunk, self.config.long_prefill_token_threshold)
        costs = PreemptionCosts(copy_bytes_per_s=self.memory.copy_bytes_per_s) if self.memory.swap else None
        detokenize = self.detokenize if tokenizer is not None else None
        self.scheduler = Scheduler(self.config, kv, self.memory.swap, costs, self.max_model_len, detokenize)
        graphs = None if states is not None else DecodeGraphSettings.for_engine(
            self.config, device, self.memory.num_blocks, self.max_model_len)
        self.runner = ModelRunner(model, self.spec, self.memory.cache, self.config.attention_backend, graphs, states,
                                  None if kv.checkpoints is None else kv.checkpoints.store, backends)
        if self.memory.cache.quantized:  # fixed before any request stores K/V; graphs bake them in, so capture after
            self.memory.cache.set_scales(fp8_kv_scales(model, self.spec, self.config.kv_scales, self.max_model_len))
            if self.runner.graphs is not None and self.runner.graphs.settings.capture_at_start:
                self.runner.graphs.capture_all()
        self.sampler = Sampler(device, self.config.seed)
        self.limits = Limits(self.spec.vocab_size, self.max_model_len, self.memory.num_blocks, self.config,
                             kv.blocks_for)
        eos = _as_id_list(getattr(model.generation_config, "eos_token_id", None)) + _as_id_list(
            getattr(tokenizer, "eos_token_id", None))
        # an EOS id the model can never produce can never stop a request (nor be banned under min_tokens)
        self.eos_token_ids = tuple(sorted({t for t in eos if 0 <= t < self.spec.vocab_size}))
        self.parents: dict[str, ParentRequest] = {}  # unfinished (or not yet collected) prompts by request id
        # request id -> indices of its samples that received a token or finished since their consumer last collected
        # (`LLM` routes them to whichever call owns the request, whoever stepped); replaced whole, never edited
        self.dirty: dict[str, frozenset[int]] = {}
        self.finish_marks = 0  # grows whenever a marked request finished (callers waiting only for ends watch it)
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._typed: bool | None = None  # whether this engine's requests carry token types (set by the first)
        self.lock = threading.RLock()  # add_request / abort / step from several threads run one at a time
        self._in_step = False  # a step of the thread holding `lock` is running (aborts it makes wait for its end)
        self._deferred_aborts: list[str] = []

    def _checked(self, model: torch.nn.Module, backends) -> dict:
        """The start-up check (`check_paged_matches_model`); a model refused while some state modules run hf_paged's
        faster forwards is checked again on their own forwards, and served on those if it passes."""
        try:
            return check_paged_matches_model(model, self.spec, backends)
        except ValueError as refused:
            if not self.spec.substituted:
                raise
            logger.warning("hf_paged: %s; checking again with the state modules' own forwards", refused)
        self.spec = describe_model(model, substitutes=False)
        return check_paged_matches_model(model, self.spec, backends)

    # ---- input ---------------------------------------------------------------------------------
    def tokenize(self, prompt: str | Sequence[int], index: int) -> list[int]:
        return tokenize(self.tokenizer, prompt, index)

    def check_request(self, index: int, token_ids: list[int], params: SamplingParams) -> None:
        check_request(self.limits, index, token_ids, params, has_tokenizer=self.tokenizer is not None)

    def new_request_ids(self, count: int) -> list[str]:
        """`count` automatic ids, as `count` add_request calls without ids would take them (processes that make the
        same calls get the same ids)."""
        return [self._new_id() for _ in range(count)]

    def _new_id(self) -> str:
        """The next automatic id that no queued request uses (a caller's own ids may look like ours)."""
        while True:
            request_id = str(next(self._ids))
            if request_id not in self.parents:
                return request_id

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, priority: int = 0, index: int = 0,
                    controller: Any = None, prompt_text: str | None = None,
                    fork_of: Request | None = None, first_query: tuple[int, int] | None = None,
                    token_types: tuple[list[int], int] | None = None, checked: bool = False) -> ParentRequest:
        """Validate and queue one prompt as a parent of `params.n` samples. Returns the parent.

        Samples after the first (and, with `fork_of`, a queued request with the same prompt, the first too) are not
        scheduled on their own: when the prompt has been computed they fork from it, sharing its blocks and its
        first-token logits, so the prompt is computed once and all samples stay in step.

        `first_query` (token id, position): the first output is sampled from this query-only token instead of the
        last prompt token, and outputs continue at its position + 1 (how HF generates after right padding).
        `token_types` (one per prompt token, the one of every output): passed to the model as `token_type_ids`; every
        request of an engine has them or none does. `checked`: `prompt` is the token id list that `tokenize` gave
        and `check_request` passed with these `params` on this engine (`LLM` validates a whole call first): not done
        again."""
        # the engine's own copy: a caller changing its object later changes no queued request
        params = SamplingParams() if params is None else params.copy()
        if checked:
            token_ids = list(prompt)
        else:
            token_ids = self.tokenize(prompt, index)
            self.check_request(index, token_ids, params)
        if first_query is not None:
            self.check_request(index, [first_query[0]], params)
        if token_types is not None and len(token_types[0]) != len(token_ids):
            raise ValueError(f"request {index}: {len(token_types[0])} token types for {len(token_ids)} tokens")
        typed = token_types is not None
        with self.lock:  # checked and set together: concurrent callers cannot both pass with different answers
            if self._typed is not None and typed != self._typed:  # one packed forward feeds types to all or none
                raise ValueError(f"request {index}: {'has' if typed else 'lacks'} token types, unlike the earlier "
                                 f"requests of this engine: give them to every request of an engine or to none")
            self._typed = typed
            return self._add(token_ids, params, request_id, priority, index, controller,
                             prompt if isinstance(prompt, str) else prompt_text, fork_of, first_query, token_types)

    def _add(self, token_ids, params, request_id, priority, index, controller, text, fork_of,
             first_query, token_types) -> ParentRequest:
        request_id = self._new_id() if request_id is None else str(request_id)
        if request_id in self.parents:
            raise ValueError(f"request {index}: request_id {request_id!r} is already in use")
        parent = ParentRequest(request_id, index, text, token_ids)
        for sample in range(params.n):
            request = Request(parent, token_ids, params, self.eos_token_ids, next(self._arrivals), priority, sample,
                              controller, first_query=first_query, token_types=token_types)
            if params.seed is not None:
                request.generator = torch.Generator(self.spec.kv.device).manual_seed(params.seed + sample)
            if params.logprobs is not None:
                request.logprobs = []
            parent.samples.append(request)
            self.scheduler.add(request, fork_of=parent.samples[0] if sample else fork_of)
        self.parents[request_id] = parent
        return parent

    def abort(self, request_id: str) -> bool:
        """Stop every sample of a request and free its memory. Returns whether the id was known. Called from inside
        a step of this very thread (a finalizer, e.g. an abandoned stream collected mid-forward), it takes effect
        right after that step."""
        with self.lock:
            if self._in_step:
                self._deferred_aborts.append(str(request_id))
                return str(request_id) in self.parents
            parent = self.parents.pop(str(request_id), None)
            if parent is None:
                return False
            self._unmark(parent.request_id)
            for request in parent.samples:
                self.scheduler.abort(request)
            return True

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one forward pass. Returns the requests that received a token or finished this step.

        All or nothing: if any of the four calls raises (Exception or BaseException, e.g. KeyboardInterrupt), every
        request, block table, the block pool, the swap space and the random state are put back as they were before
        it, and the error propagates; stepping on gives the tokens an undisturbed run gives. One exception: a step
        whose LM head picks the model did not hand back (`runner.HeadOutputChanged`) is undone and run again at once,
        with real logits."""
        with self.lock:
            if self._in_step:
                raise RuntimeError("Engine.step called from inside a step of the same thread")
            self._in_step = True
            try:
                if self.memory.cache.released:
                    self.memory.wake_up()
                try:
                    return self._step()
                except HeadOutputChanged:  # undone, and the runner computes logits from now on: run it again
                    return self._step()
            finally:
                self._in_step = False
                deferred, self._deferred_aborts = self._deferred_aborts, []
                for request_id in deferred:
                    self.abort(request_id)

    def _step(self) -> list[Request]:
        scheduler = self.scheduler
        if scheduler.undo.broken is not None:
            raise RuntimeError(f"this engine cannot step any more: {scheduler.undo.broken}; create a new one")
        if self.config.enable_prefix_caching:  # K/V computed from now on are found only by what computes them
            scheduler.set_context(self.kv_context())
        rng = self.sampler.generator.get_state()
        scheduler.undo.begin()
        try:
            plan = scheduler.schedule()
            if not plan.requests:
                if scheduler.has_work:
                    raise RuntimeError("scheduler made no progress although requests are waiting")
                changed = []
            else:
                self.memory.apply(plan)
                outcome = self.runner.run(plan, self.sampler)
                changed = scheduler.update(plan, outcome)
            if changed:
                dirty = dict(self.dirty)
                for request in changed:
                    request_id = request.parent.request_id
                    dirty[request_id] = dirty.get(request_id, frozenset()) | {request.sample_index}
                self.dirty = dirty  # before the commit: a failure between them leaves a mark, never loses one
                self.finish_marks += sum(1 for request in changed if request.is_finished)
            scheduler.undo.commit()
        except BaseException:
            scheduler.undo.rollback()
            self.sampler.generator.set_state(rng)
            raise
        return changed

    # ---- memory between uses ------------------------------------------------------------------------
    def sleep(self) -> None:
        """Give the KV pool's memory (and the state slots') back until the next step or `wake_up`: for training and
        generation taking turns on one device (RL). Needs an idle engine (RuntimeError otherwise); every cached
        prefix is forgotten, captured CUDA graphs are dropped (they hold the pool's addresses)."""
        with self.lock:
            scheduler = self.scheduler
            if scheduler.has_work:
                raise RuntimeError(f"sleep() needs an idle engine: {len(scheduler.running)} running, "
                                   f"{len(scheduler.waiting)} waiting requests (finish or abort them first)")
            scheduler.set_context(object())  # nothing computed so far is found again (checkpoints cleared too)
            kv = scheduler.kv
            if kv.states is not None:
                kv.states.release()
            if kv.checkpoints is not None:
                kv.checkpoints.store.tensors.clear()
            if self.runner.graphs is not None:
                self.runner.graphs.forget()
            self.memory.sleep()

    def wake_up(self) -> None:
        """Take the pool's memory again (`step` does this by itself when needed)."""
        with self.lock:
            self.memory.wake_up()

    @property
    def asleep(self) -> bool:
        return self.memory.cache.released

    def kv_context(self) -> tuple:
        """Everything besides tokens, positions and salt that decides the K/V this engine computes: the weights and
        adapters (`weights_fingerprint`) and the fp8 scales."""
        return weights_fingerprint(self.model), self.memory.cache.scales_fingerprint()

    def reset_prefix_cache(self) -> None:
        """Never reuse any K/V computed so far (after changes `kv_context` cannot see, e.g. writes through `.data`),
        nor any packed copy of a weight (`model.packed_linear`)."""
        with self.lock:
            self.scheduler.set_context(object())
            self.runner.linears.packed.forget()
            self.runner.layers.forget()

    # ---- output --------------------------------------------------------------------------------
    def detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def output(self, parent: ParentRequest, samples: list[Request] | None = None, partial: bool = False) -> RequestOutput:
        return parent_output(parent, samples, self.detokenize if self.tokenizer is not None else None, partial)

    def release(self, parent: ParentRequest) -> None:
        """Forget a finished parent (its memory is already free)."""
        if self.parents.get(parent.request_id) is parent:
            del self.parents[parent.request_id]
            self._unmark(parent.request_id)

    def _unmark(self, request_id: str) -> None:
        """Drop a request's marks; `dirty` is replaced whole (others iterate it without the lock)."""
        if request_id in self.dirty:
            self.dirty = {rid: samples for rid, samples in self.dirty.items() if rid != request_id}

    def stats(self) -> dict:
        kv, scheduler = self.scheduler.kv, self.scheduler
        return {
            "num_blocks_total": kv.pool.num_blocks,
            "num_blocks_free": kv.num_free_blocks,
            "block_size": self.config.block_size,
            "kv_cache_bytes": self.memory.cache.num_bytes,
            "num_running": len(scheduler.running),
            "num_waiting": len(scheduler.waiting),
            "swap_blocks_free": self.memory.num_swap_blocks_free,
            "prefix_cache_hit_tokens": kv.hit_tokens,
            "prefix_cache_query_tokens": kv.query_tokens,
            "num_cached_blocks": len(kv.pool.cached),
            **scheduler.counters,
        }

    def check_idle(self) -> None:
        """Raise unless no request holds memory (every block free, every reference count zero)."""
        if self.scheduler.has_work:
            raise AssertionError("requests are still queued or running")
        self.scheduler.kv.pool.check_all_free()
        if self.scheduler.kv.states is not None:
            self.scheduler.kv.states.check_all_free()
        self.memory.check_swap_idle()


__all__ = ["Engine"]
