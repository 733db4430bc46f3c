"""Preemption under memory pressure: throughput and total work with recompute, swap and auto.

Full run (about 1.5 minutes: ~15-20 s per mode with --threads 1; use a quiet machine):

    hf-paged bench swap                            # 48 requests, pool = half the workload's peak need
    hf-paged bench swap --plot

Quick smoke test: `hf-paged bench swap --small` (hidden 128, 2 layers, vocab 1000; 24 requests, prompts
32-128, 64 new tokens).

A workload that needs 2x the pool: throughput and total work under recompute, swap and auto.

Workload (random-weight Llama: hidden 512, 8 layers, 8 heads, 2 KV heads, intermediate 1376, vocab 32000,
max_len 4096, fp32; stdlib RNG, seed 0): 48 prompts of 64-256 random tokens, SamplingParams(max_tokens=128,
temperature=0, ignore_eos=True), all added at once, then llm.step() until done. Peak need = every request
holding prompt + max_tokens tokens at once = sum ceil((p + 128) / 16) blocks; the pool gets `--pool-fraction`
(0.5) of that. Engine: hf_paged.LLM(model, block_size=16, num_blocks=pool, max_num_seqs=128,
max_num_batched_tokens=4096, chunked prefill and prefix caching on (the defaults)) with
  recompute  preemption_mode="recompute"
  swap       preemption_mode="swap", swap_space = 2 x the pool's bytes (never full, so never falls back)
  auto       preemption_mode="auto", the same swap_space (per preemption: swap if 2 x bytes / measured copy
             bandwidth < tokens / estimated prefill tok/s, else recompute)
  reference  (for the equality check) preemption_mode="recompute" with the full peak need as the pool: no
             preemption at all
Each mode runs in its own subprocess after an untimed warm-up (4 other prompts, 4 new tokens). Reported: wall
time (first add_request -> last token), output tok/s (48 x 128 / wall), tokens run through the model
(stats num_batched_tokens; the ideal is every prompt token once plus 127 decode inputs per request), preemptions,
swap outs / ins, blocks swapped, recomputed tokens (tokens whose K/V were dropped), prefix-cache hit tokens (a
recomputed request can find its own freed-but-not-yet-evicted blocks, so recompute re-runs fewer tokens than it
dropped), and whether each mode's greedy tokens equal the reference's. Caveat: the engine's
prefix_cache_hit_tokens counter is bumped at every admission by the tokens already computed, swap-ins included,
so in swap / auto (with prefix caching on) that column is mostly tokens restored from swap, not prefix reuse;
--no-prefix-caching zeroes it.

Cost model check: after the run each worker reads the engine's estimates (scheduler.costs: copy bandwidth
measured once at start-up by hf_paged.kv.swap.measure_copy_bandwidth on 8 blocks, prefill tok/s as a moving
average of steps with >= 64 tokens), re-measures the copy bandwidth (median of 5, on 8 and on 64 blocks), and
prints the break-even: for N computed tokens swap costs 2 x N x bytes_per_token / bandwidth and recompute costs
N / prefill_rate, so swap is bandwidth / (2 x bytes_per_token x prefill_rate) times cheaper whatever N is
(bytes_per_token = spec.kv.bytes_per_block(16) / 16; the engine itself counts whole blocks, partial last block
included).
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

from .common import (add_common_args, emit_result, format_table, machine_info, pyplot, run_worker, save_figure,
                     set_threads, write_json)

MODES = ("reference", "recompute", "swap", "auto")
FULL = dict(model=dict(vocab_size=32000, hidden=512, layers=8, heads=8, kv_heads=2, max_len=4096,
                       intermediate_size=1376), requests=48, prompt_len=(64, 256), max_tokens=128)
SMALL = dict(model=dict(vocab_size=1000, hidden=128, layers=2, heads=4, kv_heads=2, max_len=2048,
                        intermediate_size=344), requests=24, prompt_len=(32, 128), max_tokens=64)
SEED = 0
MODULE = "hf_paged.bench.swap"
BLOCK = 16
BUDGET = 4096


def make_prompts(setup: dict, count: int, seed: int = SEED) -> list[list[int]]:
    """Deterministic random prompts; stdlib only so the parent stays torch-free."""
    rng = random.Random(seed)
    vocab, (lo, hi) = setup["model"]["vocab_size"], setup["prompt_len"]
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def peak_blocks(prompts: list[list[int]], max_tokens: int) -> int:
    return sum(-(-(len(p) + max_tokens) // BLOCK) for p in prompts)


# --- worker side -------------------------------------------------------------------------------------
def run_all(llm, hf_paged, prompts: list[list[int]], max_tokens: int) -> dict:
    params = hf_paged.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    before = llm.stats()
    t0 = time.perf_counter()
    ids = [llm.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {}
    steps = []  # (duration s, tokens run, running after, swap outs, swap ins, preemptions)
    prev = before
    while llm.has_unfinished_requests():
        start = time.perf_counter()
        outputs = llm.step()
        duration = time.perf_counter() - start
        stats = llm.stats()
        steps.append((duration, stats["num_batched_tokens"] - prev["num_batched_tokens"], stats["num_running"],
                      stats["num_swap_outs"] - prev["num_swap_outs"], stats["num_swap_ins"] - prev["num_swap_ins"],
                      stats["num_preemptions"] - prev["num_preemptions"]))
        prev = stats
        for out in outputs:
            if out.finished:
                tokens[out.request_id] = list(out.token_ids)
    seconds = time.perf_counter() - t0
    keys = ("num_batched_tokens", "num_preemptions", "num_swap_outs", "num_swap_ins", "num_blocks_swapped",
            "num_recomputed_tokens", "prefix_cache_hit_tokens", "num_steps", "num_generated_tokens")
    return {"seconds": seconds, "tokens": [tokens[i] for i in ids], "steps": steps,
            "stats": {k: prev[k] - before[k] for k in keys}}


def worker(args, setup: dict) -> None:
    threads = set_threads(args.threads)
    import hf_paged
    from hf_paged.model import describe_model
    from hf_paged.kv.swap import measure_copy_bandwidth
    from hf_paged.tiny import tiny_model

    model = tiny_model("llama", seed=SEED, sharpen=1.0, **setup["model"])
    prompts = make_prompts(setup, setup["requests"])
    need = peak_blocks(prompts, setup["max_tokens"])
    pool = need if args.worker == "reference" else max(1, int(need * args.pool_fraction))
    bytes_per_block = describe_model(model).kv.bytes_per_block(BLOCK)
    swap_space = args.swap_factor * pool * bytes_per_block
    mode = "recompute" if args.worker == "reference" else args.worker
    options = dict(block_size=BLOCK, num_blocks=pool, max_num_seqs=128, max_num_batched_tokens=BUDGET,
                   enable_prefix_caching=not args.no_prefix_caching, preemption_mode=mode)
    if mode != "recompute":
        options["swap_space"] = swap_space
    llm = hf_paged.LLM(model, **options)
    engine = llm.engine
    costs = engine.scheduler.costs
    startup = {"copy_bytes_per_s": costs.copy_bytes_per_s, "prefill_tokens_per_s": costs.prefill_tokens_per_s,
               "measured_at_startup": engine.memory.swap is not None}
    start = time.perf_counter()
    run_all(llm, hf_paged, make_prompts(setup, 4, seed=SEED + 1), 4)  # warm-up, untimed
    warmup = time.perf_counter() - start
    prefill_before = costs.prefill_tokens_per_s
    run = run_all(llm, hf_paged, prompts, setup["max_tokens"])
    engine.check_idle()
    bandwidth = {}
    copy = [engine.memory.swap.copy] if engine.memory.swap is not None else []  # the pool's own copy
    for blocks in (8, 64):
        samples = [measure_copy_bandwidth(engine.memory.cache, blocks, *copy) for _ in range(5)]
        bandwidth[str(min(blocks, pool))] = {"median": statistics.median(samples), "samples": samples}
    bpt = engine.spec.kv.bytes_per_block(BLOCK) / BLOCK
    # prefill throughput the steps actually showed: steps that ran >= 64 tokens (as the engine's estimate)
    big = [(s[0], s[1]) for s in run["steps"] if s[1] >= 64]
    observed_prefill = sum(n for _, n in big) / sum(t for t, _ in big) if big else None
    emit_result({"mode": args.worker, "preemption_mode": mode, "threads": threads, "num_blocks": pool,
                 "peak_need_blocks": need, "bytes_per_block": bytes_per_block, "bytes_per_token": bpt,
                 "swap_space": options.get("swap_space", 0),
                 "swap_blocks": engine.memory.swap.num_blocks if engine.memory.swap is not None else 0,
                 "warmup_seconds": warmup, "costs_at_startup": startup,
                 "costs_after_run": {"copy_bytes_per_s": costs.copy_bytes_per_s,
                                     "prefill_tokens_per_s": costs.prefill_tokens_per_s,
                                     "prefill_tokens_per_s_before_run": prefill_before},
                 "copy_bandwidth_remeasured": bandwidth, "observed_prefill_tokens_per_s": observed_prefill, **run})


# --- parent side -------------------------------------------------------------------------------------
def first_difference(a: list[list[int]], b: list[list[int]]) -> tuple[int, int, int] | None:
    """(requests that differ, first such request, first differing position) or None if identical."""
    diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    if not diff:
        return None
    i = diff[0]
    pos = next((k for k, (x, y) in enumerate(zip(a[i], b[i])) if x != y), min(len(a[i]), len(b[i])))
    return len(diff), i, pos


def breakeven(bandwidth: float, bpt: float, prefill: float) -> dict:
    swap_s, recompute_s = 2 * bpt / bandwidth, 1 / prefill
    return {"bandwidth_bytes_per_s": bandwidth, "prefill_tokens_per_s": prefill, "swap_s_per_token": swap_s,
            "recompute_s_per_token": recompute_s, "swap_cheaper_x": recompute_s / swap_s}


def plot(path: Path, report: dict) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (mode, r) in enumerate(report["modes"].items()):
        if "steps" not in r:
            continue
        t, elapsed = [], 0.0
        for s in r["steps"]:
            elapsed += s[0]
            t.append(elapsed)
        ax1.plot(t, [s[2] for s in r["steps"]], color=f"C{i}", label=mode, linewidth=1)
        ax2.plot(t, [s[1] for s in r["steps"]], color=f"C{i}", label=mode, linewidth=1)
    ax1.set_xlabel("seconds")
    ax1.set_ylabel("running requests")
    ax2.set_xlabel("seconds")
    ax2.set_ylabel("tokens run per step")
    ax2.set_yscale("log")
    for ax in (ax1, ax2):
        ax.legend(fontsize=8)
    fig.suptitle(f"{report['requests']} requests, pool = {report['pool_fraction']:.0%} of peak need")
    save_figure(fig, path)


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(prog="hf-paged bench swap", description=__doc__.split("\n")[0])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--pool-fraction", type=float, default=0.5, help="pool size / the workload's peak need")
    parser.add_argument("--swap-factor", type=int, default=2, help="swap_space = this x the pool's bytes")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="enable_prefix_caching=False (recompute then re-runs every dropped token)")
    add_common_args(parser, "swap", MODES, plot_help="running requests and tokens per step")
    args = parser.parse_args(argv)
    if not 0 < args.pool_fraction <= 1:
        parser.error("--pool-fraction must be in (0, 1]")
    return args, SMALL if args.small else FULL


def main(argv: list[str] | None = None) -> int:
    args, setup = parse_args(argv)
    if args.worker:
        worker(args, setup)
        return 0
    prompts = make_prompts(setup, setup["requests"])
    need = peak_blocks(prompts, setup["max_tokens"])
    prompt_tokens = sum(len(p) for p in prompts)
    ideal = prompt_tokens + setup["requests"] * (setup["max_tokens"] - 1)
    print(f"{setup['requests']} requests, prompts {setup['prompt_len'][0]}-{setup['prompt_len'][1]} tokens "
          f"({prompt_tokens} in all), {setup['max_tokens']} new each; peak need {need} blocks of {BLOCK}, pool "
          f"{int(need * args.pool_fraction)} blocks ({args.pool_fraction:.0%}); ideal work {ideal} tokens",
          flush=True)
    modes = run_modes(args)
    done = {m: r for m, r in modes.items() if "error" not in r}
    base_name = "reference" if "reference" in done else next(iter(done), None)
    rows, notes = summarise(modes, base_name, setup, ideal)
    costs_rows = swap_costs(done)
    report = {"benchmark": "swap", "small": args.small, "model": setup["model"], "dtype": "float32", "seed": SEED,
              "requests": setup["requests"], "prompt_len": list(setup["prompt_len"]),
              "max_tokens": setup["max_tokens"], "block_size": BLOCK, "max_num_batched_tokens": BUDGET,
              "prefix_caching": not args.no_prefix_caching, "peak_need_blocks": need,
              "pool_fraction": args.pool_fraction, "swap_factor": args.swap_factor, "prompt_tokens": prompt_tokens,
              "ideal_batched_tokens": ideal, "machine": machine_info(), "modes": modes}
    path = write_json(args.json, report)
    print_report(path, base_name, rows, notes, costs_rows, done)
    if args.plot is not None:
        plot(Path(args.plot) if args.plot else path.with_suffix(".png"), report)
    return 0 if len(done) == len(modes) else 1


def run_modes(args) -> dict[str, dict]:
    """Each mode's worker result (or {"error": ...}: the other modes still run)."""
    common_args = ["--pool-fraction", str(args.pool_fraction), "--swap-factor", str(args.swap_factor)] + \
        (["--no-prefix-caching"] if args.no_prefix_caching else []) + (["--small"] if args.small else []) + \
        (["--threads", str(args.threads)] if args.threads else [])
    modes: dict[str, dict] = {}
    for mode in args.modes:
        try:
            r = run_worker(["-m", MODULE, "--worker", mode, *common_args], timeout=args.timeout)
        except Exception as exc:  # noqa: BLE001 - report and keep going with the other modes
            print(f"  {mode}: FAILED\n{exc}", flush=True)
            modes[mode] = {"error": str(exc)}
            continue
        modes[mode] = r
        print(f"  {mode:<9} {r['seconds']:.2f} s, {r['stats']['num_preemptions']} preemptions "
              f"(warm-up {r['warmup_seconds']:.1f} s)", flush=True)
    return modes


def summarise(modes: dict[str, dict], base_name: str | None, setup: dict, ideal: int) -> tuple[list, list[str]]:
    """Annotate each finished mode (tok/s, work over the ideal, tokens equal to `base_name`'s; tokens dropped) and
    return the table's rows and the notes on differences."""
    done = {m: r for m, r in modes.items() if "error" not in r}
    base = done[base_name]["tokens"] if base_name else None
    output_tokens = setup["requests"] * setup["max_tokens"]
    rows, notes = [], []
    for mode, r in modes.items():
        if mode not in done:
            rows.append([mode, "failed"] + [None] * 12)
            continue
        s = r["stats"]
        r["output_tokens"] = sum(len(t) for t in r["tokens"])
        r["tok_per_s"] = r["output_tokens"] / r["seconds"]
        r["work_over_ideal"] = s["num_batched_tokens"] / ideal
        diff = first_difference(r["tokens"], base) if base is not None else None
        r["same_as_" + base_name] = setup["requests"] - (diff[0] if diff else 0)
        if diff:
            r["first_difference"] = {"requests_differing": diff[0], "request": diff[1], "position": diff[2]}
            notes.append(f"  NOTE {mode}: {diff[0]}/{setup['requests']} requests differ from {base_name}; first is "
                         f"request {diff[1]} at output position {diff[2]}")
        if r["output_tokens"] != output_tokens:
            notes.append(f"  WARNING {mode}: {r['output_tokens']} output tokens, expected {output_tokens}")
        rows.append([mode, r["num_blocks"], r["seconds"], r["tok_per_s"], s["num_batched_tokens"],
                     r["work_over_ideal"], s["num_steps"], s["num_preemptions"], s["num_swap_outs"],
                     s["num_swap_ins"], s["num_blocks_swapped"], s["num_recomputed_tokens"],
                     s["prefix_cache_hit_tokens"], f"{r['same_as_' + base_name]}/{setup['requests']}"])
    for r in done.values():
        r.pop("tokens", None)
    return rows, notes


def swap_costs(done: dict[str, dict]) -> list:
    """Each finished mode's swap-vs-recompute break-even per copy bandwidth measured (`breakeven`, in place)."""
    costs_rows = []
    for mode, r in done.items():
        bpt = r["bytes_per_token"]
        prefill = r["costs_after_run"]["prefill_tokens_per_s"]
        r["breakeven"] = {}
        candidates = [("engine start-up", r["costs_at_startup"]["copy_bytes_per_s"])] \
            if r["costs_at_startup"]["measured_at_startup"] else []
        candidates += [(f"re-measured, {n} blocks", v["median"]) for n, v in r["copy_bandwidth_remeasured"].items()]
        for label, bw in candidates:
            b = breakeven(bw, bpt, prefill)
            r["breakeven"][label] = b
            costs_rows.append([mode, label, bw / 1e9, prefill, r["observed_prefill_tokens_per_s"],
                               1e6 * b["swap_s_per_token"], 1e6 * b["recompute_s_per_token"], b["swap_cheaper_x"]])
    return costs_rows


def print_report(path, base_name: str | None, rows: list, notes: list[str], costs_rows: list, done: dict) -> None:
    print(f"\nresults written to {path}\n")
    print(format_table(["mode", "pool blocks", "seconds", "out tok/s", "tokens run", "x ideal", "steps", "preempt",
                        "swap outs", "swap ins", "blocks swapped", "recomputed tok", "prefix hit tok",
                        f"same as {base_name}"], rows))
    for line in notes:
        print(line)
    if costs_rows:
        bpt = next(iter(done.values()))["bytes_per_token"]
        print(f"\nswap vs recompute per token ({bpt:.0f} KV bytes/token; 'prefill est.' = the engine's moving average "
              f"after the run, 'observed' = this run's steps of >= 64 tokens):\n")
        print(format_table(["mode", "copy bandwidth", "GB/s", "prefill est. tok/s", "observed tok/s",
                            "swap us/tok", "recompute us/tok", "swap cheaper x"], costs_rows))


if __name__ == "__main__":
    sys.exit(main())
