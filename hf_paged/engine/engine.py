"""The continuous-batching engine: add requests, step, abort, stats."""
from __future__ import annotations

import itertools
import time
from typing import Any, Sequence

import torch

from ..config import EngineConfig, default_kv_cache_bytes, default_swap_bytes, logger
from ..attention.dispatch import unavailable
from ..model import describe_model
from .host_allocator import tune_host_allocator
from ..kv import KVCache, KVCacheManager, blocks_needed, choose_num_blocks
from ..kv.swap import SwapPool, copy_blocks, measure_copy_bandwidth
from .cuda_graphs import DecodeGraphSettings
from .runner import ModelRunner
from ..request import CompletionOutput, Request, RequestOutput, RequestStatus
from ..sampling import SamplingParams, Sampler
from .scheduler import PreemptionCosts, Scheduler


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


class Engine:
    """Serves many requests at once on one model.

    `add_request` validates up front (ValueError naming the request) and queues; `step` runs one forward
    pass for every scheduled request and returns the outputs that changed. A request that fails while
    running (non-finite logits, a sampling hook that raises) ends alone with finish_reason="error".
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, config: EngineConfig | None = None,
                 **options):
        if config is not None and options:
            raise ValueError("pass either an EngineConfig or keyword options, not both")
        self.config = config or EngineConfig.from_dict(options)
        self.config.validate()
        self.model = model
        self.tokenizer = tokenizer
        self.spec = describe_model(model)
        self.host_allocator = tune_host_allocator() if self.spec.kv.device.type == "cpu" else "not used (GPU)"
        reason = unavailable(self.config.attention_backend, self.spec.kv.device)
        if reason is not None:
            raise ValueError(f"attention_backend {self.config.attention_backend!r} cannot run on "
                             f"{self.spec.kv.device}: {reason}")
        if self.config.kv_cache_dtype == "fp8_e4m3":
            self.spec.kv.dtype = torch.float8_e4m3fn
        self.max_model_len = self.config.max_model_len or self.spec.max_model_len
        budget = self.config.kv_cache_memory or default_kv_cache_bytes(self.spec.kv.device)
        num_blocks = choose_num_blocks(self.spec.kv, self.config.block_size, self.config.num_blocks, budget)
        graphs = DecodeGraphSettings.for_engine(self.config, self.spec.kv.device, num_blocks, self.max_model_len)
        self.kv_cache = KVCache(self.spec.kv, num_blocks + (graphs is not None), self.config.block_size)  # + scratch
        self.kv = KVCacheManager(num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        self.swap = self._make_swap_pool()
        costs = PreemptionCosts(copy_bytes_per_s=measure_copy_bandwidth(self.kv_cache)) if self.swap else None
        self.scheduler = Scheduler(self.config, self.kv, self.swap, costs)
        self.runner = ModelRunner(model, self.spec, self.kv_cache, self.config.attention_backend, graphs)
        self.sampler = Sampler(self.spec.kv.device, self.config.seed)
        self.eos_token_ids = tuple(sorted(set(
            _as_id_list(getattr(model.generation_config, "eos_token_id", None))
            + _as_id_list(getattr(tokenizer, "eos_token_id", None)))))
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self.counters = {"num_steps": 0, "num_prompt_tokens": 0, "num_generated_tokens": 0,
                         "num_batched_tokens": 0, "num_finished": 0, "num_errors": 0}

    def _make_swap_pool(self) -> SwapPool | None:
        if self.config.preemption_mode == "recompute":
            return None
        budget = self.config.swap_space
        budget = default_swap_bytes(self.spec.kv.device) if budget is None else budget
        num_blocks = budget // self.spec.kv.bytes_per_block(self.config.block_size)
        if num_blocks < 1:
            if self.config.preemption_mode == "swap":
                raise ValueError("preemption_mode='swap' needs swap_space (bytes) for at least one block")
            return None
        logger.info("hf_paged swap space: %d blocks (%.1f MiB)", num_blocks, budget / 2**20)
        return SwapPool(self.kv_cache, int(num_blocks))

    # ---- input ---------------------------------------------------------------------------------
    def tokenize(self, prompt: str | Sequence[int], index: int) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"request {index}: a text prompt needs a tokenizer (LLM(model, tokenizer=...))")
            return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
            raise ValueError(f"request {index}: a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        return list(prompt)

    def check_request(self, index: int, token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError('request {index}: ...') for anything that can never be served."""
        try:
            params.validate()
        except ValueError as e:
            raise ValueError(f"request {index}: {e}") from None
        if not token_ids:
            raise ValueError(f"request {index}: the prompt is empty")
        bad = [t for t in token_ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise ValueError(f"request {index}: token ids {bad[:5]} are outside the vocabulary [0, {self.spec.vocab_size})")
        total = len(token_ids) + params.max_tokens
        if self.max_model_len is not None and total > self.max_model_len:
            raise ValueError(f"request {index}: prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) = "
                             f"{total} exceeds the model's maximum length {self.max_model_len}")
        pool_tokens = self.kv.pool.num_blocks * self.config.block_size
        if blocks_needed(total, self.config.block_size) > self.kv.pool.num_blocks:
            raise ValueError(f"request {index}: prompt + max_tokens = {total} tokens can never fit the KV pool "
                             f"({self.kv.pool.num_blocks} blocks = {pool_tokens} tokens); raise num_blocks or kv_cache_memory")
        if not self.config.enable_chunked_prefill and total > self.config.max_num_batched_tokens:
            raise ValueError(f"request {index}: {total} tokens exceed max_num_batched_tokens "
                             f"({self.config.max_num_batched_tokens}) with chunked prefill disabled")

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, priority: int = 0, index: int = 0,
                    controller: Any = None, prompt_text: str | None = None,
                    fork_of: Request | None = None) -> list[Request]:
        """Validate and queue one prompt (n samples become n requests). Returns the queued requests.

        Samples after the first (and requests given `fork_of`, a queued request with the same prompt) are not
        scheduled on their own: when the first sample has computed the prompt they fork from it, sharing its
        blocks and its first-token logits, so the prompt is computed once and all samples stay in step."""
        params = params or SamplingParams()
        token_ids = self.tokenize(prompt, index)
        self.check_request(index, token_ids, params)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if any(k == request_id or k.startswith(request_id + "#") for k in self.requests):
            raise ValueError(f"request {index}: request_id {request_id!r} is already in use")
        created = []
        for sample in range(params.n):
            rid = request_id if params.n == 1 else f"{request_id}#{sample}"
            request = Request(rid, index, token_ids, params, self.eos_token_ids, next(self._arrivals), priority,
                              prompt if isinstance(prompt, str) else prompt_text, sample, controller)
            if params.seed is not None:
                request.generator = torch.Generator(self.spec.kv.device).manual_seed(params.seed + sample)
            if params.logprobs is not None:
                request.logprobs = []
            self.requests[rid] = request
            parent = created[0] if created else fork_of
            if parent is not None and parent.prompt_token_ids == token_ids and parent.num_output_tokens == 0:
                parent.forks.append(request)
            else:
                self.scheduler.add(request)
            created.append(request)
        return created

    def abort(self, request_id: str) -> bool:
        """Stop a request (or all n samples of it) and free its memory. Returns whether anything was found."""
        found = [r for k, r in self.requests.items() if k == request_id or k.startswith(f"{request_id}#")]
        for request in found:
            if not request.is_finished:
                self.scheduler.finish(request)
                request.finish("abort")
            self.requests.pop(request.request_id, None)
        return bool(found)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one forward pass. Returns the requests that received a token or finished this step."""
        batch = self.scheduler.schedule()
        if not batch.requests:
            if self.scheduler.has_work:
                raise RuntimeError("scheduler made no progress although requests are waiting")
            return []
        started = time.perf_counter()
        self._move_blocks(batch)
        inputs = self.runner.prepare(batch)
        logits = self.runner.execute(inputs)
        self.scheduler.costs.observe_step(batch.num_tokens, time.perf_counter() - started)
        for request, n in zip(batch.requests, batch.num_new_tokens):
            request.num_computed_tokens += n
            self.kv.cache_full_blocks(request)
        self.counters["num_steps"] += 1
        self.counters["num_batched_tokens"] += batch.num_tokens
        sampled = [batch.requests[i] for i in inputs.sampled]
        sampled, logits = self._start_forks(sampled, logits)
        for request in sampled:
            if request.num_output_tokens == 0 and request.num_preemptions == 0:
                self.counters["num_prompt_tokens"] += request.num_prompt_tokens
        tokens = self._sample(sampled, logits)
        for request, token in zip(sampled, tokens):
            if token is not None and not request.is_finished:
                self._append(request, *token)
        for request in sampled:
            if request.is_finished:
                self.scheduler.finish(request)
                self.counters["num_finished"] += 1
        return sampled

    def _start_forks(self, sampled: list[Request], logits: torch.Tensor):
        """Samples waiting on a prompt that was just computed join the batch with the same logits row."""
        rows = [i for i, r in enumerate(sampled) if r.forks and r.num_output_tokens == 0]
        if not rows:
            return sampled, logits
        extra, extra_rows = [], []
        for i in rows:
            for child in sampled[i].forks:
                if not child.is_finished:
                    self.scheduler.fork(sampled[i], child)
                    extra.append(child)
                    extra_rows.append(i)
            sampled[i].forks = []
        merged = sampled + extra
        order = sorted(range(len(merged)), key=lambda j: (merged[j].index, merged[j].sample_index))
        all_rows = list(range(len(sampled))) + extra_rows
        index = torch.tensor([all_rows[j] for j in order], device=logits.device)
        return [merged[j] for j in order], logits[index]

    def _move_blocks(self, batch) -> None:
        """Before the forward pass: save swapped-out blocks, clear newly handed-out ones, restore swapped-in
        ones (in that order: freed blocks may be handed out again in the same step)."""
        for device_ids, host_ids in batch.swap_out:
            self.swap.swap_out(self.kv_cache, device_ids, host_ids)
        if batch.swap_out:
            self.swap.synchronize()
        self.runner.zero_blocks(self.kv.take_fresh_blocks())
        copies = self.kv.take_copies()
        if copies:
            copy_blocks(self.kv_cache.storage, self.kv_cache.storage, *map(list, zip(*copies)))
        for host_ids, device_ids in batch.swap_in:
            self.swap.swap_in(self.kv_cache, host_ids, device_ids)
        if batch.swap_in:
            self.swap.synchronize()
            for host_ids, _ in batch.swap_in:
                self.swap.free(host_ids)

    def _sample(self, requests: list[Request], logits: torch.Tensor) -> list[tuple[int, bool] | None]:
        """One (token, stop_now) per request; None where the request ended with an error."""
        result: list[tuple[int, bool] | None] = [None] * len(requests)
        finite = torch.isfinite(logits.sum(dim=-1)).tolist() if requests else []  # NaN/inf anywhere poisons the sum
        native, hooked = [], {}
        for i, request in enumerate(requests):
            if not finite[i]:
                request.finish("error", "the model produced non-finite logits for this request")
                self.runner.forget_blocks(request.block_table)  # its K/V may be NaN too: never reuse them as is
                self.counters["num_errors"] += 1
            elif request.controller is None:
                native.append(i)
            else:
                hooked.setdefault(id(request.controller), []).append(i)
        if native:
            rows = logits if len(native) == len(requests) else logits[torch.tensor(native, device=logits.device)]
            group = [requests[i] for i in native]
            banned = [self._banned(r) for r in group]
            out = self.sampler(rows, [r.params for r in group], [r.all_token_ids for r in group],
                               [r.output_token_ids for r in group], [r.generator for r in group], banned)
            for j, i in enumerate(native):
                result[i] = (out.token_ids[j], False)
                if requests[i].logprobs is not None:
                    requests[i].logprobs.append(out.logprobs[j])
        for members in hooked.values():
            group = [requests[i] for i in members]
            try:
                picks = group[0].controller.process(group, logits[torch.tensor(members, device=logits.device)])
            except Exception as e:  # a user hook failing ends only its own requests
                logger.debug("hf_paged: sampling hook failed: %r", e)
                for r in group:
                    r.finish("error", f"{type(e).__name__}: {e}")
                    self.counters["num_errors"] += 1
                continue
            for i, pick in zip(members, picks):
                result[i] = pick
        return result

    def _banned(self, request: Request) -> list[int]:
        if request.num_output_tokens >= request.params.min_tokens:
            return []
        return list(request.params.stop_token_ids) + ([] if request.params.ignore_eos else list(request.eos_token_ids))

    def _append(self, request: Request, token: int, stop_now: bool) -> None:
        request.append_token(token)
        self.counters["num_generated_tokens"] += 1
        params = request.params
        past_min = request.num_output_tokens >= params.min_tokens
        if stop_now:
            request.finish("stop")
        elif past_min and token in params.stop_token_ids:
            request.finish("stop")
            request.stop_reason = token
        elif past_min and not params.ignore_eos and token in request.eos_token_ids and request.controller is None:
            request.finish("stop")
        elif request.num_output_tokens >= params.max_tokens:
            request.finish("length")
        elif self.max_model_len is not None and request.num_tokens >= self.max_model_len:
            request.finish("length")
        elif params.stop and past_min and self.tokenizer is not None:
            text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
            hit = next((s for s in params.stop if s in text), None)
            if hit is not None:
                request.finish("stop")
                request.stop_reason = hit

    # ---- output --------------------------------------------------------------------------------
    def decode(self, token_ids: list[int], stop: str | None = None) -> str | None:
        if self.tokenizer is None:
            return None
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        if isinstance(stop, str) and stop in text:
            text = text[: text.index(stop)]
        return text

    def completion(self, request: Request) -> CompletionOutput:
        text = self.decode(request.output_token_ids, request.stop_reason) if request.is_finished else None
        return CompletionOutput(request.sample_index, list(request.output_token_ids), text, request.finish_reason,
                                request.logprobs, request.error)

    def output(self, requests: list[Request]) -> RequestOutput:
        first = requests[0]
        base_id = first.request_id.split("#")[0]
        return RequestOutput(base_id, first.prompt, list(first.prompt_token_ids),
                             [self.completion(r) for r in sorted(requests, key=lambda r: r.sample_index)],
                             num_cached_tokens=max(0, first.num_cached_tokens),
                             finished=all(r.is_finished for r in requests), metrics=_metrics(requests))

    def release(self, request: Request) -> None:
        """Forget a finished request (its memory is already free)."""
        self.requests.pop(request.request_id, None)

    def stats(self) -> dict:
        return {
            "num_blocks_total": self.kv.pool.num_blocks,
            "num_blocks_free": self.kv.num_free_blocks,
            "block_size": self.config.block_size,
            "kv_cache_bytes": self.kv_cache.num_bytes,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_recomputed_tokens": self.scheduler.num_recomputed_tokens,
            "num_swap_outs": self.scheduler.num_swap_outs,
            "num_swap_ins": self.scheduler.num_swap_ins,
            "num_blocks_swapped": self.scheduler.num_blocks_swapped,
            "swap_blocks_free": self.swap.num_free if self.swap else 0,
            "prefix_cache_hit_tokens": self.kv.hit_tokens,
            "prefix_cache_query_tokens": self.kv.query_tokens,
            "num_cached_blocks": len(self.kv.pool.cached),
            **self.counters,
        }

    def check_idle(self) -> None:
        """Raise unless no request holds memory (every block free, every reference count zero)."""
        if self.scheduler.has_work:
            raise AssertionError("requests are still queued or running")
        self.kv.pool.check_all_free()
        if self.swap is not None and self.swap.num_free != self.swap.num_blocks:
            raise AssertionError(f"swap blocks still held: {self.swap.num_blocks - self.swap.num_free}")


def _metrics(requests: list[Request]) -> dict:
    """Wall-clock timings of one prompt's samples (seconds since it was added)."""
    first = requests[0]
    firsts = [r.first_token_time for r in requests if r.first_token_time is not None]
    ends = [r.finished_time for r in requests if r.finished_time is not None]
    return {"time_to_first_token_s": min(firsts) - first.arrival_time if firsts else None,
            "latency_s": max(ends) - first.arrival_time if len(ends) == len(requests) else None,
            "num_preemptions": sum(r.num_preemptions for r in requests)}


__all__ = ["Engine", "RequestStatus"]
