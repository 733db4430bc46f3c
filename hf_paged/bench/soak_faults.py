"""Failures injected into engine steps for the soak test (soak.py --faults): every point of a step a failure can
come from, and one round's faults, armed one at a time inside `llm.step()` only."""
from __future__ import annotations

import importlib
import random
from dataclasses import dataclass, field

# every point of a step a failure can come from (module, attribute path): the soak injects faults there and
# tests/test_step_atomic.py proves each atomic
POINTS = [
    ("hf_paged.engine.scheduler", "Scheduler.schedule"),
    ("hf_paged.kv.manager", "KVCacheManager.allocate_slots"),
    ("hf_paged.kv.manager", "KVCacheManager.computed_blocks"),
    ("hf_paged.kv.manager", "KVCacheManager.admit"),
    ("hf_paged.kv.manager", "KVCacheManager.free"),
    ("hf_paged.kv.block_pool", "BlockPool.allocate"),
    ("hf_paged.kv.swap", "SwapPool.allocate"),
    ("hf_paged.engine.scheduler", "Scheduler._preempt"),
    ("hf_paged.engine.scheduler", "Scheduler._swap_in"),
    ("hf_paged.engine.memory", "KVMemory.apply"),
    ("hf_paged.kv.swap", "SwapPool.swap_out"),
    ("hf_paged.kv.swap", "SwapPool.swap_in"),
    ("hf_paged.engine.memory", "KVMemory.clear"),
    ("hf_paged.engine.memory", "copy_blocks"),
    ("hf_paged.engine.runner", "ModelRunner.execute"),
    ("hf_paged.engine.runner", "sample_step"),
    ("hf_paged.sampling", "Sampler.__call__"),
    ("hf_paged.engine.scheduler", "Scheduler.update"),
    ("hf_paged.engine.scheduler", "apply_stop_rules"),
    ("hf_paged.kv.manager", "KVCacheManager.cache_full_blocks"),
    ("hf_paged.engine.scheduler", "Scheduler._start_fork"),
    ("hf_paged.engine.scheduler", "Scheduler._release"),
    ("hf_paged.request", "Request.finish"),
]
# the points only a model with state layers reaches (kv/state.py: slots taken at admission / fork / swap-in, a fork's
# copy, swap-out's save to host and swap-in's load, the forward pass's reads and writes, free; the prefix-hit
# checkpoints: looked up, reserved for a step's block boundaries, restored into a slot): the soak adds them to POINTS
# on such models (the step matrix of tests/test_step_atomic.py runs a Llama, which never calls them)
STATE_POINTS = [
    ("hf_paged.kv.state", "StateSlots.allocate"),
    ("hf_paged.kv.state", "StateSlots.free"),
    ("hf_paged.kv.state", "StateSlots.copy"),
    ("hf_paged.kv.state", "StateSlots.save"),
    ("hf_paged.kv.state", "StateSlots.load"),
    ("hf_paged.kv.state", "StateSlots.read"),
    ("hf_paged.kv.state", "StateSlots.write"),
    ("hf_paged.kv.state", "StateSlots.copy_from"),
    ("hf_paged.kv.state", "StateCheckpoints.find"),
    ("hf_paged.kv.state", "StateCheckpoints.reserve"),
    ("hf_paged.kv.manager", "KVCacheManager.reserve_checkpoints"),
]


class InjectedFault(Exception):
    """What an injected failure raises when it is an Exception (else it is a KeyboardInterrupt)."""


@dataclass
class Fault:
    point: tuple[str, str]
    at: int  # raise on the at-th call of the point counted from the step `start` on
    when: str  # "before" the call does its work, or "after"
    error: BaseException
    start: int  # the driver's step from which calls are counted
    calls: int = 0


@dataclass
class Faults:
    """One round's faults, one at a time: the current one's point is wrapped while the round runs, and raises only
    inside `llm.step()` calls of the driver (`armed`), never in abort / add_request nor in the reference engine.
    When it has fired the next one (if any) is armed from a few steps later."""

    rng: random.Random
    left: int  # faults still to inject after the current one
    current: Fault | None = None
    armed: bool = False
    injected: int = 0
    hit: list[str] = field(default_factory=list)  # "path when error" of each fault that fired
    points: list = field(default_factory=lambda: POINTS)  # where faults are drawn from
    _restore: tuple | None = None

    @classmethod
    def draw(cls, rng: random.Random, points: list | None = None) -> "Faults":
        faults = cls(rng, rng.choice([0, 0, 1, 2]), points=points or POINTS)
        faults._next(rng.choice([0, rng.randint(0, 8), rng.randint(0, 40)]))
        return faults

    def _next(self, start: int) -> None:
        rng = self.rng
        error = InjectedFault("injected") if rng.random() < 0.5 else KeyboardInterrupt()
        self.current = Fault(rng.choice(self.points), rng.choice([1, 1, 2, 3, rng.randint(1, 12)]),
                             rng.choice(["before", "after"]), error, start)
        self.injected += 1
        self._install()

    def _install(self) -> None:
        fault = self.current
        module_name, path = fault.point
        owner_name, _, name = path.rpartition(".")
        module = importlib.import_module(module_name)
        owner = getattr(module, owner_name) if owner_name else module
        original, own = getattr(owner, name), name in vars(owner)
        this = self

        def wrapped(*args, **kwargs):
            fire = this.armed and this.current is fault and fault.calls + 1 == fault.at
            if this.armed and this.current is fault:
                fault.calls += 1
            if fire and fault.when == "before":
                raise fault.error
            result = original(*args, **kwargs)
            if fire:
                raise fault.error
            return result

        setattr(owner, name, wrapped)
        self._restore = (owner, name, original, own)

    def uninstall(self) -> None:
        if self._restore is not None:
            owner, name, original, own = self._restore
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
            self._restore = None
        self.armed = False

    def finish(self, soak) -> list[str]:
        """Take the wrapper off and count. Returns the faults that fired."""
        self.uninstall()
        soak.counts["fault_rounds"] += 1
        soak.counts["faults_injected"] += self.injected
        soak.counts["faults_hit"] += len(self.hit)
        soak.fault_points.update(self.hit)
        return self.hit

    def step(self, llm, step: int) -> list:
        """`llm.step()` with the current fault armed from its start step on; the injected error (if it fires) is
        caught and counted, and the next fault installed; no outputs then (the step did nothing)."""
        self.armed = self.current is not None and step >= self.current.start
        try:
            return llm.step()
        except BaseException as e:  # noqa: BLE001 - the injected error, whatever its class; others propagate
            if self.current is None or e is not self.current.error:
                raise
            fault = self.current
            self.hit.append(f"{fault.point[1]} {fault.when} {type(e).__name__}")
            self.uninstall()
            self.current = None
            if self.left:
                self.left -= 1
                self._next(step + self.rng.choice([0, 1, 3, 10]))
            return []
        finally:
            self.armed = False
