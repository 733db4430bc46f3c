"""FCFS scheduling under a token budget, with chunked prefill and preemption by recompute."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .config import EngineConfig
from .kv import KVCacheManager, blocks_needed
from .request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work: `num_new_tokens[i]` tokens of `requests[i]`, starting at its num_computed_tokens."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

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

    def __init__(self, config: EngineConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0

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

    def _preempt(self, request: Request, batch: ScheduledBatch) -> None:
        self.running.remove(request)
        self.kv.free(request)
        self.num_recomputed_tokens += request.num_computed_tokens
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        batch.preempted.append(request)

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
        """Waiting requests in order. One whose sibling sample has not computed the shared prompt yet is
        skipped (it will find the prompt in the prefix cache); the first that does not fit stops admission."""
        position = 0
        while position < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[position]
            if _blocked_by_sibling(request):
                position += 1
                continue
            hits = self.kv.computed_blocks(request) if not request.block_table else []
            if not self.kv.can_admit(request, hits):
                break
            saved = request.num_computed_tokens
            self.kv.admit(request, hits)
            num_new = self._chunk(request, budget)
            if num_new > budget or not self.kv.allocate_slots(request, num_new):
                self.kv.free(request)  # gives the hits back; nothing else changed
                request.num_computed_tokens = saved
                break
            del self.waiting[position]
            self.kv.count_lookup(request)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = request.num_computed_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            batch.add(request, num_new)
            budget -= num_new

    def finish(self, request: Request) -> None:
        """Release a finished (or aborted) request's memory, wherever it is."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)


def _blocked_by_sibling(request: Request) -> bool:
    sibling = request.wait_for
    if sibling is None:
        return False
    if sibling.is_finished or sibling.num_computed_tokens >= sibling.num_prompt_tokens:
        request.wait_for = None
        return False
    return True
