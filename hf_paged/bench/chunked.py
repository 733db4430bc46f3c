"""Chunked prefill: decoders' inter-token latency when a long prompt arrives, with chunking vs without.

Full run (about a minute on 2 cores; use a quiet machine):

    hf-paged bench chunked                         # 16 decoders, one 4,096-token prompt, chunk budget 64
    hf-paged bench chunked --budget 512 --json chunked512.json --plot

Quick smoke test: `hf-paged bench chunked --small` (hidden 128, 2 layers, vocab 1000; 8 decoders with
12-20-token prompts and 32 new tokens, one 1,024-token prompt, chunk budget 128). Timings are only meaningful
on an otherwise idle machine: with torch's default threads, any other busy process makes OpenMP oversubscribe
the cores and single steps jump 10-50x (use --threads to pin the count).

Design goal: with chunking, the decoders' p99 inter-token latency <= 2x their median.

Scenario (random-weight Llama: hidden 512, 8 layers, 8 heads, 2 KV heads, intermediate 1376, vocab 32000,
max_len 8192, fp32, greedy, EOS ignored; prompt ids from a stdlib RNG, seed 0):
  1. add 16 requests (prompts of 28-36 random tokens, SamplingParams(max_tokens=96, ignore_eos=True));
  2. llm.step() until every one of them has its first token (prefill done), then `--settle` (4) more steps;
  3. add one 4,096-token prompt (max_tokens=8);
  4. llm.step() until the 16 decoders finish (and then until the long request does, if it has not).
A token's time is time.perf_counter() right after the llm.step() that produced it; inter-token latency (ITL)
= the gap between consecutive tokens of the same decoder (all gaps after each decoder's first token, before
and after the long prompt's arrival: 16 x 95 samples). Also reported: ITL statistics inside the interference
window (long prompt arrival -> its first token), the long prompt's time to first token (arrival -> the step
that produced its first token), the number of steps in that window, and total time (first add_request -> last
decoder token).
Modes:
  chunked    hf_paged.LLM(model, enable_chunked_prefill=True,  max_num_batched_tokens=--budget (64))
  unchunked  hf_paged.LLM(model, enable_chunked_prefill=False, max_num_batched_tokens=8192)
both with block_size=16 and num_blocks sized to the workload (no preemption; checked).

Each mode runs in its own subprocess (as throughput.py does): the two modes leave very different allocator
state behind (one 4,096-token prefill vs many small chunks), which would bias whichever ran second, and a
fresh process also loads hf_paged's native decode kernel on its own. Inside each process the whole scenario
is first rehearsed untimed with short decoders (max_tokens settle+4) and other random prompts of the same
lengths (the same ones would be prefix-cache hits in the measured run; the hit count is recorded and must be
0), so that kernel loading, first-touch page faults and oneDNN/SDPA setup for the measured shapes are out of
the way; then the scenario runs once more, measured, on the same LLM. `--repeats N` measures the scenario N
times per mode (alternating processes chunked/unchunked) and pools the samples.
Reading p99: without chunking the one long step stalls each decoder once, i.e. 16 of 16 x 95 = 1,520 gaps
(~1 %), so p99 lands on the edge of that stall (interpolated ~80 % of the way into it); max and the
"max ITL in window" column show it unambiguously. With chunking the chunk steps are a large share of the gaps.
On CPU a forward pass costs roughly in proportion to its tokens and to the context a chunk attends to, so a
512-token chunk step is far slower than a 16-token decode step (p99/median ~13); the default budget of 64
tokens per step keeps chunk steps within ~2x of a decode step (p99/median ~1.8) at the price of a longer TTFT
for the long prompt. --budget trades one for the other.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from itertools import pairwise
from pathlib import Path

from .common import (add_common_args, emit_result, format_table, machine_info, percentile, pyplot, run_worker,
                     save_figure, set_threads, write_json)

MODES = ("chunked", "unchunked")
FULL = dict(model=dict(vocab_size=32000, hidden=512, layers=8, heads=8, kv_heads=2, max_len=8192,
                       intermediate_size=1376), decoders=16, decoder_prompt=(28, 36), decode_tokens=96,
            long_prompt=4096, long_tokens=8, budget=64, unchunked_budget=8192)
SMALL = dict(model=dict(vocab_size=1000, hidden=128, layers=2, heads=4, kv_heads=2, max_len=2048,
                        intermediate_size=344), decoders=8, decoder_prompt=(12, 20), decode_tokens=32,
             long_prompt=1024, long_tokens=8, budget=128, unchunked_budget=2048)
SEED = 0
MODULE = "hf_paged.bench.chunked"
BLOCK = 16


def make_prompts(setup: dict, seed: int = SEED) -> tuple[list[list[int]], list[int]]:
    """(decoder prompts, long prompt); stdlib only so the parent stays torch-free."""
    rng = random.Random(seed)
    vocab, (lo, hi) = setup["model"]["vocab_size"], setup["decoder_prompt"]
    short = [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(setup["decoders"])]
    return short, [rng.randrange(3, vocab) for _ in range(setup["long_prompt"])]


def itl_stats(gaps: list[float]) -> dict:
    med, p99 = percentile(gaps, 50), percentile(gaps, 99)
    return {"count": len(gaps), "median_ms": None if med is None else 1e3 * med,
            "p99_ms": None if p99 is None else 1e3 * p99, "max_ms": 1e3 * max(gaps) if gaps else None,
            "mean_ms": 1e3 * sum(gaps) / len(gaps) if gaps else None,
            "p99_over_median": p99 / med if gaps and med else None}


# --- worker side -------------------------------------------------------------------------------------
def scenario(llm, hf_paged, short, long, decode_tokens: int, long_tokens: int, settle: int) -> dict:
    """Run the scenario once on `llm`; all times are seconds relative to the first add_request."""
    params = hf_paged.SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    ids = [llm.add_request(p, params) for p in short]
    times: dict[str, list[float]] = {rid: [] for rid in ids}
    steps: list[tuple[float, float, int, int]] = []  # (end time, duration, tokens scheduled, outputs)
    long_id = arrival = long_first = long_done = None
    stats = llm.stats()
    batched, preempted = stats["num_batched_tokens"], stats["num_preemptions"]
    hits = stats.get("prefix_cache_hit_tokens", 0)  # must stay 0: every prompt is fresh random ids
    settle_left = settle
    while True:
        before = time.perf_counter()
        outputs = llm.step()
        now = time.perf_counter()
        stats = llm.stats()
        steps.append((now - t0, now - before, stats["num_batched_tokens"] - batched, len(outputs)))
        batched = stats["num_batched_tokens"]
        for out in outputs:
            if out.request_id in times:
                times[out.request_id].append(now - t0)
            elif out.request_id == long_id:
                if long_first is None:
                    long_first = now - t0
                if out.finished:
                    long_done = now - t0
        if long_id is None and all(times[r] for r in ids):
            if settle_left == 0:
                arrival = time.perf_counter() - t0
                long_id = llm.add_request(long, hf_paged.SamplingParams(max_tokens=long_tokens, temperature=0.0,
                                                                         ignore_eos=True))
            settle_left -= 1
        if not llm.has_unfinished_requests():
            break
    return {"times": [times[r] for r in ids], "arrival": arrival, "long_first_token": long_first,
            "long_done": long_done, "steps": steps, "preemptions": stats["num_preemptions"] - preempted,
            "prefix_cache_hit_tokens": stats.get("prefix_cache_hit_tokens", 0) - hits}


def worker(args, setup: dict) -> None:
    threads = set_threads(args.threads)
    import hf_paged
    from hf_paged.tiny import tiny_model

    model = tiny_model("llama", seed=SEED, sharpen=1.0, **setup["model"])
    short, long = make_prompts(setup)
    chunked = args.worker == "chunked"
    budget = args.budget if chunked else setup["unchunked_budget"]
    tokens = sum(len(p) + args.decode_tokens for p in short) + len(long) + setup["long_tokens"]
    num_blocks = -(-tokens // BLOCK) + len(short) + 2  # every request's table plus a spare partial block each
    llm = hf_paged.LLM(model, block_size=BLOCK, num_blocks=num_blocks, max_num_seqs=len(short) + 1,
                       enable_chunked_prefill=chunked, max_num_batched_tokens=budget)
    start = time.perf_counter()
    # warm-up, untimed: other prompts of the same lengths (the same ones would be prefix-cache hits later),
    # short decoders, but the long prompt still arrives
    warm_short, warm_long = make_prompts(setup, seed=SEED + 1)
    warm_tokens = min(args.decode_tokens, args.settle + 4)
    scenario(llm, hf_paged, warm_short, warm_long, warm_tokens, setup["long_tokens"], args.settle)
    warmup = time.perf_counter() - start
    runs = [scenario(llm, hf_paged, short, long, args.decode_tokens, setup["long_tokens"], args.settle)]
    emit_result({"mode": args.worker, "threads": threads, "max_num_batched_tokens": budget, "num_blocks": num_blocks,
                 "warmup_seconds": warmup, "runs": runs})


# --- parent side -------------------------------------------------------------------------------------
def summarise(runs: list[dict]) -> dict:
    gaps, window, ttft, totals, window_steps, late = [], [], [], [], [], 0
    for run in runs:
        end = run["long_first_token"] if run["long_first_token"] is not None else float("inf")
        for times in run["times"]:
            for a, b in pairwise(times):
                gaps.append(b - a)
                if run["arrival"] < b <= end:
                    window.append(b - a)
        if run["long_first_token"] is None or run["long_first_token"] > max(t[-1] for t in run["times"]):
            late += 1
        ttft.append(None if run["long_first_token"] is None else run["long_first_token"] - run["arrival"])
        totals.append(max(t[-1] for t in run["times"]))
        window_steps.append(sum(1 for s in run["steps"] if run["arrival"] < s[0] <= end))
    return {"itl": itl_stats(gaps), "itl_in_window": itl_stats(window),
            "long_ttft_s": ttft, "total_s": totals, "steps_in_window": window_steps,
            "runs_where_decoders_finished_before_long_first_token": late,
            "preemptions": sum(r["preemptions"] for r in runs),
            "prefix_cache_hit_tokens": sum(r.get("prefix_cache_hit_tokens", 0) for r in runs)}


def plot(path: Path, report: dict) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, (mode, entry) in enumerate(report["modes"].items()):
        run = entry["runs"][0]
        xs, ys = [], []
        for times in run["times"]:
            for a, b in pairwise(times):
                xs.append(b - run["arrival"])
                ys.append(1e3 * (b - a))
        ax.scatter(xs, ys, s=6, color=f"C{i}", label=f"{mode} (budget {entry['max_num_batched_tokens']})")
        if run["long_first_token"] is not None:
            ax.axvline(run["long_first_token"] - run["arrival"], color=f"C{i}", linestyle=":", linewidth=1)
    ax.axvline(0, color="gray", linestyle="--", linewidth=1, label="long prompt arrives")
    ax.set_yscale("log")
    ax.set_xlabel("seconds since the long prompt arrived (dotted: its first token)")
    ax.set_ylabel("decoder inter-token latency (ms)")
    ax.set_title(f"{report['decoders']} decoders + one {report['long_prompt']}-token prompt")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(prog="hf-paged bench chunked", description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=int, default=None,
                        help="max_num_batched_tokens with chunking (default 64; small 128)")
    parser.add_argument("--decode-tokens", type=int, default=None, help="max_tokens of each decoder (default 96)")
    parser.add_argument("--settle", type=int, default=4, help="decode steps between the decoders' prefill and the "
                                                                "long prompt's arrival")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--repeats", type=int, default=1, help="measured runs per mode (one process each)")
    add_common_args(parser, "chunked", MODES, plot_help="decoder ITL over time")
    args = parser.parse_args(argv)
    setup = SMALL if args.small else FULL
    args.budget = args.budget or setup["budget"]
    args.decode_tokens = args.decode_tokens or setup["decode_tokens"]
    if args.decode_tokens < args.settle + 2:
        parser.error("--decode-tokens must exceed --settle + 1, or the decoders finish before the long prompt arrives")
    return args, setup


def main(argv: list[str] | None = None) -> int:
    args, setup = parse_args(argv)
    if args.worker:
        worker(args, setup)
        return 0
    print(f"{setup['decoders']} decoders ({setup['decoder_prompt']} prompt tokens, {args.decode_tokens} new), then "
          f"one {setup['long_prompt']}-token prompt ({setup['long_tokens']} new)", flush=True)
    modes, ok = run_modes(args)
    rows = table_rows(modes)
    report = {"benchmark": "chunked", "small": args.small, "model": setup["model"], "dtype": "float32", "seed": SEED,
              "decoders": setup["decoders"], "decoder_prompt": list(setup["decoder_prompt"]),
              "decode_tokens": args.decode_tokens, "long_prompt": setup["long_prompt"],
              "long_tokens": setup["long_tokens"], "settle": args.settle, "repeats": args.repeats,
              "target": {"p99_over_median_chunked": 2.0}, "machine": machine_info(), "modes": modes}
    path = write_json(args.json, report)
    print(f"\nresults written to {path}\n")
    print(format_table(["mode", "step budget", "ITL median ms", "ITL p99 ms", "ITL max ms", "p99/median",
                        "max ITL in window ms", "steps in window", "long TTFT s", "total s"], rows))
    if "chunked" in modes and "itl" in modes["chunked"]:
        ratio = modes["chunked"]["itl"]["p99_over_median"]
        verdict = "" if args.small else f" -> {'meets' if ratio <= 2 else 'misses'} the target (<= 2)"
        print(f"chunked: p99/median = {ratio:.2f}{verdict}")  # a smoke run's sizes say nothing about the target
    if args.plot is not None:
        plot(Path(args.plot) if args.plot else path.with_suffix(".png"), report)
    return 0 if ok else 1


def run_modes(args) -> tuple[dict[str, dict], bool]:
    """`--repeats` runs of every mode, each in a worker of its own: ({mode: its runs and settings}, all ran)."""
    common_args = ["--budget", str(args.budget), "--decode-tokens", str(args.decode_tokens), "--settle",
                   str(args.settle)] + (["--small"] if args.small else []) + \
        (["--threads", str(args.threads)] if args.threads else [])
    modes: dict[str, dict] = {}
    ok = True
    for rep in range(args.repeats):
        for mode in args.modes:
            try:
                r = run_worker(["-m", MODULE, "--worker", mode, *common_args], timeout=args.timeout)
            except Exception as exc:  # noqa: BLE001 - report and keep going with the other mode
                print(f"  {mode}: FAILED\n{exc}", flush=True)
                modes.setdefault(mode, {"runs": []})["error"] = str(exc)
                ok = False
                continue
            run = r["runs"][0]
            print(f"  {mode:<9} run {rep + 1}: total {max(t[-1] for t in run['times']):.2f} s, long prompt TTFT "
                  f"{(run['long_first_token'] or float('nan')) - run['arrival']:.2f} s "
                  f"(warm-up {r['warmup_seconds']:.1f} s)",
                  flush=True)
            entry = modes.setdefault(mode, {"runs": []})
            entry.update({k: v for k, v in r.items() if k != "runs"})
            entry["runs"].extend(r["runs"])
    return modes, ok


def table_rows(modes: dict[str, dict]) -> list[list]:
    """Each mode's summary (`summarise`, in place) as a row of the table; warnings for runs that measured nothing."""
    rows = []
    for mode, entry in modes.items():
        if not entry["runs"]:
            rows.append([mode, None, "failed", None, None, None, None, None, None, None])
            continue
        entry.update(summarise(entry["runs"]))
        s, w = entry["itl"], entry["itl_in_window"]
        ttft = [t for t in entry["long_ttft_s"] if t is not None]
        rows.append([mode, entry["max_num_batched_tokens"], s["median_ms"], s["p99_ms"], s["max_ms"],
                     s["p99_over_median"], w["max_ms"], sum(entry["steps_in_window"]) / len(entry["steps_in_window"]),
                     sum(ttft) / len(ttft) if ttft else None, sum(entry["total_s"]) / len(entry["total_s"])])
        if entry["preemptions"] or entry["runs_where_decoders_finished_before_long_first_token"] or \
                entry["prefix_cache_hit_tokens"]:
            print(f"  WARNING {mode}: {entry['preemptions']} preemptions, "
                  f"{entry['prefix_cache_hit_tokens']} prefix-cache hit tokens, "
                  f"{entry['runs_where_decoders_finished_before_long_first_token']} run(s) where the decoders finished "
                  f"before the long prompt's first token (raise --decode-tokens)")
    return rows


if __name__ == "__main__":
    sys.exit(main())
