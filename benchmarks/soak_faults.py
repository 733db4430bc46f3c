"""The soak test's extra modes (benchmarks/soak.py --faults / --consumers N / --weight-changes; --fp8 is an engine
option): failures injected into engine steps, several consumers of one LLM at once, and weights changed in place
between the rounds of one long-lived LLM."""
from __future__ import annotations

import asyncio
import copy
import importlib
import random
import threading
from dataclasses import dataclass, field

import torch

from hf_paged import LLM
from hf_paged.kv import blocks_needed
from soak_draw import MAX_NEW, MAX_PROMPT, Spec

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


# ---- faults -------------------------------------------------------------------------------------------------------
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


# ---- several consumers of one LLM -----------------------------------------------------------------------------------
def finish_event(soak, ended: dict, spec: Spec, completion, aborted: set) -> None:
    """Record that sample `completion.index` of `spec` ended (a violation if it did before, or after its abort)."""
    key = (spec.rid, completion.index)
    if spec.rid in aborted:
        soak.violate("duplicated", f"{key} finished after its abort")
    elif key in ended:
        soak.violate("duplicated", f"{key} finished twice")
    ended[key] = completion


KINDS = ("generate", "stream", "step", "astream")


def split_consumers(rng: random.Random, specs: list, count: int) -> list[tuple[str, list]]:
    """`count` consumers: the four kinds first (in random order; at most one `step` loop: a second would be handed
    the first one's requests by design, and one `astream` event loop), then more `generate` / `stream` calls. The
    requests drawn to be aborted go to the step loop (the only one that aborts); the others are dealt at random."""
    kinds = list(KINDS)
    rng.shuffle(kinds)
    kinds = (kinds + [rng.choice(["generate", "stream"]) for _ in range(max(0, count - 4))])[:count]
    if "step" not in kinds:
        specs = [s for s in specs if s.abort_when is None] or specs[:1]
    shares = {i: [] for i in range(len(kinds))}
    for spec in specs:
        i = kinds.index("step") if spec.abort_when is not None else rng.randrange(len(kinds))
        shares[i].append(spec)
    return [(kind, shares[i]) for i, kind in enumerate(kinds) if shares[i]]


def _snapshots(soak, specs, outs, name) -> tuple[dict, set]:
    """A stream's snapshots (in order): exactly one final snapshot per prompt, none after it, for this call's
    prompts only. Auto ids are consecutive per call, so sorted ids map to the call's prompts in order."""
    last, done = {}, set()
    for out in outs:
        if out.request_id in done:
            soak.violate("duplicated", f"{name}: a snapshot of {out.request_id} after its final one")
        last[out.request_id] = out
        if out.finished:
            done.add(out.request_id)
    ids = list(last)
    if not all(i.isdigit() for i in ids) or len(ids) != len(specs):
        soak.violate("foreign", f"{name}: snapshots of {sorted(ids)[:8]} for {len(specs)} prompts of its own")
        return {}, set(ids)
    ended = {}
    for spec, rid in zip(specs, sorted(ids, key=int)):
        out = last[rid]
        if out.prompt_token_ids != spec.prompt:
            soak.violate("foreign", f"{name}: request {rid} is not its prompt for {spec.rid}")
        elif not out.finished:
            soak.violate("lost", f"{name}: {spec.rid} (request {rid}) never had its final snapshot")
        else:
            for completion in out.outputs:
                finish_event(soak, ended, spec, completion, set())
    return ended, set(ids)


def _consume(soak, llm, kind, specs, step_loop, name) -> tuple[dict, set, set]:
    """One consumer's run: (its samples' ends, the request ids it was given, the ids it aborted)."""
    prompts, params, priority = [s.prompt for s in specs], [s.params for s in specs], [s.priority for s in specs]
    if kind == "step":
        ended, aborted = step_loop(llm, specs)
        return ended, {s.rid for s in specs}, aborted
    if kind == "stream":
        return *_snapshots(soak, specs, list(llm.stream(prompts, params, priority=priority)), name), set()
    if kind == "astream":
        async def consume():
            return [out async for out in llm.astream(prompts, params, priority=priority)]

        return *_snapshots(soak, specs, asyncio.run(consume()), name), set()
    outs = llm.generate(prompts, params, use_tqdm=False, priority=priority)
    ended, ids = {}, {out.request_id for out in outs}
    if len(outs) != len(specs) or len(ids) != len(specs):
        soak.violate("lost", f"{name}: {len(outs)} outputs ({len(ids)} ids) for {len(specs)} prompts")
    for spec, out in zip(specs, outs):
        if out.prompt_token_ids != spec.prompt or not out.request_id.isdigit():
            soak.violate("foreign", f"{name}: output {out.request_id} is not its prompt for {spec.rid}")
            continue
        for completion in out.outputs:
            finish_event(soak, ended, spec, completion, set())
    return ended, ids, set()


def run_consumers(soak, llm, shares, step_loop, timeout: float = 300.0) -> tuple[dict, set]:
    """Every consumer in its own thread, started together on one LLM. Each must get exactly its own results (no
    foreign request id or prompt; the ids the consumers saw are disjoint); afterwards nothing is left: no group,
    no mark to collect, no claim. Returns every sample's end and the aborted request ids."""
    results: list = [None] * len(shares)
    barrier = threading.Barrier(len(shares))

    def work(i, kind, specs):
        name = f"consumer {i} ({kind}, {len(specs)} requests)"
        try:
            barrier.wait(timeout=30)
            results[i] = _consume(soak, llm, kind, specs, step_loop, name)
        except BaseException as e:  # noqa: BLE001 - reported as a violation of the round
            soak.violate("exceptions", f"{name}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(i, kind, specs), daemon=True)
               for i, (kind, specs) in enumerate(shares)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    if any(t.is_alive() for t in threads):
        soak.violate("lost", f"a consumer hung ({[k for (k, _), t in zip(shares, threads) if t.is_alive()]})")
        raise RuntimeError("a consumer hung: this LLM is abandoned")
    ended, aborted, seen = {}, set(), {}
    for (kind, _), result in zip(shares, results):
        if result is None:
            continue
        part, ids, gone = result
        aborted |= gone
        for rid in ids:
            if rid in seen:
                soak.violate("foreign", f"request {rid} went to a {seen[rid]} and to a {kind}")
            seen[rid] = kind
        ended.update(part)
    engine = llm.engine
    if engine.groups or engine.dirty or llm._claimed:
        soak.violate("leaks", f"after the consumers: groups {list(engine.groups)[:5]}, marks {list(engine.dirty)[:5]}"
                              f", claims {sorted(llm._claimed)[:5]}")
    return ended, aborted


# ---- weight changes -------------------------------------------------------------------------------------------------
@dataclass
class Session:
    """--weight-changes: one LLM kept over several rounds (prefix caching on) on its own copy of the model, whose
    weights change before every round after the first; `reference` is None until built for the weights of now."""

    model: torch.nn.Module
    llm: LLM
    options: dict
    length: int
    rounds: int = 0
    reference: LLM | None = None
    change: str = "none yet"  # the latest weight change
    last: list[Spec] = field(default_factory=list)  # the last requests that finished in the round before

    @property
    def fp8(self) -> bool:
        return "kv_cache_dtype" in self.options

    def begin_round(self, soak, rng: random.Random, reference_engine, number: int) -> list[Spec]:
        """Before each round after the first the weights change (counted); then the reference of the weights of now
        (an fp8 session's with the scales its LLM fixed at its start) is built if there is none. Returns the requests
        to send first: the last ones of the round before again, whose blocks the prefix cache most likely still
        holds (computed with the old weights: they must not be hit)."""
        if self.rounds:
            self.change = change_weights(self.model, self.llm, rng)
            soak.counts["weight_changes"] += 1
            self.reference = None
        if self.reference is None:
            cache = self.llm.engine.memory.cache
            self.reference = reference_engine(self.model, scales=cache.kv_scales if self.fp8 else None)
        soak.counts["weight_rounds"] += 1
        return [Spec(f"r{number}-again{i}", s.prompt, s.params, s.priority) for i, s in enumerate(self.last)]

    def end_round(self, done: list[Spec]) -> None:
        self.rounds += 1
        self.last = done[-4:]


@dataclass
class Context:
    """What lasts across a soak's rounds: the model, its reference engines, the extra modes, the weight session."""

    model: torch.nn.Module
    reference: LLM
    faults: bool = False
    consumers: int = 0
    weight_changes: bool = False
    fp8: bool = False
    fp8_reference: LLM | None = None
    session: Session | None = None


def start_session(model, options: dict, fp8: bool, rounds: int) -> Session:
    """A long-lived LLM for --weight-changes on a copy of the model: the round's pressured options with prefix
    caching on and a pool that fits the biggest request any round can draw."""
    options = dict(options, enable_prefix_caching=True,
                   num_blocks=max(options["num_blocks"], blocks_needed(MAX_PROMPT + MAX_NEW, options["block_size"])))
    if fp8:
        options["kv_cache_dtype"] = "fp8_e4m3"
    model = copy.deepcopy(model)
    return Session(model, LLM(model, **options), options, rounds)


WEIGHT_CHANGES = ("scale", "one_tensor", "sgd", "data_and_reset")


def change_weights(model: torch.nn.Module, llm, rng: random.Random) -> str:
    """Change `model`'s weights in place, one of: every tensor scaled (`mul_` under no_grad), one tensor given noise,
    an SGD step on a random batch, or noise written through `.data` (invisible to the version counters) followed by
    `llm.reset_prefix_cache()`. Each is big (every tensor scaled by 0.5-1.5, noise of 0.5-1 standard deviation, a
    step of 20% of the weights' norm), so that a stale prefix hit shows in the tokens."""
    kind = rng.choice(WEIGHT_CHANGES)
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    params = [p for p in model.parameters()]

    def noise(p, size):  # a one-element tensor (a learned scalar) has no spread: its own magnitude instead
        spread = p.detach().float().std().item() if p.numel() > 1 else p.detach().float().abs().item()
        return torch.randn(p.shape, generator=generator, dtype=p.dtype) * size * spread

    if kind == "sgd":
        optimizer = torch.optim.SGD(params, lr=1.0)
        tokens = torch.randint(3, model.config.vocab_size, (2, 24), generator=generator)
        loss = torch.nn.functional.cross_entropy(model(tokens).logits[:, :-1].flatten(0, 1).float(),
                                                 tokens[:, 1:].flatten())
        loss.backward()
        with torch.no_grad():  # a step of 20% of the weights' norm, whatever the gradients' size
            norm = torch.sqrt(sum(p.grad.float().pow(2).sum() for p in params if p.grad is not None)).item()
            scale = sum(p.float().pow(2).sum() for p in params).sqrt().item()
        for group in optimizer.param_groups:
            group["lr"] = 0.2 * scale / max(norm, 1e-12)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    else:
        with torch.no_grad():
            if kind == "scale":
                for p in params:
                    p.mul_(rng.uniform(0.5, 1.5))
            elif kind == "one_tensor":
                p = rng.choice([p for p in params if p.dim() == 2])
                p.add_(noise(p, 1.0))
            else:
                for p in params:
                    p.data.add_(noise(p, 0.5))
                llm.reset_prefix_cache()
    return kind
