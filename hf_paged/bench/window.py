"""Sliding-window memory on the engine: a model whose every layer attends through one window, long generations, a
fixed KV pool; the engine giving back the blocks behind the window vs the same engine keeping every block.

    hf-paged bench window                     # window 128, 32 requests, 512 new tokens each, a 160-block pool
    hf-paged bench window --small             # quick smoke run
    hf-paged bench window --plot              # also a PNG: running requests and blocks in use over time

Model: a random-weight Mistral built from a config (hidden 256, 4 layers, 4 heads, 2 KV heads, vocab 1000, fp32,
`--window` on every layer; output head scaled so greedy choices have clear margins). Workload: `--requests` prompts
of 32-64 random tokens, `--max-tokens` new tokens each (greedy, no EOS), all added at once to
`hf_paged.LLM(model, num_blocks=--num-blocks, block_size=16)`. Each system runs in a fresh worker process:

  release   the engine as shipped: before each step a running request's blocks wholly behind the window go back
  keep      the same engine with that switched off (what it did before 2026-12-04): every block until the end

Reported per system: wall time of the whole run, output tokens per second, running requests per step (peak and mean
over the steps), KV blocks in use (peak), preemptions, and whether both produced the same tokens. A request must still
fit the pool whole (prompt + max_tokens) to be accepted, with or without the release.
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
    parser.add_argument("--window", type=int, default=128, help="sliding window of every layer (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=32, help="requests (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=512, help="new tokens each (default: %(default)s)")
    parser.add_argument("--num-blocks", type=int, default=160, help="KV pool blocks of 16 (default: %(default)s)")
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
    from hf_paged.tiny import tiny_model

    size = dict(hidden=64, layers=2) if args.small else dict(hidden=256, layers=4)
    return tiny_model("mistral", vocab_size=1000, heads=4, kv_heads=2, max_len=4096, sliding_window=args.window,
                      **size)


def workload(args) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(3, 1000) for _ in range(rng.randint(32, 64))] for _ in range(args.requests)]


def worker(args) -> dict:
    from hf_paged import LLM, SamplingParams

    threads = set_threads(args.threads)
    llm = LLM(build_model(args), num_blocks=args.num_blocks, block_size=16)
    if args.worker == "keep":
        llm.engine.scheduler.release_window = None
    engine = llm.engine
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    groups = [engine.add_request(prompt, params) for prompt in workload(args)]
    running, in_use, times = [], [], []
    start = time.perf_counter()
    while engine.has_unfinished:
        engine.step()
        running.append(len(engine.scheduler.running))
        in_use.append(engine.scheduler.kv.pool.num_blocks - engine.scheduler.kv.num_free_blocks)
        times.append(time.perf_counter() - start)
    seconds = time.perf_counter() - start
    every = max(1, len(times) // 400)  # at most ~400 points per series for the plot
    stats = llm.stats()
    engine.check_idle()
    return {"system": args.worker, "seconds": seconds, "threads": threads,
            "output_tokens": args.requests * args.max_tokens,
            "tok_per_s": args.requests * args.max_tokens / seconds, "steps": len(running),
            "peak_running": max(running), "mean_running": sum(running) / len(running),
            "peak_blocks_in_use": max(in_use), "num_preemptions": stats["num_preemptions"],
            "num_blocks_released": stats["num_blocks_released"], "window": engine.scheduler.release_window,
            "series": [[round(t, 4), r, b] for t, r, b in list(zip(times, running, in_use))[::every]],
            "tokens": [g.samples[0].output_token_ids for g in groups]}


def main(argv=None) -> int:
    args = parse_args(argv)
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
             f"{r['mean_running']:.1f}", r["peak_blocks_in_use"], r["num_preemptions"], r["num_blocks_released"]]
            for r in results]
    print(f"mistral, window {args.window}, {args.requests} requests x {args.max_tokens} new tokens, "
          f"{args.num_blocks} blocks of 16; identical outputs: {identical}")
    print(format_table(["system", "seconds", "tok/s", "peak running", "mean running", "peak blocks", "preemptions",
                        "blocks released"], rows))
    print(f"speed-up {results[1]['seconds'] / results[0]['seconds']:.2f}x")
    path = write_json(args.json, {"benchmark": "window", "window": args.window, "requests": args.requests,
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
    ax2.set(xlabel="seconds", ylabel="KV blocks in use", title=f"blocks in use (pool: {args.num_blocks})")
    for ax in (ax1, ax2):
        ax.legend()
    fig.suptitle(f"sliding window {args.window}: {args.requests} requests x {args.max_tokens} new tokens")
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
