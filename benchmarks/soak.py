"""Soak test: many random requests on tiny KV pools, checking the engine's contract after every round.

    python benchmarks/soak.py --minutes 10          # rounds until the time is up
    python benchmarks/soak.py --requests 10000      # rounds until that many requests were made
    python benchmarks/soak.py --requests 500 --seed 3 --json
    python benchmarks/soak.py --requests 600 --all --model qwen3_5_text   # a hybrid (Gated DeltaNet + attention)
    python benchmarks/soak.py --requests 600 --all --model mamba2,gemma3  # rounds alternate between the two

Each round draws (soak_draw.py) 20-80 random requests (prompts of 1-300 tokens, a third starting with one of a
few shared system prompts, some repeated verbatim; greedy or seeded sampling; n up to 4; priorities; cache salts;
stop token ids; min_tokens) and runs them on a fresh engine whose pool holds one to one and a half of the round's
biggest requests, with a small token budget (max_num_batched_tokens 32-128, sometimes long_prefill_token_threshold), so
requests are chunked and preempted all the time. Rounds rotate preemption_mode recompute / swap / auto (the swap space sometimes too small,
so swap falls back to recompute), block size, pool size, max_num_seqs and prefix caching. Most rounds stream
requests in through `add_request` / `step`, aborting some mid-flight (waiting, running, preempted or swapped); the
others go through `LLM.generate(..., priority=[...])`.

Checked every round (any failure is a violation; the script exits 1 if there was one):
- every request added ends exactly once per sample (none lost, none finished twice, none after its abort), and
  nothing is left in the engine (`check_idle`: every block and swap slot free, no group left behind);
- each sample has the right number of tokens ("length": max_tokens) or ends on its first stop token / EOS
  (after min_tokens), and no sample ends with an error;
- greedy and seeded outputs equal, per sample index, those of the same requests run on one unpressured engine (a
  big pool, no chunking, no preemption); aborted requests are left out of the comparison. The one forgiven
  difference is a rounding flip: at the first differing token the two tokens' decision values (greedy: logits;
  seeded sampling: the exponential race's p / E, the request's noise replayed from its seed) are within
  NEAR_TIE of each other, recomputed by a plain forward of the model. A different batch, chunk or prefix hit sums
  the same dot products in another order (logits move by ~1e-7), so one token in ~1e5 flips where the race was
  tied to the last bit. Such flips are counted (`near_ties`), and more than 1 + compared / 10,000 is a violation.

Extra modes (off by default; `--all`: all, with 4 consumers), each in some rounds, combinable (soak_faults.py):
`--faults` (failures injected into steps, caught, stepped on: a step is all or nothing, so every check holds),
`--consumers N` (N threads on one LLM through generate / stream / step loop / astream, each gets exactly its own
results), `--weight-changes` (sessions of rounds on one LLM whose weights change in place between rounds; compared
with a fresh reference per weight version) and `--fp8` (fp8 KV caches, compared with an unpressured fp8 engine).

`--model` (default llama) picks the model, or a comma-separated list whose models take the rounds in turn (each with
its own reference engines and weight sessions): `llama`; `mistral` (every layer has one sliding window, `--window`
tokens, default 8: the engines give back the blocks behind it); `gemma3` (a Gemma 3 text stack mixing sliding-window
and full-attention layers, window `--window` or 8 tokens: prompts cross it, every block is kept); or a hybrid /
state-space family of `hf_paged.tiny.HYBRIDS` (`qwen3_5_text`, `qwen3_next`, `mamba2`, `nemotron_h`, `falcon_h1`,
`lfm2`, ...: state layers keep one state slot per running request, which `check_idle` also requires free after each
round). Every mode applies to every model except what the engine refuses: fp8 KV caches on models with state layers
(their fp8 rounds run unquantized, counted as `fp8_skipped`, and the report's `notes` say so). A prefix hit on such a
model needs the state at the hit point too: it ends at a block whose state was checkpointed; their rounds also draw
how many checkpoints are kept (`state_checkpoints`: none, 1, 2, 6 or the default) and at which block boundaries
(`state_checkpoint_interval` 1, 2, 4 or 16), and their fault rounds add the state slots' and checkpoints' own points
(soak_faults.STATE_POINTS). Their reference engine keeps no prefix cache (it computes every prompt from token 0). A
model without attention layers (mamba2) keeps no K/V to swap: its swap and auto rounds preempt by recompute.
"""
from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

try:
    import hf_paged  # noqa: F401
except ImportError:  # run from a checkout without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_paged import LLM
from hf_paged.sampling import _penalize, _truncate
from hf_paged.model import describe_model
from hf_paged.tiny import HYBRIDS, tiny_hybrid, tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent))  # soak_draw.py beside this file, however it is loaded
from soak_draw import (EOS, MAX_LEN, MODES, SYSTEM_LENGTHS, VOCAB, Spec, check_tokens, draw_engine,  # noqa: E402
                       draw_round)
from soak_faults import (POINTS, STATE_POINTS, Context, Faults, finish_event, run_consumers,  # noqa: E402
                         split_consumers, start_session)

COUNTS = ("rounds", "requests", "samples", "stream_rounds", "batch_rounds", "aborts", "aborts_running",
          "aborts_preempted", "aborts_swapped", "compared", "steps",
          "preemptions", "swap_outs", "swap_ins", "recomputed_tokens", "prefix_hit_tokens", "generated_tokens",
          "fault_rounds", "faults_injected", "faults_hit", "consumer_rounds", "weight_rounds", "weight_changes",
          "fp8_rounds", "fp8_skipped", "near_ties", "mismatches", "errors", "lost", "duplicated", "foreign",
          "bad_lengths", "leaks", "exceptions")
# a flip is forgiven when the two tokens' decision values differ by less than this: greedy, in logits (absolute);
# seeded sampling, in the race value p / E (relative). Rounding moves them by ~1e-7.
NEAR_TIE = {"greedy": 1e-4, "sampled": 1e-5}
NEAR_TIES_PER = 10_000  # compared samples per forgiven flip (plus one)
# how often a round takes each extra mode that is on ("session": a weight-change session starts when none runs)
RATES = {"fp8": 0.35, "consumers": 0.35, "session": 0.4, "faults": 0.6}


@dataclass
class Soak:
    seed: int = 0
    counts: dict = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))
    violations: list[str] = field(default_factory=list)
    fault_points: Counter = field(default_factory=Counter)  # "point when error" of each injected fault that fired
    model_rounds: Counter = field(default_factory=Counter)  # rounds per model (--model with several)
    notes: list[str] = field(default_factory=list)  # what a model cannot take (e.g. fp8 on state layers)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # consumers report from their threads

    def violate(self, kind: str, message: str) -> None:
        with self.lock:
            self.counts[kind] += 1
            if len(self.violations) < 50:
                self.violations.append(message)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---- models -------------------------------------------------------------------------------------------------------
MODELS = ("llama", "mistral", "gemma3", *HYBRIDS)
WINDOW = 8  # the default sliding window of `mistral` and `gemma3`: most prompts (1-300 tokens) cross it
# gemma3's layers: sliding-window layers before and after a full-attention one
GEMMA3_LAYERS = ("sliding_attention", "sliding_attention", "full_attention", "sliding_attention")


def mixed_window_model(window: int = WINDOW, seed: int = 0, sharpen: float = 8.0):
    """A random-weight Gemma 3 text model (4 layers, hidden size 64) mixing sliding-window (`window` tokens) and
    full-attention layers (`GEMMA3_LAYERS`), its output head scaled like `tiny_model`'s."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=len(GEMMA3_LAYERS),
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                              query_pre_attn_scalar=16, max_position_embeddings=MAX_LEN, sliding_window=window,
                              layer_types=list(GEMMA3_LAYERS), bos_token_id=1, eos_token_id=EOS, pad_token_id=0,
                              tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharpen)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, EOS
    return model.eval()


def soak_model(name: str, window: int | None = None):
    """The model `--model name` soaks (see the module's docstring)."""
    if name == "llama":
        return tiny_model("llama", max_len=MAX_LEN)
    if name == "mistral":
        return tiny_model("mistral", max_len=MAX_LEN, sliding_window=window or WINDOW)
    if name == "gemma3":
        return mixed_window_model(window or WINDOW)
    if name in HYBRIDS:
        return tiny_hybrid(name)
    raise ValueError(f"unknown soak model {name!r}; choose from {', '.join(MODELS)}")


def model_name(model) -> str:
    return getattr(getattr(model, "config", None), "model_type", type(model).__name__)


def has_state(model) -> bool:
    return describe_model(model).has_state


# ---- running a round --------------------------------------------------------------------------------------------
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
            group = llm.engine.groups.get(rid)
            states = {r.status.value for r in group.samples} if group is not None else set()
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
        if llm.engine.groups or llm.engine.dirty:
            raise AssertionError(f"{len(llm.engine.groups)} request groups, {len(llm.engine.dirty)} marks left behind")
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


def flip_gap(model, spec: Spec, index: int, before: list[int], tokens: tuple[int, int]) -> tuple[float, float]:
    """(gap, limit): how far apart sample `index`'s decision values for `tokens` were after output `before`,
    recomputed the way the engine's sampler decides (penalties, min_tokens bans, then the greedy logit or the race
    p / E with the sample's generator replayed: one draw per output token). A gap below the limit is a rounding tie."""
    p = spec.params
    prefix = spec.prompt + before
    with torch.no_grad():
        logits = model(torch.tensor([prefix])).logits[:, -1].float()
    logits = _penalize(logits, [prefix], [before], [p]).clone()
    if len(before) < p.min_tokens:
        logits[0, list(p.stop_token_ids) + ([] if p.ignore_eos else [EOS])] = float("-inf")
    if p.greedy:
        a, b = (logits[0, t].item() for t in tokens)
        return abs(a - b), NEAR_TIE["greedy"]
    generator = torch.Generator().manual_seed(p.seed + index)
    for _ in range(len(before) + 1):
        noise = torch.empty(logits.shape[1]).exponential_(generator=generator)
    race = _truncate(logits / p.temperature, [p]).softmax(dim=-1)[0] / noise
    a, b = (race[t].item() for t in tokens)
    return abs(a - b) / max(a, b, 1e-30), NEAR_TIE["sampled"]


def compare(soak: Soak, reference: LLM, specs: list[Spec], ended: dict, options: dict, model) -> None:
    """Outputs must equal the same requests' outputs on an unpressured engine, per sample index (a rounding tie
    at the first differing token is counted, not a violation, within the bound; see the module's docstring)."""
    if not specs:
        return
    before = reference.stats()["num_preemptions"]
    outs = reference.generate([s.prompt for s in specs], [s.params for s in specs], use_tqdm=False)
    if reference.stats()["num_preemptions"] != before:
        raise RuntimeError("the reference engine preempted: make its pool bigger")
    for spec, out in zip(specs, outs):
        for want in out.outputs:
            got = ended.get((spec.rid, want.index))
            if got is None:
                continue  # counted as lost
            soak.counts["compared"] += 1
            if (got.token_ids, got.finish_reason) != (want.token_ids, want.finish_reason):
                at = next((i for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids)) if a != b),
                          min(len(got.token_ids), len(want.token_ids)))
                gap = None
                if at < min(len(got.token_ids), len(want.token_ids)):
                    gap, limit = flip_gap(model, spec, want.index, list(want.token_ids[:at]),
                                          (got.token_ids[at], want.token_ids[at]))
                    if gap < limit and soak.counts["near_ties"] < 1 + soak.counts["compared"] // NEAR_TIES_PER:
                        soak.counts["near_ties"] += 1
                        continue
                soak.violate("mismatches", f"{spec.rid}/{want.index} differs from the unpressured run at output "
                                           f"token {at} ({got.finish_reason}/{want.finish_reason}; decision gap "
                                           f"{'-' if gap is None else f'{gap:.2e}'}; prompt "
                                           f"{len(spec.prompt)} tokens, {spec.params}; engine {options})")


def reference_engine(model, fp8: bool = False, scales=None) -> LLM:
    """Big pool, every request admitted at once, no chunking: nothing is ever preempted, and every block is kept
    (also on a sliding-window model, whose soaked engines give back the blocks behind the window). `fp8`: an fp8
    cache with scales calibrated as every engine of the model does; `scales`: with these (None: unquantized). On a
    model with state layers no prefix cache either: every prompt's state is computed from its first token."""
    fp8 = dict(kv_cache_dtype="fp8_e4m3", kv_scales=scales) if fp8 or scales is not None else {}
    llm = LLM(model, block_size=16, num_blocks=12000, max_num_seqs=512, max_num_batched_tokens=1 << 17,
              enable_chunked_prefill=False, preemption_mode="recompute", attention_backend="torch",
              enable_prefix_caching=not has_state(model), **fp8)
    llm.engine.scheduler.release_window = None
    return llm


def run_soak(requests: int | None = None, minutes: float | None = None, seed: int = 0, model=None,
             log=None, faults: bool = False, consumers: int = 0, weight_changes: bool = False,
             fp8: bool = False, round_sizes: tuple[int, int] = (20, 80)) -> dict:
    """Rounds until `requests` requests were made or `minutes` passed (whichever first). Returns the report.
    `model`: the model, or a list of models that take the rounds in turn (default: the tiny Llama).
    `faults`, `consumers`, `weight_changes`, `fp8`: the extra modes (see the module's docstring). `round_sizes`: how
    many requests a round draws (uniform between the two; smaller: more engines, modes and models per request)."""
    if requests is None and minutes is None:
        requests = 1000
    rng = random.Random(seed)
    models = model if isinstance(model, (list, tuple)) else [model]
    models = [m if m is not None else tiny_model("llama", max_len=MAX_LEN) for m in models]
    soak = Soak(seed)
    contexts = []
    for m in models:
        refused = fp8 and has_state(m)
        if refused:
            soak.notes.append(f"{model_name(m)}: fp8 KV caches are refused on models with state layers; its fp8 "
                              f"rounds (fp8_skipped) run unquantized")
        # a refused context's fp8 is "refused" (truthy: its rounds draw fp8 like any other, then run unquantized)
        contexts.append(Context(m, reference_engine(m), faults, consumers, weight_changes,
                                "refused" if refused else fp8))
    systems = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in SYSTEM_LENGTHS]
    start = time.perf_counter()
    deadline = start + minutes * 60 if minutes is not None else float("inf")
    rss_after_first = None
    while time.perf_counter() < deadline and (requests is None or soak.counts["requests"] < requests):
        size = random.Random(f"{seed}/{soak.counts['rounds']}/size").randint(*round_sizes)
        if requests is not None:
            size = min(size, requests - soak.counts["requests"])
        # each model takes len(MODES) rounds in a row: one per preemption mode (draw_engine: round number % 3)
        ctx = contexts[soak.counts["rounds"] // len(MODES) % len(contexts)]
        soak.model_rounds[model_name(ctx.model)] += 1
        try:
            run_round(soak, ctx, soak.counts["rounds"], systems, size)
        except Exception as e:  # noqa: BLE001 - an engine exception is a violation; the next round starts afresh
            ctx.session = None
            soak.violate("exceptions", f"round {soak.counts['rounds']}: {type(e).__name__}: {e}")
            soak.counts["rounds"] += 1
            soak.counts["requests"] += size
        rss_after_first = rss_after_first or rss_mb()
        if log and soak.counts["rounds"] % 10 == 0:
            log(f"round {soak.counts['rounds']}: {soak.counts['requests']} requests, "
                f"{soak.counts['preemptions']} preemptions, {len(soak.violations)} violations, "
                f"{time.perf_counter() - start:.0f} s, rss {rss_mb():.0f} MB")
    for ctx in contexts:
        for engine in (ctx.reference, ctx.fp8_reference):
            try:
                engine is None or engine.engine.check_idle()
            except AssertionError as e:
                soak.violate("leaks", f"reference engine of {model_name(ctx.model)}: {e}")
    return {"seed": seed, "models": [model_name(m) for m in models], **soak.counts,
            "model_rounds": dict(soak.model_rounds), "fault_points_hit": dict(sorted(soak.fault_points.items())),
            "notes": soak.notes, "violations": soak.violations,
            "seconds": round(time.perf_counter() - start, 1), "peak_rss_mb": round(peak_rss_mb(), 1),
            "rss_after_first_round_mb": round(rss_after_first or 0.0, 1), "rss_end_mb": round(rss_mb(), 1)}


VIOLATION_COUNTS = ("mismatches", "errors", "lost", "duplicated", "foreign", "bad_lengths", "leaks", "exceptions")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=None, help="run rounds for this long")
    parser.add_argument("--requests", type=int, default=None, help="run rounds until this many requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: the tiny model's matmuls take microseconds; more threads only "
                             "spin against each other on a busy machine, 10x slower on 2 shared cores)")
    parser.add_argument("--model", default=None, metavar="NAME[,NAME...]",
                        help=f"the model(s) soaked, taking the rounds in turn: {', '.join(MODELS)} (default llama; "
                             f"mistral with --window alone)")
    parser.add_argument("--window", type=int, default=None,
                        help="the sliding window of mistral / gemma3 (default 8); without --model: soak a Mistral "
                             "whose every layer has this window (the engines give back the blocks behind it)")
    parser.add_argument("--faults", action="store_true", help="inject failures into steps of some stream rounds")
    parser.add_argument("--consumers", type=int, default=0, metavar="N",
                        help="some rounds split their requests between N threads, each its own entry point")
    parser.add_argument("--weight-changes", action="store_true",
                        help="sessions of rounds on one LLM whose model's weights change in place between rounds")
    parser.add_argument("--fp8", action="store_true", help="some rounds on fp8 KV caches (kv_cache_dtype fp8_e4m3)")
    parser.add_argument("--all", action="store_true", help="every extra mode (--consumers 4 unless given)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if args.all:
        args.faults = args.weight_changes = args.fp8 = True
        args.consumers = args.consumers or 4
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    names = args.model.split(",") if args.model else ["mistral"] if args.window else ["llama"]
    for name in names:
        if name not in MODELS:
            parser.error(f"unknown --model {name!r}; choose from {', '.join(MODELS)}")
    model = [soak_model(name, args.window) for name in names]
    report = run_soak(args.requests, args.minutes, args.seed, model=model, log=None if args.json else print,
                      faults=args.faults, consumers=args.consumers, weight_changes=args.weight_changes, fp8=args.fp8)
    failed = sum(report[k] for k in VIOLATION_COUNTS) > 0
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{report['requests']} requests ({report['samples']} samples) in {report['rounds']} rounds, "
              f"{report['seconds']} s, seed {report['seed']}, model {','.join(report['models'])}")
        print("  " + ", ".join(f"{k} {report[k]}" for k in COUNTS if k not in ("requests", "samples", "rounds")))
        if len(report["models"]) > 1:
            print(f"  rounds per model: {report['model_rounds']}")
        for line in report["notes"]:
            print("  note: " + line)
        if report["fault_points_hit"]:
            print(f"  faults hit: {report['fault_points_hit']}")
        print(f"  peak RSS {report['peak_rss_mb']} MB (after the first round {report['rss_after_first_round_mb']} "
              f"MB, at the end {report['rss_end_mb']} MB)")
        for line in report["violations"]:
            print("  VIOLATION " + line)
        print("FAILED" if failed else "OK: no violations")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
