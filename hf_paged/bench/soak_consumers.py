"""Several consumers of one LLM at once for the soak test (soak.py --consumers N): generate, stream, a step loop
and astream in their own threads, each of which must get exactly its own results; and `finish_event`, how any
round records that a sample ended."""
from __future__ import annotations

import asyncio
import random
import threading

from .soak_draw import Spec


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
    foreign request id or prompt; the ids the consumers saw are disjoint); afterwards nothing is left: no parent request,
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
    if engine.parents or engine.dirty or llm._claimed:
        soak.violate("leaks", f"after the consumers: parents {list(engine.parents)[:5]}, marks {list(engine.dirty)[:5]}"
                              f", claims {sorted(llm._claimed)[:5]}")
    return ended, aborted
