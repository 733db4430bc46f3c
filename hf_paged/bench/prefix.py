"""Prefix reuse: prefill tokens computed and time to first token for requests sharing a long system prompt.

Full run (about 1.5 minutes: ~45 s per scenario with --threads 1, the no_reuse workers dominate; use a quiet
machine):

    hf-paged bench prefix                          # 64 requests, 1,024-token system prompt, both scenarios
    hf-paged bench prefix --plot

Quick smoke test: `hf-paged bench prefix --small` (hidden 128, 2 layers, vocab 1000; 16 requests sharing a
256-token system prompt, 8 new tokens, step budget 1024).

Design goal: with reuse >= 10x fewer prefill tokens computed and >= 5x lower TTFT p50 than without.

Workload (random-weight Llama: hidden 512, 8 layers, 8 heads, 2 KV heads, intermediate 1376, vocab 32000,
max_len 4096, fp32; prompt ids from a stdlib RNG, seed 0): 64 requests, each = the same 1,024 random-token
system prompt + its own question of 8-32 random tokens; SamplingParams(max_tokens=16, temperature=0,
ignore_eos=True). Engine: hf_paged.LLM(model, block_size=16, num_blocks=enough for every request without any
sharing (so no preemption in either mode; checked), max_num_seqs=64, max_num_batched_tokens=--budget (4096, the
engine default), chunked prefill on), enable_prefix_caching=True ("reuse") or False ("no_reuse").
Scenarios:
  burst  all 64 add_request calls, then llm.step() until done. Admission works through the waiting queue in
         order within one step's token budget, so the first step prefills only the first ~budget/1,040 requests
         (the 4th partially) - none of them can hit, nothing is published yet - and the next step admits the
         rest on top of the blocks those published. With --budget >= the total prompt tokens (64 x ~1,044)
         every request would be admitted in step 1 with no hits at all: the engine does not hold back requests
         that share a prefix with an in-flight prefill (only n>1 samples of one request wait for each other).
  warm   the first request alone (step until its first token, i.e. the system prompt is computed and published),
         then the other 63 arrive at once; the realistic steady state of a chat server.
Measured per (mode, scenario), each in its own subprocess (a fresh pool and prefix map, and no allocator state
from the other mode): prefill tokens computed, counted two ways -
  (a) stats num_batched_tokens (every token run through the model) minus decode tokens (each request's
      output tokens after its first: 64 x 15), and
  (b) prompt tokens minus stats prefix_cache_hit_tokens (the engine's own counter);
they agree unless a request was preempted (a recompute re-runs its tokens; reported). TTFT per request = from
just before its add_request to time.perf_counter() right after the llm.step() that returned its first token;
p50 and p90 over all 64 requests (burst) or over the 63 that arrive after the first (warm; the first request's
TTFT is the same cold prefill in both modes and reported separately). Also reported: requests that got a
prefix hit (RequestOutput.num_cached_tokens > 0), steps, and total time (first add_request -> last token).
Each worker first rehearses its scenario untimed with 6 requests, 2 new tokens and a different random system
prompt (no hits for the measured run), to load kernels and touch the shapes. Ratios are no_reuse / reuse.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from .common import (add_common_args, emit_result, format_table, machine_info, percentile, pyplot, run_worker,
                     save_figure, set_threads, write_json)

MODES = ("reuse", "no_reuse")
SCENARIOS = ("burst", "warm")
FULL = dict(model=dict(vocab_size=32000, hidden=512, layers=8, heads=8, kv_heads=2, max_len=4096,
                       intermediate_size=1376), requests=64, system_prompt=1024, question=(8, 32), max_tokens=16,
            budget=4096)
SMALL = dict(model=dict(vocab_size=1000, hidden=128, layers=2, heads=4, kv_heads=2, max_len=2048,
                        intermediate_size=344), requests=16, system_prompt=256, question=(8, 32), max_tokens=8,
             budget=1024)
TARGET = {"prefill_token_ratio": 10.0, "ttft_p50_ratio": 5.0}
SEED = 0
MODULE = "hf_paged.bench.prefix"
BLOCK = 16
REHEARSAL = dict(requests=6, max_tokens=2)


def make_prompts(setup: dict, count: int, seed: int = SEED) -> list[list[int]]:
    """`count` prompts = one shared system prompt + a per-request question; stdlib only (torch-free parent)."""
    rng = random.Random(seed)
    vocab, (lo, hi) = setup["model"]["vocab_size"], setup["question"]
    system = [rng.randrange(3, vocab) for _ in range(setup["system_prompt"])]
    return [system + [rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


# --- worker side -------------------------------------------------------------------------------------
def scenario(llm, hf_paged, prompts: list[list[int]], max_tokens: int, kind: str) -> dict:
    """Run one scenario on `llm`; times are seconds relative to the first add_request."""
    params = hf_paged.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    before = llm.stats()
    t0 = time.perf_counter()
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    cached: dict[str, int] = {}
    tokens: dict[str, list[int]] = {}
    order: list[str] = []
    steps: list[tuple[float, float, int, int]] = []  # (end time, duration, tokens run, outputs)

    def add(batch: list[list[int]]) -> None:
        for p in batch:
            at = time.perf_counter() - t0
            rid = llm.add_request(p, params)
            added[rid] = at
            order.append(rid)

    add(prompts if kind == "burst" else prompts[:1])
    batched = before["num_batched_tokens"]
    while True:
        start = time.perf_counter()
        outputs = llm.step()
        now = time.perf_counter()
        stats = llm.stats()
        steps.append((now - t0, now - start, stats["num_batched_tokens"] - batched, len(outputs)))
        batched = stats["num_batched_tokens"]
        for out in outputs:
            rid = out.request_id
            if rid not in first:
                first[rid] = now - t0
                cached[rid] = out.num_cached_tokens
            if out.finished:
                done[rid] = now - t0
                tokens[rid] = list(out.token_ids)
        if len(order) < len(prompts) and order[0] in first:
            add(prompts[1:])  # warm: the rest arrive once the first request's prompt is computed
        if not llm.has_unfinished_requests():
            break
    delta = {k: stats[k] - before[k] for k in ("num_batched_tokens", "prefix_cache_hit_tokens",
                                               "prefix_cache_query_tokens", "num_steps", "num_preemptions",
                                               "num_recomputed_tokens", "num_prompt_tokens", "num_generated_tokens")}
    return {"ttft": [first[r] - added[r] for r in order], "added": [added[r] for r in order],
            "finished": [done[r] for r in order], "num_cached_tokens": [cached[r] for r in order],
            "output_lens": [len(tokens[r]) for r in order], "tokens": [tokens[r] for r in order],
            "prompt_tokens": sum(len(p) for p in prompts), "stats": delta, "steps": steps,
            "total_s": max(done.values())}


def worker(args, setup: dict) -> None:
    threads = set_threads(args.threads)
    import hf_paged
    from hf_paged.tiny import tiny_model

    model = tiny_model("llama", seed=SEED, sharpen=1.0, **setup["model"])
    prompts = make_prompts(setup, setup["requests"])
    need = sum(-(-(len(p) + setup["max_tokens"]) // BLOCK) for p in prompts)  # every request, no sharing
    reuse = args.worker == "reuse"
    llm = hf_paged.LLM(model, block_size=BLOCK, num_blocks=need + 4, max_num_seqs=setup["requests"],
                       max_num_batched_tokens=args.budget, enable_chunked_prefill=True,
                       enable_prefix_caching=reuse)
    start = time.perf_counter()
    # rehearsal, untimed: another system prompt (the measured one must start cold), same scenario
    scenario(llm, hf_paged, make_prompts(setup, REHEARSAL["requests"], seed=SEED + 1), REHEARSAL["max_tokens"],
             args.scenario)
    warmup = time.perf_counter() - start
    run = scenario(llm, hf_paged, prompts, setup["max_tokens"], args.scenario)
    emit_result({"mode": args.worker, "scenario": args.scenario, "threads": threads, "num_blocks": need + 4,
                 "max_num_batched_tokens": args.budget, "warmup_seconds": warmup, **run})


# --- parent side -------------------------------------------------------------------------------------
def summarise(r: dict) -> dict:
    s = r["stats"]
    decode_tokens = sum(n - 1 for n in r["output_lens"])
    ttft = r["ttft"] if r["scenario"] == "burst" else r["ttft"][1:]
    return {"prefill_computed_from_batched": s["num_batched_tokens"] - decode_tokens,
            "prefill_computed_from_hits": r["prompt_tokens"] - s["prefix_cache_hit_tokens"],
            "decode_tokens": decode_tokens, "hit_tokens": s["prefix_cache_hit_tokens"],
            "requests_with_hit": sum(1 for c in r["num_cached_tokens"] if c > 0),
            "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p90_ms": 1e3 * percentile(ttft, 90),
            "ttft_max_ms": 1e3 * max(ttft), "ttft_count": len(ttft), "first_request_ttft_ms": 1e3 * r["ttft"][0],
            "steps": s["num_steps"], "preemptions": s["num_preemptions"], "total_s": r["total_s"]}


def plot(path: Path, report: dict) -> None:
    plt = pyplot()
    if plt is None:
        return
    scenarios = [s for s in SCENARIOS if any(k.startswith(s + "/") for k in report["runs"])]
    fig, axes = plt.subplots(1, len(scenarios), figsize=(5.5 * len(scenarios), 4.2), squeeze=False)
    for ax, sc in zip(axes[0], scenarios):
        for i, mode in enumerate(MODES):
            r = report["runs"].get(f"{sc}/{mode}")
            if not r or "ttft" not in r:
                continue
            ttft = sorted(1e3 * t for t in (r["ttft"] if sc == "burst" else r["ttft"][1:]))
            ax.step(ttft, [(k + 1) / len(ttft) for k in range(len(ttft))], where="post", color=f"C{i}",
                    label=f"{mode}: {r['summary']['prefill_computed_from_batched']:,} prefill tokens")
        ax.set_xscale("log")
        ax.tick_params(axis="x", which="minor", labelbottom=False)  # labelled minor ticks of a short range overlap
        ax.set_xlabel("time to first token (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{sc}: {report['requests']} requests, {report['system_prompt']}-token shared prefix")
        ax.legend(fontsize=8)
    save_figure(fig, path)


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(prog="hf-paged bench prefix", description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=int, default=None,
                        help="max_num_batched_tokens (default 4096, the engine default; small 1024)")
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    add_common_args(parser, "prefix", MODES, plot_help="the TTFT distributions")
    parser.add_argument("--scenario", choices=SCENARIOS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    setup = SMALL if args.small else FULL
    args.budget = args.budget or setup["budget"]
    return args, setup


def main(argv: list[str] | None = None) -> int:
    args, setup = parse_args(argv)
    if args.worker:
        worker(args, setup)
        return 0
    print(f"{setup['requests']} requests: a shared {setup['system_prompt']}-token system prompt + "
          f"{setup['question'][0]}-{setup['question'][1]}-token questions, {setup['max_tokens']} new tokens each; "
          f"step budget {args.budget}", flush=True)
    runs = run_all(args)
    rows, notes = table_rows(runs)
    ratios, same = compare(args, runs)
    report = {"benchmark": "prefix", "small": args.small, "model": setup["model"], "dtype": "float32", "seed": SEED,
              "requests": setup["requests"], "system_prompt": setup["system_prompt"],
              "question": list(setup["question"]), "max_tokens": setup["max_tokens"], "block_size": BLOCK,
              "max_num_batched_tokens": args.budget, "target": TARGET, "machine": machine_info(), "runs": runs}
    path = write_json(args.json, report)
    print(f"\nresults written to {path}\n")
    print_report(rows, notes, ratios, same, setup["requests"], args.small)
    if args.plot is not None:
        plot(Path(args.plot) if args.plot else path.with_suffix(".png"), report)
    return 0 if all("error" not in r for r in runs.values()) else 1


def run_all(args) -> dict[str, dict]:
    """Every scenario x mode in a worker of its own: {"scenario/mode": result (or {"error": ...})}."""
    common_args = ["--budget", str(args.budget)] + (["--small"] if args.small else []) + \
        (["--threads", str(args.threads)] if args.threads else [])
    runs: dict[str, dict] = {}
    for sc in args.scenarios:
        for mode in args.modes:
            key = f"{sc}/{mode}"
            try:
                r = run_worker(["-m", MODULE, "--worker", mode, "--scenario", sc, *common_args], timeout=args.timeout)
            except Exception as exc:  # noqa: BLE001 - report and keep going with the others
                print(f"  {key}: FAILED\n{exc}", flush=True)
                runs[key] = {"mode": mode, "scenario": sc, "error": str(exc)}
                continue
            r["summary"] = summarise(r)
            runs[key] = r
            print(f"  {key:<15} total {r['total_s']:.2f} s, TTFT p50 {r['summary']['ttft_p50_ms']:.0f} ms "
                  f"(warm-up {r['warmup_seconds']:.1f} s)", flush=True)
    return runs


def table_rows(runs: dict[str, dict]) -> tuple[list, list[str]]:
    rows, notes = [], []
    for key, r in runs.items():
        if "error" in r:
            rows.append([key, "failed"] + [None] * 10)
            continue
        s = r["summary"]
        rows.append([key, r["prompt_tokens"], s["prefill_computed_from_batched"], s["prefill_computed_from_hits"],
                     s["hit_tokens"], f"{s['requests_with_hit']}/{len(r['ttft'])}", s["ttft_p50_ms"],
                     s["ttft_p90_ms"], s["first_request_ttft_ms"], s["steps"], s["preemptions"], s["total_s"]])
        if s["prefill_computed_from_batched"] != s["prefill_computed_from_hits"]:
            notes.append(f"  NOTE {key}: the two prefill counts differ by "
                         f"{s['prefill_computed_from_batched'] - s['prefill_computed_from_hits']} tokens "
                         f"({s['preemptions']} preemptions)")
        if s["preemptions"]:
            notes.append(f"  WARNING {key}: {s['preemptions']} preemptions (the pool should fit everything)")
    return rows, notes


def compare(args, runs: dict[str, dict]) -> tuple[list, dict[str, int]]:
    """no_reuse / reuse per scenario (in place: each reuse run's `ratios`, both runs' same-token count; tokens
    dropped): the ratio table's rows and the same-token counts."""
    ratios, same = [], {}
    for sc in args.scenarios:
        a, b = runs.get(f"{sc}/reuse"), runs.get(f"{sc}/no_reuse")
        if not a or not b or "error" in a or "error" in b:
            continue
        sa, sb = a["summary"], b["summary"]
        tok = sb["prefill_computed_from_batched"] / max(sa["prefill_computed_from_batched"], 1)
        ttft = sb["ttft_p50_ms"] / sa["ttft_p50_ms"]
        p90 = sb["ttft_p90_ms"] / sa["ttft_p90_ms"]
        speed = b["total_s"] / a["total_s"]
        same[sc] = sum(x == y for x, y in zip(a["tokens"], b["tokens"]))
        ratios.append([sc, tok, "yes" if tok >= TARGET["prefill_token_ratio"] else "no", ttft,
                       "yes" if ttft >= TARGET["ttft_p50_ratio"] else "no", p90, speed,
                       f"{same[sc]}/{len(a['tokens'])}"])
        if args.small:  # a smoke run's sizes say nothing about the targets: no verdict columns
            del ratios[-1][4], ratios[-1][2]
        for r in (a, b):
            r["summary"].update({"vs_other_same_tokens": same[sc]})
        a["ratios"] = {"prefill_tokens": tok, "ttft_p50": ttft, "ttft_p90": p90, "total_time": speed}
    for r in runs.values():
        r.pop("tokens", None)
    return ratios, same


def print_report(rows: list, notes: list[str], ratios: list, same: dict[str, int], requests: int, small: bool) -> None:
    print(format_table(["scenario/mode", "prompt tok", "prefill (batched-decode)", "prefill (prompt-hits)",
                        "hit tok", "reqs hit", "TTFT p50 ms", "TTFT p90 ms", "1st req TTFT ms", "steps",
                        "preempt", "total s"], rows))
    for line in notes:
        print(line)
    if ratios:
        print("\nno_reuse / reuse (TTFT over all requests in burst, over all but the first request in warm):\n")
        headers = ["scenario", "prefill tokens x", ">= 10x", "TTFT p50 x", ">= 5x", "TTFT p90 x", "total time x",
                   "same tokens"]
        print(format_table([h for h in headers if not (small and h.startswith(">="))], ratios))
    for sc, n in same.items():
        if n != requests:
            print(f"  NOTE {sc}: only {n}/{requests} requests produced identical greedy tokens with and without reuse")


if __name__ == "__main__":
    sys.exit(main())
