"""A step is all or nothing: what the scheduler's step changed, and how to put it back if the step fails."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..request import Request

if TYPE_CHECKING:
    from .scheduler import Scheduler


class StepUndo:
    """`begin` before a step's four calls (schedule, block moves, run, update), `commit` after they all succeeded,
    `rollback` if any raised (Exception or BaseException): the scheduler's queues, counters and measured rate, every
    request the step touched (`Request.snapshot`, taken on the first change: the scheduler calls `touch` before it
    changes a request), the KV manager with its block pool (an undo journal) and the swap space's free list are put
    back exactly as they were at `begin`.

    Device memory cannot be put back: blocks handed out during the failed step may have been cleared, copied into,
    swapped into or written by the forward pass. They leave the prefix map and count as not clean (`kv.rollback`);
    a request that held one before the step (it was freed and handed out again within it) is recomputed from its
    tokens, and the block holding a running request's next slot is cleared before its next use elsewhere. State
    slots are written in place by the forward pass: a running request holding one is recomputed too.
    """

    def __init__(self, scheduler: "Scheduler"):
        self.scheduler = scheduler
        self._saved: tuple | None = None  # the queues, counters and rate as they were
        self._touched: dict[int, tuple[Request, tuple]] | None = None  # requests changed this step, as they were
        self.broken: str | None = None  # why the engine's state is unknown (a failure interrupted `rollback`)

    def begin(self) -> None:
        s = self.scheduler
        self._saved = (list(s.waiting), list(s.running), dict(s.counters), s.costs.prefill_tokens_per_s)
        self._touched = {}
        s.kv.begin()
        if s.swap is not None:
            s.swap.begin()

    def touch(self, request: Request) -> None:
        """Called before a step changes `request`."""
        if self._touched is not None and id(request) not in self._touched:
            self._touched[id(request)] = (request, request.snapshot())

    def commit(self) -> None:
        s = self.scheduler
        self._saved = self._touched = None
        s.kv.commit()
        if s.swap is not None:
            s.swap.commit()

    def rollback(self) -> None:
        """Undo the step. Every part runs even if another raised (a second Ctrl-C); if one did, the state is not
        known to be whole, so `broken` says why (the engine refuses to step again) and the first error propagates."""
        if self._saved is None:
            return
        s = self.scheduler
        waiting, running, counters, rate = self._saved
        touched = self._touched
        self._saved = self._touched = None
        failures: list[BaseException] = []

        def part(action) -> None:
            try:
                action()
            except BaseException as e:  # noqa: BLE001 - every part must run; the first failure is raised below
                failures.append(e)

        part(lambda: self._restore_queues(waiting, running, counters, rate))
        for request, saved in touched.values():
            part(lambda request=request, saved=saved: request.restore(saved))
        if s.swap is not None:
            part(s.swap.rollback)
        written: set[int] = set()
        part(lambda: written.update(s.kv.rollback()))
        part(lambda: self._distrust(written))
        if failures:
            self.broken = (f"undoing a failed step was interrupted ({type(failures[0]).__name__}); its requests and "
                           f"blocks are in an unknown state")
            raise failures[0]

    def _restore_queues(self, waiting, running, counters, rate) -> None:
        s = self.scheduler
        s.waiting.clear()
        s.waiting.extend(waiting)
        s.running[:] = running
        s.counters.clear()
        s.counters.update(counters)
        s.costs.prefill_tokens_per_s = rate

    def _distrust(self, written: set[int]) -> None:
        s = self.scheduler
        for request in list(s.running):
            # the forward pass may have written past its computed tokens: that block is cleared when next handed out
            # (also when the request is recomputed below and its blocks go back to the pool)
            s.kv.distrust_tail(request)
            if request.state_slot >= 0 and request.num_computed_tokens:  # its state may hold this step's tokens
                s.recompute(request)
            elif any(block in written for table in request.block_tables for block in table):
                s.recompute(request)
