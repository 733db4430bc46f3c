"""Soak test: many random requests on tiny KV pools, checking the engine's contract after every round.

    python -m hf_paged.bench.soak --minutes 10          # rounds until the time is up
    python -m hf_paged.bench.soak --requests 10000      # rounds until that many requests were made
    python -m hf_paged.bench.soak --requests 500 --seed 3 --json
    python -m hf_paged.bench.soak --requests 600 --all --model qwen3_5_text   # a hybrid (Gated DeltaNet + attention)
    python -m hf_paged.bench.soak --requests 600 --all --model mamba2,gemma3  # rounds alternate between the two

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

Extra modes (off by default; `--all`: all, with 4 consumers), each in some rounds, combinable: `--faults`
(soak_faults.py: failures injected into steps, caught, stepped on: a step is all or nothing, so every check holds),
`--consumers N` (soak_consumers.py: N threads on one LLM through generate / stream / step loop / astream, each
gets exactly its own results), `--weight-changes` (soak_sessions.py: sessions of rounds on one LLM whose weights
change in place between rounds; compared with a fresh reference per weight version) and `--fp8` (fp8 KV caches, compared with an unpressured fp8 engine).

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
import sys
import time

import torch

from hf_paged.tiny import HYBRIDS, tiny_hybrid, tiny_model

from .common import peak_rss_mb
from .soak_check import COUNTS, VIOLATION_COUNTS, Soak, has_state, model_name, reference_engine, rss_mb
from .soak_draw import EOS, MAX_LEN, MODES, SYSTEM_LENGTHS, VOCAB
from .soak_round import run_round
from .soak_sessions import Context

# ---- models -------------------------------------------------------------------------------------------------------
MODELS = ("llama", "mistral", "gemma3", *HYBRIDS)
WINDOW = 8  # the default sliding window of `mistral` and `gemma3`: most prompts (1-300 tokens) cross it
# gemma3's layers: sliding-window layers before and after a full-attention one
GEMMA3_LAYERS = ("sliding_attention", "sliding_attention", "full_attention", "sliding_attention")


def mixed_window_model(window: int = WINDOW, seed: int = 0, sharpen: float = 8.0):
    """A random-weight Gemma 3 text model (4 layers, hidden size 64) mixing sliding-window (`window` tokens) and
    full-attention layers (`GEMMA3_LAYERS`), its output head scaled like `tiny_model`'s."""
    from hf_paged.tiny import config_of, model_from_config

    config = config_of("gemma3_text", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=len(GEMMA3_LAYERS),
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                              query_pre_attn_scalar=16, max_position_embeddings=MAX_LEN, sliding_window=window,
                              layer_types=list(GEMMA3_LAYERS), bos_token_id=1, eos_token_id=EOS, pad_token_id=0,
                              tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = model_from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharpen)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, EOS
    return model


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


# ---- the soak -----------------------------------------------------------------------------------------------------
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
