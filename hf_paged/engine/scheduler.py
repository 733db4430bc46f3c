"""FCFS scheduling under a token budget, with chunked prefill and preemption by recompute."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..config import EngineConfig
from ..kv import KVCacheManager, blocks_needed
from ..kv.swap import SwapPool
from ..request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work: `num_new_tokens[i]` tokens of `requests[i]`, starting at its num_computed_tokens."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    swap_out: list[tuple[list[int], list[int]]] = field(default_factory=list)  # (device ids, host ids)
    swap_in: list[tuple[list[int], list[int]]] = field(default_factory=list)  # (host ids, device ids)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def add(self, request: Request, num_new_tokens: int) -> None:
        self.requests.append(request)
        self.num_new_tokens.append(num_new_tokens)


class Scheduler:
    """Decides which tokens run in the next forward pass.

    Each step: running decodes first, then unfinished prefill chunks, then waiting requests in arrival order
    while the token budget, `max_num_seqs` and free blocks allow. A waiting request starts from its longest
    cached prefix and is admitted only when blocks for all of its tokens are free (no admit/preempt thrash). When a running request cannot get
    a block, the newest running request (lowest priority first) is preempted: its blocks are freed and it
    goes back to the head of the queue to be recomputed later. Nothing is ever dropped.
    """

    def __init__(self, config: EngineConfig, kv: KVCacheManager, swap: SwapPool | None = None,
                 costs: "PreemptionCosts | None" = None):
        self.config = config
        self.kv = kv
        self.swap = swap
        self.costs = costs or PreemptionCosts()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0
        self.num_swap_outs = 0
        self.num_swap_ins = 0
        self.num_blocks_swapped = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _chunk(self, request: Request, budget: int) -> int:
        """Tokens to run for `request` this step: all that remain, or with chunking at most the budget and
        (for prefills) at most `long_prefill_token_threshold`."""
        remaining = request.num_tokens - request.num_computed_tokens
        if not self.config.enable_chunked_prefill:
            return remaining
        cap = self.config.long_prefill_token_threshold
        if cap and remaining > 1:
            remaining = min(remaining, cap)
        return min(remaining, budget)

    def _victim(self) -> Request:
        """Lowest priority value loses last: preempt the highest `priority` number, then the latest arrival."""
        return max(self.running, key=lambda r: (r.priority, r.arrival))

    def _should_swap(self, request: Request) -> bool:
        """Swap when asked to (or, in "auto", when moving the blocks out and back is estimated cheaper than
        recomputing the tokens) and the swap space has room; otherwise recompute."""
        mode, blocks = self.config.preemption_mode, len(request.block_table)
        if mode == "recompute" or self.swap is None or self.swap.num_free < blocks:
            return False
        return mode == "swap" or self.costs.swap_is_cheaper(blocks * self.swap.bytes_per_block,
                                                            request.num_computed_tokens)

    def _preempt(self, request: Request, batch: ScheduledBatch) -> None:
        """Free the request's device blocks: its K/V go to host swap space, or are recomputed later.
        Swap copies run before this step's forward pass touches the freed blocks."""
        self.running.remove(request)
        if self._should_swap(request):
            host = self.swap.allocate(len(request.block_table))
            batch.swap_out.append((list(request.block_table), host))
            request.swapped_blocks = host
            request.status = RequestStatus.SWAPPED
            self.num_swap_outs += 1
            self.num_blocks_swapped += len(host)
            self.kv.free(request)
        else:
            self.kv.free(request)
            self.num_recomputed_tokens += request.num_computed_tokens
            request.num_computed_tokens = 0
            request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        batch.preempted.append(request)

    def _swap_in(self, request: Request, batch: ScheduledBatch) -> bool:
        """Give a swapped request device blocks for everything it holds plus its growth, and queue the copy."""
        if blocks_needed(request.num_tokens, self.kv.block_size) > self.kv.num_free_blocks:
            return False
        device = self.kv.pool.allocate(len(request.swapped_blocks))
        request.block_table = device
        batch.swap_in.append((request.swapped_blocks, device))
        request.swapped_blocks = []
        self.num_swap_ins += 1
        return True

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        for request in decodes + [r for r in self.running if r.num_tokens - r.num_computed_tokens != 1]:
            if budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._chunk(request, budget)
            if num_new > budget:
                continue
            while not self.kv.allocate_slots(request, num_new):
                victim = self._victim()
                self._preempt(victim, batch)
                if victim is request:
                    break
            if request.status is RequestStatus.RUNNING:
                batch.add(request, num_new)
                budget -= num_new
        if not batch.preempted:  # memory is tight: let the running requests make progress first
            self._admit(batch, budget)
        return batch

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        """Waiting requests in arrival order; the first that does not fit stops admission. A request whose
        prompt starts with blocks another request is computing right now waits for them to be published
        instead of computing them again (it keeps its place in the queue)."""
        position = 0
        while position < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[position]
            if request.status is not RequestStatus.SWAPPED and self._prefix_in_flight(request):
                position += 1
                continue
            if not self.config.enable_chunked_prefill and self._chunk(request, budget) > budget:
                break  # unchunked work that does not fit this step's budget waits for the next one
            if request.status is RequestStatus.SWAPPED:
                if not self._swap_in(request, batch):
                    break
                num_new = self._chunk(request, budget)
                self.kv.allocate_slots(request, num_new)  # fits: _swap_in checked the whole request
            else:
                hits = self.kv.computed_blocks(request)
                if not self.kv.can_admit(request, hits):
                    break
                self.kv.admit(request, hits)
                num_new = self._chunk(request, budget)
                if num_new > budget or not self.kv.allocate_slots(request, num_new):
                    self.kv.free(request)  # hand the hits back: nothing else changed
                    request.num_computed_tokens = 0
                    break
                self.kv.count_lookup(request)
            del self.waiting[position]
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = request.num_computed_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            batch.add(request, num_new)
            budget -= num_new

    def _prefix_in_flight(self, request: Request) -> bool:
        """Whether a running prefill will publish at least two more of `request`'s leading blocks than the
        prefix cache holds now."""
        if not self.kv.enable_prefix_caching:
            return False
        prefilling = [r for r in self.running if r.num_computed_tokens < r.num_prompt_tokens]
        if not prefilling:
            return False
        cached = len(self.kv.computed_blocks(request))
        return any(self.kv.common_prefix_blocks(request, other) >= cached + 2 for other in prefilling)

    def fork(self, parent: Request, child: Request) -> None:
        """Start `child` (another sample of the same prompt) from `parent`'s computed prompt: it shares every
        block, and the shared partly filled block is copied when one of them first writes to it."""
        self.kv.fork(parent, child)
        child.status = RequestStatus.RUNNING
        child.num_cached_tokens = parent.num_cached_tokens
        self.running.append(child)

    def finish(self, request: Request) -> None:
        """Release a finished (or aborted) request's memory, wherever it is."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        if request.swapped_blocks:
            self.swap.free(request.swapped_blocks)
            request.swapped_blocks = []


@dataclass(slots=True)
class PreemptionCosts:
    """Measured rates behind preemption_mode="auto": swapping moves a request's bytes out and back at the
    measured copy bandwidth; recomputing re-runs its tokens at the observed prefill throughput (until a
    prefill-sized step has been seen, a conservative prior that favours recompute)."""

    copy_bytes_per_s: float = 8e9
    prefill_tokens_per_s: float | None = None

    def swap_is_cheaper(self, num_bytes: int, num_tokens: int) -> bool:
        prefill = self.prefill_tokens_per_s or 1e5
        return 2 * num_bytes / self.copy_bytes_per_s < num_tokens / prefill

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """Fold a prefill-sized step into the throughput estimate (exponential moving average)."""
        if num_tokens >= 64 and seconds > 0:
            rate = num_tokens / seconds
            previous = self.prefill_tokens_per_s
            self.prefill_tokens_per_s = rate if previous is None else 0.5 * previous + 0.5 * rate
