"""Sliding-window memory on the engine: long generations on a fixed KV pool, the engine giving back the blocks behind
each sliding window vs the same engine keeping every block.

    hf-paged bench window                     # mistral: window 128 on every layer, 32 x 512 new tokens, 160 blocks
    hf-paged bench window --arch gemma3       # 5 sliding : 1 full layers, window 128, 32 x 1,024 new tokens
    hf-paged bench window --small             # quick smoke run
    hf-paged bench window --plot              # also a PNG: running requests and blocks in use over time

Models (random weights built from a config, hidden 256, 4 heads, 2 KV heads, vocab 1000, fp32, output head scaled so
greedy choices have clear margins): `mistral`, 4 layers, `--window` on every layer (one KV group); `gemma3`, a Gemma 3
text stack of 6 layers, 5 sliding-window (`--window`) : 1 full attention, as the family's own pattern (six KV groups
of one layer each: kv/groups.py). Workload: `--requests` prompts of 32-64 random tokens, `--max-tokens` new tokens
each (greedy, no EOS), all added at once to `hf_paged.LLM(model, num_blocks=--num-blocks, block_size=16)`
(`num_blocks` counts blocks of every layer: the same memory for both systems). Each system runs in a fresh worker
process:

  release   the engine as shipped: before each step a running request's blocks wholly behind a window go back
  keep      the same engine with that switched off (what it did before 2026-12-04 on mistral, and before
            2026-12-05 on mixed stacks): every block until the end

Reported per system: wall time of the whole run, output tokens per second, running requests per step (peak and mean
over the steps), KV block ids in use (peak; with several groups an id holds one group's layers), the most any running
request held at once (`peak blocks / request`: the memory one generation needs), preemptions, and whether both produced
the same tokens. A request must still fit the pool whole (prompt + max_tokens) to be accepted, with or without the
release.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .common import default_json, emit_result, format_table, pyplot, run_worker, save_figure, set_threads, write_json

SYSTEMS = ("release", "keep")


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="hf-paged bench window", description=__doc__.split("\n")[0])
    parser.add_argument("--arch", choices=("mistral", "gemma3"), default="mistral",
                        help="mistral: one window on every layer; gemma3: 5 sliding : 1 full (default: %(default)s)")
    parser.add_argument("--window", type=int, default=128, help="sliding window (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=32, help="requests (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="new tokens each (default: 512 for mistral, 1024 for gemma3)")
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="KV pool: blocks of 16 tokens of every layer (default: 160 for mistral, 640 for gemma3)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--small", action="store_true", help="hidden 64, 2 layers, window 16, 8 x 64 tokens")
    parser.add_argument("--json", default=default_json("window"),
                        help="where to write the results (default: %(default)s in the current folder)")
    parser.add_argument("--plot", nargs="?", const="", default=None, metavar="PNG",
                        help="write a PNG of running requests and blocks in use over time (needs matplotlib; default "
                             "path: the JSON's, ending .png)")
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def build_model(args):
    from hf_paged.tiny import tiny_mixed, tiny_model

    hidden = 64 if args.small else 256
    if args.arch == "gemma3":
        return tiny_mixed("gemma3_text", window=args.window, hidden=hidden, vocab_size=1000, max_len=4096,
                          head_dim=64, query_pre_attn_scalar=64)
    return tiny_model("mistral", vocab_size=1000, heads=4, kv_heads=2, max_len=4096, sliding_window=args.window,
                      hidden=hidden, layers=2 if args.small else 4)


def workload(args) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(3, 1000) for _ in range(rng.randint(32, 64))] for _ in range(args.requests)]


def worker(args) -> dict:
    from hf_paged import LLM, SamplingParams
    from hf_paged.kv import held

    threads = set_threads(args.threads)
    llm = LLM(build_model(args), num_blocks=args.num_blocks, block_size=16)
    if args.worker == "keep":
        llm.engine.scheduler.release_window = None
    engine = llm.engine
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    groups = [engine.add_request(prompt, params) for prompt in workload(args)]
    running, in_use, times, per_request = [], [], [], 0
    start = time.perf_counter()
    kv = engine.scheduler.kv
    while engine.has_unfinished:
        engine.step()
        running.append(len(engine.scheduler.running))
        in_use.append(kv.pool.num_blocks - kv.num_free_blocks)
        times.append(time.perf_counter() - start)
        per_request = max([per_request] + [sum(len(held(t)) for t in r.block_tables) for r in engine.scheduler.running])
    seconds = time.perf_counter() - start
    every = max(1, len(times) // 400)  # at most ~400 points per series for the plot
    stats = llm.stats()
    engine.check_idle()
    return {"system": args.worker, "seconds": seconds, "threads": threads,
            "output_tokens": args.requests * args.max_tokens,
            "tok_per_s": args.requests * args.max_tokens / seconds, "steps": len(running),
            "peak_running": max(running), "mean_running": sum(running) / len(running),
            "peak_blocks_in_use": max(in_use), "peak_blocks_per_request": per_request,
            "pool_blocks": kv.pool.num_blocks, "kv_groups": kv.num_groups, "num_preemptions": stats["num_preemptions"],
            "num_blocks_released": stats["num_blocks_released"], "window": engine.scheduler.release_window,
            "series": [[round(t, 4), r, b] for t, r, b in list(zip(times, running, in_use))[::every]],
            "tokens": [g.samples[0].output_token_ids for g in groups]}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.max_tokens is None:
        args.max_tokens = 1024 if args.arch == "gemma3" else 512
    if args.num_blocks is None:
        args.num_blocks = 640 if args.arch == "gemma3" else 160
    if args.small:
        args.window, args.requests, args.max_tokens, args.num_blocks = 16, 8, 64, 24
    if args.worker:
        emit_result(worker(args))
        return 0
    passed = list(argv if argv is not None else sys.argv[1:])  # --small too: the workers apply it as above
    if args.plot is not None:  # --plot [PNG] is the parent's alone
        at = passed.index("--plot")
        del passed[at:at + (2 if at + 1 < len(passed) and not passed[at + 1].startswith("--") else 1)]
    results = [run_worker(["-m", "hf_paged.bench.window", *passed, "--worker", system]) for system in SYSTEMS]
    identical = results[0]["tokens"] == results[1]["tokens"]
    for r in results:
        del r["tokens"]
    rows = [[r["system"], f"{r['seconds']:.2f}", f"{r['tok_per_s']:.0f}", r["peak_running"],
             f"{r['mean_running']:.1f}", r["peak_blocks_in_use"], r["peak_blocks_per_request"], r["num_preemptions"],
             r["num_blocks_released"]] for r in results]
    print(f"{args.arch}, window {args.window}, {args.requests} requests x {args.max_tokens} new tokens, "
          f"{args.num_blocks} blocks of 16 of every layer ({results[0]['pool_blocks']} ids in "
          f"{results[0]['kv_groups']} KV groups); identical outputs: {identical}")
    print(format_table(["system", "seconds", "tok/s", "peak running", "mean running", "peak blocks",
                        "peak blocks / request", "preemptions", "blocks released"], rows))
    held_ratio = results[0]["peak_blocks_per_request"] / max(results[1]["peak_blocks_per_request"], 1)
    print(f"speed-up {results[1]['seconds'] / results[0]['seconds']:.2f}x; one generation holds "
          f"{100 * held_ratio:.0f}% of the blocks it holds keeping every block")
    path = write_json(args.json, {"benchmark": "window", "arch": args.arch, "window": args.window,
                                  "requests": args.requests,
                                  "max_tokens": args.max_tokens, "num_blocks": args.num_blocks, "small": args.small,
                                  "identical": identical, "results": results})
    print(f"results written to {path}")
    if args.plot is not None:
        plot(Path(args.plot) if args.plot else Path(path).with_suffix(".png"), results, args)
    return 0 if identical else 1


def plot(path: Path, results: list[dict], args) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, r in enumerate(results):
        t = [s[0] for s in r["series"]]
        label = f"{r['system']} ({r['seconds']:.1f} s)"
        ax1.plot(t, [s[1] for s in r["series"]], color=f"C{i}", label=label, linewidth=1)
        ax2.plot(t, [s[2] for s in r["series"]], color=f"C{i}", label=label, linewidth=1)
    ax1.set(xlabel="seconds", ylabel="running requests", title="requests running per step")
    pool = results[0].get("pool_blocks", args.num_blocks)
    ax2.set(xlabel="seconds", ylabel="KV block ids in use", title=f"block ids in use (pool: {pool})")
    for ax in (ax1, ax2):
        ax.legend()
    fig.suptitle(f"{args.arch}, sliding window {args.window}: {args.requests} requests x {args.max_tokens} new tokens")
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
