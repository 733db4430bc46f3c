"""The scheduler: the one owner of every request's scheduling state and of the KV manager.

`schedule()` decides the next step (which tokens run, who is admitted, preempted, swapped, forked) and
`update(plan, outcome)` applies what the step produced (computed tokens, sampled tokens, stops, finishes, frees).
Nothing else changes a request's status, `num_computed_tokens`, outputs or blocks.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

from ..config import EngineConfig
from ..kv import NULL_BLOCK, KVCacheManager, blocks_needed, released_prefix
from ..kv.swap import SwapPool
from ..request import Request, RequestStatus, apply_stop_rules
from .plan import PreemptionCosts, StepOutcome, StepPlan
from .step_undo import StepUndo

COUNTERS = ("num_steps", "num_prompt_tokens", "num_generated_tokens", "num_batched_tokens", "num_finished",
            "num_errors", "num_preemptions", "num_recomputed_tokens", "num_swap_outs", "num_swap_ins",
            "num_blocks_swapped", "num_blocks_released")


class Scheduler:
    """Decides which tokens run in the next forward pass, and applies each step's outcome.

    Each step: running decodes first, then unfinished prefill chunks, then waiting requests in arrival order
    while the token budget, `max_num_seqs` and free blocks allow. A waiting request starts from its longest
    cached prefix and is admitted only when blocks for all of its tokens are free (no admit/preempt thrash). When a
    running request cannot get a block, the running request with the highest `priority` value (then the latest
    arrival) is preempted — taken out of this step's plan if it was already placed — and its blocks are freed:
    copied to host swap space first (preemption_mode "swap", or "auto" when that is estimated cheaper than
    recomputing) or recomputed later. It goes back to the head of the queue. Nothing is ever dropped.
    """

    def __init__(self, config: EngineConfig, kv: KVCacheManager, swap: SwapPool | None = None,
                 costs: PreemptionCosts | None = None, max_model_len: int | None = None,
                 detokenize: Callable[[list[int]], str] | None = None):
        self.config = config
        self.kv = kv
        self.swap = swap
        self.costs = costs or PreemptionCosts()
        self.max_model_len = max_model_len
        self.detokenize = detokenize
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.counters = dict.fromkeys(COUNTERS, 0)
        # called with each request that finished normally, just before its blocks are freed (its K/V still there)
        self.release_hooks: list[Callable[[Request], None]] = []
        self.undo = StepUndo(self)  # a step is all or nothing: `undo.begin / commit / rollback` around it

    @property
    def release_window(self) -> int | None:
        """The sliding window whose blocks behind it go back to the pool before each step, when every KV group has
        the same one (None: some group keeps every block). Setting it sets every group's (None: keep every block)."""
        windows = set(self.kv.windows) if not any(self.kv.chunks) else {None}
        return windows.pop() if len(windows) == 1 else None

    @release_window.setter
    def release_window(self, window: int | None) -> None:
        self.kv.windows = [window] * self.kv.num_groups
        if window is None:  # keep every block: chunked groups too
            self.kv.chunks = [None] * self.kv.num_groups

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request, fork_of: Request | None = None) -> None:
        """Queue a request. With `fork_of` (a queued request with the same prompt and no output yet) it is not
        scheduled on its own: it starts from that request's computed prompt, sharing its blocks and first logits."""
        if fork_of is not None and not fork_of.is_finished and fork_of.num_output_tokens == 0 \
                and fork_of.prompt_token_ids == request.prompt_token_ids and fork_of.cache_salt == request.cache_salt \
                and fork_of.first_query == request.first_query:
            fork_of.forks.append(request)
        else:
            self.waiting.append(request)

    def set_context(self, context: object) -> None:
        """What produces K/V from now on (see `KVCacheManager.set_context`). When it changed: requests holding K/V
        computed before (running, swapped, forks waiting on a prompt) never publish blocks again, and queued requests
        holding none forget their block keys (computed under the old root)."""
        if not self.kv.context_changed(context):
            return
        for request in self._all_requests():
            if request.block_tables or request.swapped_blocks or request.num_computed_tokens:
                request.stale_kv = True
            else:
                request.block_hashes = []
                request.num_published_blocks = 0
        self.kv.set_context(context)

    def _all_requests(self) -> list[Request]:
        found = list(self.running) + list(self.waiting)
        return found + [child for request in found for child in request.forks]

    def recompute(self, request: Request) -> None:
        """Preempt a running request by recompute, outside any step's plan (an undone step's victim)."""
        self._preempt(request, StepPlan(), allow_swap=False)

    @staticmethod
    def _forget_stale(request: Request) -> None:
        """A request recomputed from its tokens holds nothing from before a context change any more: its keys (made
        under the old root) go, and it publishes again."""
        if request.stale_kv:
            request.stale_kv = False
            request.block_hashes = []
            request.num_published_blocks = 0

    # ---- one step -----------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        for request in decodes + [r for r in self.running if r.num_tokens - r.num_computed_tokens != 1]:
            if budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            self.undo.touch(request)
            # its next query (at num_computed_tokens) sees no slot behind a sliding group's window
            self.counters["num_blocks_released"] += self.kv.release_behind(request, request.num_computed_tokens)
            num_new = self._chunk(request, budget)
            if num_new > budget:
                continue
            while not self.kv.allocate_slots(request, num_new):
                victim = self._victim()
                budget += self._preempt(victim, plan)
                if victim is request:
                    break
            if request.status is RequestStatus.RUNNING:
                plan.add(request, num_new)
                budget -= num_new
        if not plan.preempted:  # memory is tight: let the running requests make progress first
            self._admit(plan, budget)
        plan.blocks_to_clear = self.kv.take_blocks_to_clear()
        plan.copies = self.kv.take_copies()
        self._hold_back(plan)
        if self.kv.checkpoints is not None:
            plan.checkpoints = [self.kv.reserve_checkpoints(r, n) for r, n in zip(plan.requests, plan.num_new_tokens)]
        self._plan_samples(plan)
        return plan

    def update(self, plan: StepPlan, outcome: StepOutcome) -> list[Request]:
        """Apply a step's outcome. Returns the requests that received a token or finished, in `plan.sampled` order."""
        self.costs.observe_step(plan.num_tokens, outcome.elapsed_s)
        self.counters["num_steps"] += 1
        self.counters["num_batched_tokens"] += plan.num_tokens
        for request, num_new in zip(plan.requests, plan.num_new_tokens):
            request.num_computed_tokens += num_new
            self.kv.cache_full_blocks(request)
        for parent, child in plan.forks:
            self._start_fork(parent, child)
        changed = []
        for request, result in zip(plan.sampled, outcome.results):
            if request.is_finished:
                continue
            if request.num_output_tokens == 0 and request.num_preemptions == 0:
                self.counters["num_prompt_tokens"] += request.num_prompt_tokens
            if result.error is not None:
                if result.non_finite:
                    self.kv.discard_contents(request)  # its K/V may be NaN too: never reuse them as they are
                request.finish("error", result.error)
                self.counters["num_errors"] += 1
            else:
                if result.logprobs is not None and request.logprobs is not None:
                    request.logprobs.append(result.logprobs)
                self.counters["num_generated_tokens"] += 1
                apply_stop_rules(request, result.token, result.stop_now, self.max_model_len, self.detokenize)
                if request.finish_reason == "error":  # the tokenizer failed on stop strings: this request only
                    self.counters["num_errors"] += 1
            changed.append(request)
            if request.is_finished:
                self.counters["num_finished"] += 1
                self._release(request)
        return changed

    def abort(self, request: Request, reason: str = "abort", error: str | None = None) -> None:
        """End a request wherever it is and free its memory. Samples waiting to fork from its prompt start on
        their own instead (the first of them computes the prompt, the others fork from it)."""
        if request.is_finished:
            return
        request.finish(reason, error)
        self._release(request)
        pending = [child for child in request.forks if not child.is_finished]
        request.forks = []
        if pending:
            pending[0].forks = pending[1:]
            self.waiting.appendleft(pending[0])

    # ---- pieces -------------------------------------------------------------------------------------------
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

    def _should_swap(self, request: Request, num_blocks: int) -> bool:
        """Swap when asked to (or, in "auto", when moving the blocks out and back is estimated cheaper than
        recomputing the tokens) and the swap space has room; otherwise recompute."""
        mode = self.config.preemption_mode
        if mode == "recompute" or self.swap is None or num_blocks == 0 or self.swap.num_free < num_blocks:
            return False
        return mode == "swap" or self.costs.swap_is_cheaper(num_blocks * self.swap.bytes_per_block,
                                                            request.num_computed_tokens)

    def _preempt(self, request: Request, plan: StepPlan, allow_swap: bool = True) -> int:
        """Free the request's device blocks: the blocks holding its computed K/V go to host swap space, or its
        tokens are recomputed later. Swap copies run before this step's forward pass touches the freed blocks.
        Returns the tokens given back to the step's budget (the request may already have been placed)."""
        self.undo.touch(request)
        self.running.remove(request)
        returned = plan.remove(request)
        if allow_swap:  # nothing behind a window is saved: give it back first (as its own schedule would have)
            self.counters["num_blocks_released"] += self.kv.release_behind(request, request.num_computed_tokens)
        computed = blocks_needed(request.num_computed_tokens, self.kv.block_size)
        tables = request.block_tables
        released = [released_prefix(table[:computed]) for table in tables]  # a window's given-back blocks: not saved
        saved = computed * len(tables) - sum(released)
        if allow_swap and self._should_swap(request, saved):
            host = self.swap.allocate(saved)
            device = [b for table, gone in zip(tables, released) for b in table[gone:computed]]
            # swap-outs run before the copy-on-write copies: a block just copied-on-write is saved from its source
            plan.swap_out.append((self.kv.current_contents(device), host))
            swapped, at = [], 0  # each group's `computed` entries in turn
            for gone in released:
                swapped += [RELEASED] * gone + host[at:at + computed - gone]
                at += computed - gone
            request.swapped_blocks = swapped
            if request.state_slot >= 0:  # its state layers' state goes to host memory now, before any forward
                request.swapped_state = self.kv.states.save(request.state_slot)
            request.status = RequestStatus.SWAPPED
            self.counters["num_swap_outs"] += 1
            self.counters["num_blocks_swapped"] += saved
        else:
            self.counters["num_recomputed_tokens"] += request.num_computed_tokens
            request.num_computed_tokens = 0
            request.status = RequestStatus.PREEMPTED
            self._forget_stale(request)
        self.kv.free(request)
        request.num_preemptions += 1
        self.counters["num_preemptions"] += 1
        self.waiting.appendleft(request)
        plan.preempted.append(request)
        return returned

    def _swap_in(self, request: Request, plan: StepPlan, num_new: int) -> bool:
        """Give a swapped request device blocks for everything it holds plus its growth (not for the blocks its windows
        gave back), and queue the copy. `swapped_blocks` holds each KV group's entries in turn, as many per group."""
        host = [h for h in request.swapped_blocks if h != RELEASED]
        per_group, handed = len(request.swapped_blocks) // self.kv.num_groups, None
        kept = [sum(h != RELEASED for h in request.swapped_blocks[g * per_group:(g + 1) * per_group])
                for g in range(self.kv.num_groups)]
        # room for what comes back plus its first `num_new` tokens, and for the most it holds at once later
        first = len(host) + self.kv.num_groups * max(
            blocks_needed(request.num_computed_tokens + num_new, self.kv.block_size) - per_group, 0)
        need = sum(max(self.kv.group_bound(g, request.num_tokens), kept[g]) for g in range(self.kv.num_groups))
        if max(first, need) > self.kv.num_free_blocks:
            return False
        device = self.kv.allocate_blocks(len(host))
        handed = iter(device)
        request.block_tables = [
            [NULL_BLOCK if h == RELEASED else next(handed) for h in request.swapped_blocks[g:g + per_group]]
            for g in range(0, len(request.swapped_blocks), per_group)] if per_group else []
        if request.swapped_state is not None:
            self.kv.take_state_slot(request)
            self.kv.states.load(request.state_slot, request.swapped_state)
            request.swapped_state = None
        plan.swap_in.append((host, list(device)))  # a copy: the table grows on in this step
        request.swapped_blocks = []
        self.counters["num_swap_ins"] += 1
        return True

    def _admit(self, plan: StepPlan, budget: int) -> None:
        """Waiting requests in arrival order; the first that does not fit stops admission. A request whose
        prompt starts with blocks another request is computing right now waits for them to be published
        instead of computing them again (it keeps its place in the queue)."""
        position = 0
        while position < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[position]
            self.undo.touch(request)
            if request.status is not RequestStatus.SWAPPED and self._prefix_in_flight(request):
                position += 1
                continue
            if not self.config.enable_chunked_prefill and self._chunk(request, budget) > budget:
                break  # unchunked work that does not fit this step's budget waits for the next one
            if request.status is RequestStatus.SWAPPED:
                num_new = self._chunk(request, budget)
                if not self._swap_in(request, plan, num_new):
                    break
                if not self.kv.allocate_slots(request, num_new):  # _swap_in checked room for this chunk
                    raise RuntimeError(f"{request}: no room for its first chunk after swap-in")
            else:
                hits = self.kv.computed_blocks(request)
                if not self.kv.can_admit(request, hits):
                    break
                request.num_computed_tokens = self.kv.admit(request, hits)
                num_new = self._chunk(request, budget)
                if num_new > budget or not self.kv.allocate_slots(request, num_new):
                    self.kv.free(request)  # hand the hits back: nothing else changed
                    request.num_computed_tokens = 0
                    break
                self.kv.count_lookup(request, request.num_computed_tokens)
            del self.waiting[position]
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = request.num_computed_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            plan.add(request, num_new)
            budget -= num_new

    def _prefix_in_flight(self, request: Request) -> bool:
        """Whether a running prefill will publish at least two more of `request`'s leading blocks than the
        prefix cache holds now."""
        if not self.kv.enable_prefix_caching:
            return False
        prefilling = [r for r in self.running if r.num_computed_tokens < r.num_prompt_tokens and not r.stale_kv]
        if not prefilling:
            return False
        cached = len(self.kv.computed_blocks(request))
        return any(self.kv.common_prefix_blocks(request, other) >= cached + 2 for other in prefilling)

    def _hold_back(self, plan: StepPlan) -> None:
        """A sampling hook may make its requests sample only together (`controller.holds_back(requests)`, asked with
        those that would sample this step; the generate take-over's lockstep): held ones run all but their last token
        (nothing when that is all they had), which runs in a later step."""
        completing: dict[int, list[Request]] = {}
        for request, num_new in zip(plan.requests, plan.num_new_tokens):
            done = request.num_computed_tokens + num_new == request.num_tokens
            if done and hasattr(request.controller, "holds_back"):
                completing.setdefault(id(request.controller), []).append(request)
        held = {id(r) for group in completing.values() if group[0].controller.holds_back(group) for r in group}
        for i in reversed(range(len(plan.requests)) if held else ()):
            if id(plan.requests[i]) in held:
                plan.num_new_tokens[i] -= 1
                if not plan.num_new_tokens[i]:
                    del plan.requests[i], plan.num_new_tokens[i]

    def _plan_samples(self, plan: StepPlan) -> None:
        """Which requests sample this step: those whose every token is computed after it, and the waiting samples
        of a prompt computed for the first time (they fork from it and sample from the same logits row)."""
        forked = False
        for i, (request, num_new) in enumerate(zip(plan.requests, plan.num_new_tokens)):
            if request.num_computed_tokens + num_new != request.num_tokens:
                continue
            plan.sampled.append(request)
            plan.sample_sources.append(i)
            if request.forks and request.num_output_tokens == 0:
                for child in request.forks:
                    if not child.is_finished:
                        self.undo.touch(child)
                        plan.forks.append((request, child))
                        plan.sampled.append(child)
                        plan.sample_sources.append(i)
                        forked = True
        if forked:  # samples of one prompt side by side, in order (as HF's num_return_sequences rows are)
            order = sorted(range(len(plan.sampled)), key=lambda j: (plan.sampled[j].index,
                                                                     plan.sampled[j].sample_index))
            plan.sampled = [plan.sampled[j] for j in order]
            plan.sample_sources = [plan.sample_sources[j] for j in order]

    def _start_fork(self, parent: Request, child: Request) -> None:
        """Start `child` (another sample of the same prompt) from `parent`'s computed prompt: it shares every
        block, and the shared partly filled block is copied when one of them first writes to it."""
        if child in parent.forks:
            parent.forks.remove(child)
        self.kv.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = RequestStatus.RUNNING
        child.num_cached_tokens = parent.num_cached_tokens
        self.running.append(child)

    def _release(self, request: Request) -> None:
        """Release a finished request's memory, wherever it is."""
        self.undo.touch(request)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if request.finish_reason not in ("abort", "error"):
            for hook in self.release_hooks:
                hook(request)
        self.kv.free(request)
        if request.swapped_blocks:
            self.swap.free([h for h in request.swapped_blocks if h != RELEASED])
            request.swapped_blocks = []
        request.swapped_state = None


RELEASED = -1  # in a swapped request's `swapped_blocks`: a slot of its table that a sliding window gave back
