"""Choosing a fast path by timing it on real calls: the trial, the rule that picks, and a table of both.

Every fast path of hf_paged that has a plain alternative (the few-row products of `model/linear_choice`, the CPU
decode attention of `attention/decode_choice`, the prompt attention of `attention/prefill_kernel`, a mixture's
expert products in `model/expert_products`) earns its place on
the machine it runs on: the first calls of each key (a shape, a dtype, a thread count, ...) run the candidates in
turn, each call timed whole where it runs (inside the real forward, with the caches as a real step leaves them), and
the fastest is kept for the rest of the process.

Invariants:
- `Trial`: every block of as many calls as candidates runs each once, the order rotating from block to block (so
  that keys called alternately, such as layers of one shape, all meet every candidate). The first call of each
  candidate is a warm-up (not counted). After one counted call each, a candidate whose better call (warm-up or
  counted) is more than `DROP` (2; `LONG_DROP`, 1.2, where the leader's better call takes `LONG_S` or more: timer
  and scheduling noise are a small part of such a call, and each further round costs much) times the leader's is
  out; once every candidate left has `SAMPLES` counted calls, each one's time is the median of them (a dropped one:
  its better call) and the trial is complete. So a key costs (1 + SAMPLES) calls of each candidate, fewer of the
  clear losers.
- `fastest`: the baseline (the plain path) is kept unless another candidate measured more than `MARGIN` (5 %)
  faster, so near-ties (where noise would pick either, run to run) stay on the reference; else the least time, the
  first candidate given among equals.
- `Table`: a key has at most one open trial and, once chosen, one `Choice` that never changes until `clear()`; both
  are only changed under `lock` (re-entrant: a table built on this one may call these methods while holding it).
  Reading `choices` needs no lock. A call whose candidate was dropped, or whose key was chosen meanwhile (another
  thread's call completed the trial), only adds to the time the trial cost.
- Every candidate computes the same result up to the order of floating-point sums: measuring never changes what a
  call returns beyond rounding.
- Candidates that copy the calling module's weights (`next_call_for`'s `copying`: a transposed or joined copy of a
  projection) run in a trial only on the first `COPY_HOLDERS` modules of its key that call: a key is usually one
  weight shape that every layer has (24 layers of a Qwen2.5-0.5B-sized model), and copies of every layer's weights
  for every such candidate cost seconds on a first call (most of them dropped once the trial is over). Those modules'
  calls take the candidate with the fewest calls (the copying ones catch up there), the other modules' calls the
  rest, or none (`SKIP`: the caller runs its baseline untimed). A module that has not called for twice as many module
  calls as the trial has callers (each call counted once, however many names it passed over) gives its place up (a
  model no longer run, another model of the same shapes now), so a trial always ends while its key is called. The
  chosen candidate's copies are made where it is called.
- `clock` is read through this module (tests put a fake clock here).
"""
from __future__ import annotations

import math
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

SAMPLES = 5  # counted calls of each candidate before a choice (after one warm-up call each)
DROP = 2.0  # a candidate this many times slower than the leader in its warm-up and first counted call is out
LONG_DROP, LONG_S = 1.2, 0.005  # ... or this many times, where the leader's call takes LONG_S or more
class Recorded:
    """How many trial calls every table of the process has recorded (`Table.record`; state_fast's own timing too):
    a stretch of work during which it did not move ran only chosen paths (`model.step_choice` times such steps)."""
    calls = 0


recorded = Recorded()
MARGIN = 0.05  # a fast path must beat the baseline by more than this fraction of its time to be chosen
COPY_HOLDERS = 4  # modules of a key whose trial calls may make copies of their weights (module doc)
SKIP = "skip"  # `next_call_for`: this call runs the baseline, untimed
clock = time.perf_counter


@dataclass
class Choice:
    """What one key runs: `path`'s name, every candidate's measured seconds (the median of its counted calls; a
    candidate dropped early: its better call; empty where nothing was timed), where it came from ("measured", or
    what chose it without timing), and the time the trial's calls took in all (warm-ups included)."""
    path: str
    seconds: dict[str, float]
    source: str = "measured"
    probe_seconds: float = 0.0


@dataclass
class Trial:
    """A key being measured on real calls (module invariants): `next()` names the candidate the next call runs,
    `add()` takes that call's time and gives, once the trial is complete, each candidate's seconds."""
    products: dict[str, Any]  # name -> what the caller runs for it, in tie-break order
    names: list[str] = field(default_factory=list)  # candidates still in
    warm: dict[str, float] = field(default_factory=dict)  # each candidate's warm-up call
    times: dict[str, list[float]] = field(default_factory=dict)  # each candidate's counted calls
    calls: int = 0
    spent: float = 0.0
    pruned: bool = False
    visits: int = 0  # calls of next_call_for (one per module call; `calls` also counts names passed over)
    holders: dict = field(default_factory=dict)  # module (id) whose calls run the copying candidates -> its last visit
    callers: dict = field(default_factory=dict)  # every module (id) that called -> its last visit

    def __post_init__(self):
        self.names = list(self.products)
        self.times = {name: [] for name in self.products}

    def next(self) -> str:
        n = len(self.names)  # calls c, c+1, ... c+n-1 of one block (same c // n) run every candidate once
        name = self.names[(self.calls + self.calls // n) % n]
        self.calls += 1
        return name

    def count(self, name: str) -> int:
        """Calls of candidate `name` recorded so far (its warm-up included)."""
        return (name in self.warm) + len(self.times[name])

    def _best(self, name: str) -> float:
        return min([self.warm.get(name, math.inf)] + self.times[name])

    def add(self, name: str, seconds: float) -> dict[str, float] | None:
        """Record one call of `name`; each candidate's seconds once every candidate left has SAMPLES counted calls
        (medians; a dropped one: its better call), else None."""
        self.spent += seconds
        if name not in self.names:
            return None  # dropped meanwhile (another thread's call)
        if name not in self.warm:
            self.warm[name] = seconds
        else:
            self.times[name].append(seconds)
        if not self.pruned and all(self.times[n] for n in self.names):
            self.pruned = True  # two calls each: one slow call by chance (a busy machine) does not drop a candidate
            lead = min(self._best(n) for n in self.names)
            drop = LONG_DROP if lead >= LONG_S else DROP
            self.names = [n for n in self.names if self._best(n) <= drop * lead]
        if any(len(self.times[n]) < SAMPLES for n in self.names):
            return None
        return {name: (statistics.median(self.times[name]) if name in self.names else self._best(name))
                for name in self.products if name in self.warm}


def fastest(seconds: dict[str, float], baseline: str) -> str:
    """`baseline` unless another candidate took less than (1 - MARGIN) of its time; then the one with the least time,
    the first one given among equals. Without the baseline among them: the least time."""
    best = min(seconds, key=lambda name: (seconds[name], list(seconds).index(name)))
    if baseline in seconds and seconds[best] >= (1 - MARGIN) * seconds[baseline]:
        return baseline
    return best


class Table:
    """Keys -> their `Choice` (`choices`) and the trials still open (`trials`); module invariants."""

    def __init__(self, baseline: str):
        self.baseline = baseline
        self.choices: dict[Hashable, Choice] = {}
        self.trials: dict[Hashable, Trial] = {}
        self.lock = threading.RLock()

    def settle(self, key: Hashable, choice: Choice, products: dict[str, Any] | None = None) -> Choice:
        """`choice` for `key`, made without a trial (forced, only one candidate, read from disk; `products` as for
        `next_call`), unless one is made already: the one kept."""
        with self.lock:
            if key not in self.choices:
                self.decided(key, choice, products or {})  # first: a hook that raises leaves nothing half-made
                self.trials.pop(key, None)
                self.choices[key] = choice
            return self.choices[key]

    def next_call(self, key: Hashable, products: dict[str, Any]) -> str | None:
        """The candidate the next call of `key` runs and times for its trial (opened now with `products`, name ->
        what runs, in tie-break order, the same on every call of the key), or None where the choice is made."""
        with self.lock:
            if key in self.choices:
                return None
            trial = self.trials.get(key)
            if trial is None:
                trial = self.trials[key] = Trial(dict(products))
            return trial.next()

    def next_call_for(self, key: Hashable, products: dict[str, Any], holder: int, copying: frozenset) -> str | None:
        """`next_call` for a call of module `holder` (its id) where the candidates in `copying` copy the module's
        weights (module doc). A module that holds (or now takes) one of the trial's COPY_HOLDERS places: the candidate
        with the fewest recorded calls (the next in turn among equals), which makes up for the copying candidates'
        calls on other modules; any other module: a candidate that copies nothing, or SKIP where none is left."""
        with self.lock:
            name = self.next_call(key, products)
            trial = self.trials.get(key)
            if name is None or trial is None or not copying:
                return name
            left = [n for n in trial.names if n in copying]
            trial.visits += 1
            trial.callers[holder] = trial.visits
            if holder not in trial.holders:  # places of modules that stopped calling (another model's) are free
                for gone in [h for h, last in trial.holders.items() if trial.visits - last > 2 * len(trial.callers)]:
                    del trial.holders[gone]
            if holder in trial.holders or (left and len(trial.holders) < COPY_HOLDERS):
                trial.holders[holder] = trial.visits  # the fewest calls first (the copying ones run here only)
                return min(trial.names, key=lambda n: (trial.count(n), n != name))
            for _ in range(2 * len(trial.names)):  # any 2n calls in a row hold a whole block: every candidate
                if name not in copying:
                    return name
                name = trial.next()
            return SKIP

    def record(self, key: Hashable, name: str, seconds: float, baseline: str | None = None) -> Choice | None:
        """One trial call's time (`next_call` gave `name`); the choice where this call completed the trial. The
        baseline (the table's unless given) is kept unless another candidate left in the trial beat it by MARGIN."""
        with self.lock:
            trial = self.trials.get(key)
            if trial is None or key in self.choices:
                return None
            recorded.calls += 1
            each = trial.add(name, seconds)
            if each is None:
                return None
            left = {n: each[n] for n in trial.names}
            choice = Choice(fastest(left, baseline or self.baseline), each, probe_seconds=trial.spent)
            self.decided(key, choice, trial.products)  # first: a hook that raises leaves the trial as it was
            del self.trials[key]
            self.choices[key] = choice
            return choice

    def timed(self, key: Hashable, name: str | None, run: Callable[[], Any], baseline: str | None = None,
              **record_args) -> tuple[Any, Choice | None]:
        """`run()` for a call `next_call` named `name`: timed and recorded (with `record_args`) where it is a trial
        call (`name` not None). Its result, and the choice where its time completed the trial."""
        if name is None:
            return run(), None
        started = clock()
        result = run()
        return result, self.record(key, name, clock() - started, baseline, **record_args)

    def decided(self, key: Hashable, choice: Choice, products: dict[str, Any]) -> None:
        """Called under `lock` once `key`'s choice is made, with what each candidate runs (tables built on this
        one keep more)."""

    def clear(self) -> None:
        """Forget every choice and trial (the next calls of each key measure again)."""
        with self.lock:
            self.choices.clear()
            self.trials.clear()
