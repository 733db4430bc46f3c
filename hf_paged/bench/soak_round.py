"""One round of the soak test (soak.py): its requests streamed in through add_request / step / abort (some steps
failing, soak_faults.py), sent through `LLM.generate`, or split between consumers (soak_consumers.py); then every
check of soak_check.py on what came out."""
from __future__ import annotations

import random

from hf_paged import LLM

from .soak_check import Soak, compare, has_state, model_name, reference_engine
from .soak_consumers import finish_event, run_consumers, split_consumers
from .soak_draw import Spec, check_tokens, draw_engine, draw_round
from .soak_faults import POINTS, STATE_POINTS, Faults
from .soak_sessions import Context, start_session

# how often a round takes each extra mode that is on ("session": a weight-change session starts when none runs)
RATES = {"fp8": 0.35, "consumers": 0.35, "session": 0.4, "faults": 0.6}


def run_stream(soak: Soak, llm: LLM, specs: list[Spec], rng: random.Random, faults: Faults | None = None
               ) -> tuple[dict, set]:
    """add_request / step / abort, with a few new requests before each step (`faults`: their steps may fail)."""
    by_id = {s.rid: s for s in specs}
    pending, live, ended, aborted, added_at, received = list(specs), {}, {}, set(), {}, {}
    step = 0
    while pending or llm.has_unfinished_requests():
        arrivals = rng.choice([0, 1, 1, 2, 4, 8]) if llm.has_unfinished_requests() else max(1, rng.randint(0, 6))
        for spec in pending[:arrivals]:
            llm.add_request(spec.prompt, spec.params, request_id=spec.rid, priority=spec.priority)
            live[spec.rid], added_at[spec.rid] = spec, step
        del pending[:arrivals]
        for rid, spec in list(live.items()):
            parent = llm.engine.parents.get(rid)
            states = {r.status.value for r in parent.samples} if parent is not None else set()
            if (spec.abort_when == "queued" and step - added_at[rid] >= spec.abort_after) or \
                    (spec.abort_when == "running" and received.get(rid, 0) >= spec.abort_after) or \
                    (spec.abort_when == "preempted" and states & {"preempted", "swapped"}):
                if llm.abort(rid):
                    aborted.add(rid)
                    soak.counts["aborts"] += 1
                    for state in states & {"running", "preempted", "swapped"}:
                        soak.counts[f"aborts_{state}"] += 1
                else:
                    soak.violate("lost", f"{rid} was live but abort() did not know it")
                del live[rid]
        if not llm.has_unfinished_requests():
            continue
        for out in faults.step(llm, step) if faults is not None else llm.step():
            spec = by_id.get(out.request_id)
            if spec is None:
                soak.violate("foreign", f"step() returned {out.request_id}, a request of another caller")
                continue
            received[spec.rid] = received.get(spec.rid, 0) + 1
            for completion in out.outputs:
                if completion.finish_reason is not None:
                    finish_event(soak, ended, spec, completion, aborted)
            if all((spec.rid, i) in ended for i in range(spec.params.n)):
                live.pop(spec.rid, None)
        step += 1
    if llm.abort("never-added") or any(llm.abort(s.rid) for s in specs):
        soak.violate("leaks", "abort() still knows a request after the round")
    return ended, aborted


def run_batch(soak: Soak, llm: LLM, specs: list[Spec]) -> tuple[dict, set]:
    outs = llm.generate([s.prompt for s in specs], [s.params for s in specs], use_tqdm=False,
                        priority=[s.priority for s in specs])
    if len(outs) != len(specs):
        soak.violate("lost", f"generate returned {len(outs)} outputs for {len(specs)} prompts")
    ended = {}
    for spec, out in zip(specs, outs):
        if len(out.outputs) != spec.params.n:
            soak.violate("lost", f"{spec.rid}: {len(out.outputs)} samples for n={spec.params.n}")
        for completion in out.outputs:
            finish_event(soak, ended, spec, completion, set())
    return ended, set()


def run_round(soak: Soak, ctx: Context, number: int, systems, size: int) -> None:
    # each round draws from its own generator: "auto" rounds decide swap vs recompute from measured timings, so
    # how many steps (and arrival draws) a round takes may vary, and must not change the rounds after it
    rng = random.Random(f"{soak.seed}/{number}")
    specs = draw_round(rng, systems, number, size)
    options = draw_engine(rng, ctx.model, number, specs)
    if has_state(ctx.model):  # drawn apart: the other draws stay those of any model
        options.update(draw_state_options(random.Random(f"{soak.seed}/{number}/state")))
    extra = random.Random(f"{soak.seed}/{number}/modes")  # the extra modes' draws (none unless one is on)
    fp8 = ctx.fp8 and extra.random() < RATES["fp8"]
    if fp8 and ctx.fp8 == "refused":  # the engine refuses fp8 KV on this model: the round runs unquantized
        fp8 = False
        soak.counts["fp8_skipped"] += 1
    consumers = ctx.consumers > 1 and extra.random() < RATES["consumers"]
    if ctx.weight_changes and ctx.session is None and extra.random() < RATES["session"]:
        ctx.session = start_session(ctx.model, options, fp8, extra.randint(3, 6))
    session, model = ctx.session, ctx.model
    if session is not None:
        specs = session.begin_round(soak, extra, reference_engine, number) + specs
        model, llm, reference, fp8 = session.model, session.llm, session.reference, session.fp8
        options = dict(session.options, model=model_name(model),
                       weights=f"version {session.rounds} ({session.change})")
    else:
        if fp8:
            options["kv_cache_dtype"] = "fp8_e4m3"
        llm = LLM(model, **options)
        options = dict(options, model=model_name(model))
        if fp8 and ctx.fp8_reference is None:
            ctx.fp8_reference = reference_engine(model, fp8=True)
        reference = ctx.fp8_reference if fp8 else ctx.reference
        if fp8 and llm.engine.memory.cache.kv_scales != reference.engine.memory.cache.kv_scales:
            soak.violate("mismatches", f"round {number}: fp8 scales differ from the reference engine's ({options})")
    soak.counts["fp8_rounds"] += fp8
    before = llm.stats()
    stream = rng.random() < 0.75
    faults = None
    if ctx.faults and stream and not consumers and extra.random() < RATES["faults"]:
        faults = Faults.draw(extra, POINTS + STATE_POINTS if has_state(ctx.model) else POINTS)
    soak.counts["consumer_rounds" if consumers else "stream_rounds" if stream else "batch_rounds"] += 1
    if not stream and not consumers:  # nothing to abort through generate()
        specs = [s for s in specs if s.abort_when is None] or specs[:1]
    try:
        if consumers:
            shares = split_consumers(extra, specs, ctx.consumers)
            specs = [spec for _, share in shares for spec in share]
            step_rng = random.Random(f"{soak.seed}/{number}/step")
            ended, aborted = run_consumers(soak, llm, shares, lambda llm, specs: run_stream(soak, llm, specs, step_rng))
        elif stream:
            ended, aborted = run_stream(soak, llm, specs, rng, faults)
        else:
            ended, aborted = run_batch(soak, llm, specs)
    finally:
        if faults is not None:  # the faults that fired are named in this round's violations
            options = dict(options, faults=faults.finish(soak))
    try:
        llm.engine.check_idle()
        if llm.engine.parents or llm.engine.dirty:
            raise AssertionError(f"{len(llm.engine.parents)} request parents, {len(llm.engine.dirty)} marks left behind")
    except AssertionError as e:
        soak.violate("leaks", f"round {number} ({options}): {e}")
    stats = llm.stats()
    for name, key in (("steps", "num_steps"), ("preemptions", "num_preemptions"), ("swap_outs", "num_swap_outs"),
                      ("swap_ins", "num_swap_ins"), ("recomputed_tokens", "num_recomputed_tokens"),
                      ("prefix_hit_tokens", "prefix_cache_hit_tokens"), ("generated_tokens", "num_generated_tokens")):
        soak.counts[name] += stats[key] - before[key]
    soak.counts["requests"] += len(specs)
    soak.counts["samples"] += sum(s.params.n for s in specs)
    done = [s for s in specs if s.rid not in aborted]
    for spec in done:
        for i in range(spec.params.n):
            if (spec.rid, i) not in ended:
                soak.violate("lost", f"{spec.rid}/{i} never finished (round {number}, {options})")
            else:
                check_tokens(soak, spec, ended[(spec.rid, i)])
    compare(soak, reference, done, ended, options, model)
    soak.counts["rounds"] += 1
    if session is not None:
        session.end_round(done)
        ctx.session = ctx.session if session.rounds < session.length else None


def draw_state_options(rng: random.Random) -> dict:
    """A state model's prefix-hit checkpoints: how many are kept (None: the engine's default, 2 x max_num_seqs; 0: no
    prefix hits at all; a few: the least recently used ones are dropped all the time) and at which prompt block
    boundaries they are taken (every `interval`-th one)."""
    return dict(state_checkpoints=rng.choice([None, None, 0, 1, 2, 6]),
                state_checkpoint_interval=rng.choice([1, 2, 4, 16]))
