"""KV memory: concurrent sequences and slot utilisation at a fixed KV byte budget, hf_paged vs HF padded DynamicCache.

Full run (a few minutes on 2 cores; use a quiet machine):

    hf-paged bench memory                          # 64 MiB budget, 160 requests, both length spreads
    hf-paged bench memory --budget-mb 64 --requests 160 --plot

Quick smoke test: `hf-paged bench memory --small` (hidden 128, 2 layers, vocab 1000, 1 MiB budget,
48 requests, prompts 8-256, generations 4-32).

Design goals: at the same KV bytes hf_paged holds >= 3x the concurrent sequences of HF padded, and >= 95 %
of its allocated KV slots hold real tokens at peak.

Workload (stdlib RNG, seed 0, identical in every process): `--requests` prompts of random ids (3..vocab) with
lengths drawn from 16-1024 tokens, and a per-request generation length drawn uniformly from 16-128 (an
emulated EOS: SamplingParams(max_tokens=g, ignore_eos=True, temperature=0)). Two prompt-length spreads:
  loguniform  log-uniform on [16, 1024] (mean ~242; skewed to short prompts like real chat/RAG traffic)
  uniform     uniform on [16, 1024] (mean ~520; pessimistic for paging: little to gain from short prompts)
Model: random-weight Llama (hidden 512, 8 layers, 8 heads, 2 KV heads -> head_dim 64, fp32), so one token
of KV costs bpt = 2 (K,V) * layers * kv_heads * head_dim * 4 bytes = 8192 bytes.

HF padded DynamicCache (analytical, one point measured). Static batches of B consecutive requests, left-padded
to the batch's longest prompt; every row keeps growing until the batch's last row is done, so a batch holds
    KV bytes(batch) = B * (max_prompt_len(batch) + max_new_tokens) * bpt          (reservation, max_new_tokens=128)
and its DynamicCache really ends at B * (max_prompt_len + max_gen_len(batch) - 1) * bpt (the last sampled token
is never cached). "Concurrent sequences" for HF = the largest B for which EVERY batch of the workload satisfies
the reservation formula <= budget (a static server must not OOM on any batch). Its slot utilisation =
sum_i (p_i + min(g_i, G-1)) / (B * (P + G - 1)) for the batch's real cache at its end (peak), P/G the batch
maxima; "mean" is the same ratio summed over every decode step of every batch. The worker `hf_padded` checks
the formula: it runs `model.generate` (left padding, attention mask, min_new_tokens = max_new_tokens =
G, eos_token_id=None, return_dict_in_generate=True) on the workload's largest-footprint batch at that B, with
hf_paged.disable(), and sums the bytes of `output.cache.layers[i].keys/.values` (transformers 5.x
DynamicLayer; `.past_key_values` is the deprecated name). torch.cat's transient second copy during each
layer's growth is not counted (it exists for one layer at a time).

hf_paged (measured): one process runs hf_paged.LLM(model, kv_cache_memory=budget bytes, block_size=16,
max_num_seqs=4096 so only memory limits concurrency, chunked prefill with the default 4096-token step budget),
adds all requests, and after every llm.step() records num_running, num_waiting and
    slot utilisation = sum(r.num_computed_tokens for r in running) / (sum(len(table) for table in r.block_tables) * block_size)
(allocated slots only; the free blocks are reported separately as pool use). Reported: peak concurrent
sequences and the utilisation at that step, plus the mean / minimum over "saturated" steps (requests still
waiting, i.e. memory is the limit) and the preemption count. Ratios are hf_paged / hf_padded.
"""
from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

from .common import (add_common_args, emit_result, format_table, machine_info, pyplot, run_worker, save_figure,
                     set_threads, write_json)

DISTS = ("loguniform", "uniform")
FULL = dict(model=dict(vocab_size=32000, hidden=512, layers=8, heads=8, kv_heads=2, max_len=8192,
                       intermediate_size=1376), prompt_len=(16, 1024), gen_len=(16, 128), max_new_tokens=128,
            requests=160, budget_mb=64.0, block_size=16)
SMALL = dict(model=dict(vocab_size=1000, hidden=128, layers=2, heads=4, kv_heads=2, max_len=2048,
                        intermediate_size=344), prompt_len=(8, 256), gen_len=(4, 32), max_new_tokens=32,
             requests=48, budget_mb=1.0, block_size=16)
SEED = 0
MODULE = "hf_paged.bench.memory"
MiB = 1 << 20


def bytes_per_token(model: dict, itemsize: int = 4) -> int:
    """K and V, every layer, every KV head: what one cached token costs (fp32 by default)."""
    return 2 * model["layers"] * model["kv_heads"] * (model["hidden"] // model["heads"]) * itemsize


def make_workload(setup: dict, count: int, dist: str, seed: int = SEED) -> tuple[list[list[int]], list[int]]:
    """(prompts, generation lengths); stdlib only so the parent stays torch-free and every process agrees."""
    rng = random.Random(f"{seed}-{dist}")
    (lo, hi), (glo, ghi), vocab = setup["prompt_len"], setup["gen_len"], setup["model"]["vocab_size"]
    prompts, gens = [], []
    for _ in range(count):
        if dist == "loguniform":
            length = min(hi, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi))))))
        else:
            length = rng.randint(lo, hi)
        prompts.append([rng.randrange(3, vocab) for _ in range(length)])
        gens.append(rng.randint(glo, ghi))
    return prompts, gens


# --- HF padded: analytical ---------------------------------------------------------------------------
def batches(count: int, size: int) -> list[range]:
    return [range(start, min(start + size, count)) for start in range(0, count, size)]


def padded_reservation(lens: list[int], idx: range, max_new: int, bpt: int) -> int:
    return len(idx) * (max(lens[i] for i in idx) + max_new) * bpt


def hf_padded_analysis(lens: list[int], gens: list[int], max_new: int, bpt: int, budget: int) -> dict:
    """Largest static batch size whose every batch fits the budget, and its slot utilisation."""
    fits = 0
    for size in range(1, len(lens) + 1):
        if all(padded_reservation(lens, idx, max_new, bpt) <= budget for idx in batches(len(lens), size)):
            fits = size
    if fits == 0:
        return {"concurrent_seqs": 0, "note": "not even one padded sequence fits the budget"}
    groups = batches(len(lens), fits)
    worst = max(groups, key=lambda idx: padded_reservation(lens, idx, max_new, bpt))
    real_total = slot_total = 0
    for idx in groups:
        p, g = max(lens[i] for i in idx), max(gens[i] for i in idx)
        for step in range(1, g):  # cache length after decode step `step` is p + step
            real_total += sum(lens[i] + min(gens[i], step) for i in idx)
            slot_total += len(idx) * (p + step)
    p, g = max(lens[i] for i in worst), max(gens[i] for i in worst)
    real_peak = sum(lens[i] + min(gens[i], g - 1) for i in worst)
    return {"concurrent_seqs": fits, "worst_batch": [worst.start, worst.stop], "worst_batch_max_prompt": p,
            "worst_batch_max_gen": g, "reserved_bytes": padded_reservation(lens, worst, max_new, bpt),
            "predicted_cache_bytes": len(worst) * (p + g - 1) * bpt,
            "slot_utilisation_at_peak": real_peak / (len(worst) * (p + g - 1)),
            "slot_utilisation_mean": real_total / slot_total if slot_total else None,
            "next_size_reserved_bytes": max(padded_reservation(lens, idx, max_new, bpt)
                                            for idx in batches(len(lens), fits + 1)) if fits < len(lens) else None}


# --- worker side -------------------------------------------------------------------------------------
def hf_padded_worker(model, prompts, gens, batch: list[int]) -> dict:
    import torch

    rows = [prompts[i] for i in range(*batch)]
    width, g = max(len(p) for p in rows), max(gens[i] for i in range(*batch))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in rows])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=g, min_new_tokens=g, do_sample=False,
                             pad_token_id=0, eos_token_id=None, return_dict_in_generate=True)
    seconds = time.perf_counter() - start
    cache = out.get("cache", None)
    if cache is None:
        cache = out.get("past_key_values", None)
    layers = getattr(cache, "layers", None)
    if not layers:
        return {"measured": False, "reason": f"generate returned no per-layer cache ({type(cache).__name__})",
                "seconds": seconds}
    tensors = [t for layer in layers for t in (layer.keys, layer.values) if t is not None]
    return {"measured": True, "cache_type": type(cache).__name__, "num_layers": len(layers),
            "kv_shape": list(tensors[0].shape), "cache_bytes": sum(t.numel() * t.element_size() for t in tensors),
            "batch": len(rows), "max_prompt": width, "max_gen": g, "seconds": seconds}


def paged_worker(model, prompts, gens, budget: int, block_size: int) -> dict:
    import hf_paged

    llm = hf_paged.LLM(model, kv_cache_memory=budget, block_size=block_size, max_num_seqs=4096)
    engine = llm.engine
    for p, g in zip(prompts, gens):
        llm.add_request(p, hf_paged.SamplingParams(max_tokens=g, temperature=0.0, ignore_eos=True))
    running, waiting, computed, slots, used_blocks, mismatches = [], [], [], [], [], 0
    total_blocks = engine.scheduler.kv.pool.num_blocks
    finished = generated = 0
    start = time.perf_counter()
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                finished += 1
                generated += len(out.token_ids)
        reqs = engine.scheduler.running
        n_blocks = sum(len(table) for r in reqs for table in r.block_tables)
        mismatches += n_blocks != total_blocks - engine.scheduler.kv.pool.num_free_blocks  # nothing else may hold blocks
        running.append(len(reqs))
        waiting.append(len(engine.scheduler.waiting))
        computed.append(sum(r.num_computed_tokens for r in reqs))
        slots.append(n_blocks * block_size)
        used_blocks.append(n_blocks)
    seconds = time.perf_counter() - start
    stats = llm.stats()
    return {"steps": len(running), "seconds": seconds, "num_blocks": total_blocks, "kv_cache_bytes":
            stats["kv_cache_bytes"], "num_preemptions": stats["num_preemptions"], "num_recomputed_tokens":
            stats.get("num_recomputed_tokens"), "finished": finished, "generated_tokens": generated,
            "expected_tokens": sum(gens), "block_accounting_mismatches": mismatches,
            "trace": {"running": running, "waiting": waiting, "computed_tokens": computed, "slots": slots,
                      "used_blocks": used_blocks}}


def worker(args, setup: dict) -> None:
    threads = set_threads(args.threads)
    import hf_paged
    from hf_paged.tiny import tiny_model

    if args.worker == "hf_padded":
        hf_paged.disable()  # the baseline runs on unpatched transformers
    model = tiny_model("llama", seed=SEED, sharpen=1.0, **setup["model"])
    prompts, gens = make_workload(setup, args.requests, args.dist)
    if args.worker == "hf_padded":
        result = hf_padded_worker(model, prompts, gens, args.batch)
    else:
        result = paged_worker(model, prompts, gens, int(args.budget_mb * MiB), setup["block_size"])
    emit_result({"system": args.worker, "dist": args.dist, "threads": threads, **result})


# --- parent side -------------------------------------------------------------------------------------
def summarise_paged(r: dict) -> dict:
    t = r["trace"]
    util = [c / s if s else None for c, s in zip(t["computed_tokens"], t["slots"])]
    peak = max(t["running"])
    at = t["running"].index(peak)
    saturated = [i for i, w in enumerate(t["waiting"]) if w > 0 and t["running"][i] > 0]
    sat_util = [util[i] for i in saturated if util[i] is not None]
    return {"concurrent_seqs": peak, "peak_step": at, "slot_utilisation_at_peak": util[at],
            "pool_use_at_peak": t["used_blocks"][at] / r["num_blocks"],
            "saturated_steps": len(saturated),
            "mean_concurrent_seqs_saturated": sum(t["running"][i] for i in saturated) / len(saturated)
            if saturated else None,
            "slot_utilisation_mean": sum(sat_util) / len(sat_util) if sat_util else None,
            "slot_utilisation_min": min(sat_util) if sat_util else None,
            "pool_use_mean": sum(t["used_blocks"][i] for i in saturated) / len(saturated) / r["num_blocks"]
            if saturated else None}


def plot(path: Path, report: dict) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, (dist, entry) in enumerate(report["runs"].items()):
        color = f"C{i}"
        paged = entry.get("hf_paged", {})
        if "trace" in paged:
            ax.plot(paged["trace"]["running"], color=color, label=f"hf_paged running ({dist})")
        hf = entry["hf_padded"]["concurrent_seqs"]
        ax.axhline(hf, color=color, linestyle="--", label=f"HF padded batch ({dist}): {hf}")
    ax.set_xlabel("engine step")
    ax.set_ylabel("concurrent sequences")
    ax.set_title(f"KV budget {report['budget_mb']:g} MiB: sequences held")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(prog="hf-paged bench memory", description=__doc__.split("\n")[0])
    parser.add_argument("--budget-mb", type=float, default=None, help="KV byte budget in MiB (default 64; small 1)")
    parser.add_argument("--requests", type=int, default=None, help="requests in the workload (default 160; small 48)")
    parser.add_argument("--dists", nargs="+", choices=DISTS, default=list(DISTS), help="prompt-length spreads")
    parser.add_argument("--no-measure-hf", action="store_true", help="skip the HF generate cache measurement")
    add_common_args(parser, "memory", ("hf_paged", "hf_padded"), plot_help="running sequences per step", timeout=3600)
    parser.add_argument("--dist", choices=DISTS, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    setup = SMALL if args.small else FULL
    args.requests = args.requests or setup["requests"]
    args.budget_mb = args.budget_mb or setup["budget_mb"]
    return args, setup


def main(argv: list[str] | None = None) -> int:
    args, setup = parse_args(argv)
    if args.worker:
        worker(args, setup)
        return 0
    budget = int(args.budget_mb * MiB)
    bpt = bytes_per_token(setup["model"])
    common_args = ["--requests", str(args.requests), "--budget-mb", repr(args.budget_mb)] + \
        (["--small"] if args.small else []) + (["--threads", str(args.threads)] if args.threads else [])
    print(f"KV budget {args.budget_mb:g} MiB = {budget // bpt} tokens at {bpt} bytes/token; "
          f"{args.requests} requests, prompts {setup['prompt_len']}, generations {setup['gen_len']}", flush=True)
    runs, rows, ok = {}, [], True
    for dist in args.dists:
        entry, ok_here = run_dist(args, setup, dist, bpt, budget, common_args)
        runs[dist], ok = entry, ok and ok_here
        rows.extend(table_rows(dist, entry, args.budget_mb))
    report = {"benchmark": "memory", "small": args.small, "model": setup["model"], "dtype": "float32",
              "bytes_per_token": bpt, "budget_mb": args.budget_mb, "budget_bytes": budget,
              "block_size": setup["block_size"], "requests": args.requests, "prompt_len": list(setup["prompt_len"]),
              "gen_len": list(setup["gen_len"]), "max_new_tokens": setup["max_new_tokens"], "seed": SEED,
              "targets": {"ratio": 3.0, "slot_utilisation": 0.95}, "machine": machine_info(), "runs": runs}
    path = write_json(args.json, report)
    print(f"\nresults written to {path}\n")
    print_report(rows, runs, args.small)
    if args.plot is not None:
        plot(Path(args.plot) if args.plot else path.with_suffix(".png"), report)
    return 0 if ok else 1


def run_dist(args, setup: dict, dist: str, bpt: int, budget: int, common_args: list[str]) -> tuple[dict, bool]:
    """One prompt-length spread: HF's padded cache (the formula, and measured in a worker unless --no-measure-hf)
    and hf_paged's run; (its entry of the report, whether hf_paged finished everything with consistent blocks)."""
    prompts, gens = make_workload(setup, args.requests, dist)
    lens = [len(p) for p in prompts]
    hf = hf_padded_analysis(lens, gens, setup["max_new_tokens"], bpt, budget)
    entry = {"mean_prompt_len": sum(lens) / len(lens), "mean_gen_len": sum(gens) / len(gens), "hf_padded": hf}
    if hf["concurrent_seqs"] and not args.no_measure_hf:
        try:
            m = run_worker(["-m", MODULE, "--worker", "hf_padded", "--dist", dist, "--batch",
                            *map(str, hf["worst_batch"]), *common_args], timeout=args.timeout)
            hf["measured"] = m
            if m.get("measured"):
                hf["measured_matches_formula"] = m["cache_bytes"] == hf["predicted_cache_bytes"]
                print(f"  [{dist}] HF generate, batch {m['batch']} (prompt <= {m['max_prompt']}, "
                      f"{m['max_gen']} new): DynamicCache {m['cache_bytes'] / MiB:.2f} MiB, formula "
                      f"{hf['predicted_cache_bytes'] / MiB:.2f} MiB, reservation "
                      f"{hf['reserved_bytes'] / MiB:.2f} MiB ({m['seconds']:.1f} s)", flush=True)
            else:
                print(f"  [{dist}] HF cache not measurable: {m.get('reason')}", flush=True)
        except Exception as exc:  # noqa: BLE001 - the analytical number still stands
            hf["measured"] = {"measured": False, "reason": str(exc)}
            print(f"  [{dist}] HF generate measurement FAILED\n{exc}", flush=True)
    ok = True
    try:
        r = run_worker(["-m", MODULE, "--worker", "hf_paged", "--dist", dist, *common_args], timeout=args.timeout)
        r.update(summarise_paged(r))
        print(f"  [{dist}] hf_paged: {r['steps']} steps in {r['seconds']:.1f} s, {r['num_blocks']} blocks, "
              f"{r['num_preemptions']} preemptions", flush=True)
        if r["finished"] != args.requests or r["generated_tokens"] != r["expected_tokens"] or \
                r["block_accounting_mismatches"]:
            print(f"  [{dist}] WARNING: finished {r['finished']}/{args.requests}, tokens "
                  f"{r['generated_tokens']}/{r['expected_tokens']}, "
                  f"block mismatches {r['block_accounting_mismatches']}")
            ok = False
    except Exception as exc:  # noqa: BLE001
        r = {"error": str(exc)}
        print(f"  [{dist}] hf_paged FAILED\n{exc}", flush=True)
        ok = False
    entry["hf_paged"] = r
    if "error" not in r and hf["concurrent_seqs"]:
        entry["ratio_peak"] = r["concurrent_seqs"] / hf["concurrent_seqs"]
        entry["ratio_mean_saturated"] = (r["mean_concurrent_seqs_saturated"] or 0) / hf["concurrent_seqs"]
    return entry, ok


def table_rows(dist: str, entry: dict, budget_mb: float) -> list[list]:
    hf, r = entry["hf_padded"], entry["hf_paged"]
    hf_bytes = hf.get("measured", {}).get("cache_bytes") or hf.get("reserved_bytes")
    rows = [[f"hf_padded ({dist})", budget_mb, hf["concurrent_seqs"], None, hf.get("slot_utilisation_at_peak"),
             hf.get("slot_utilisation_mean"), None if hf_bytes is None else hf_bytes / MiB, None]]
    if "error" in r:
        return rows + [[f"hf_paged ({dist})", budget_mb, "failed", None, None, None, None, None]]
    return rows + [[f"hf_paged ({dist})", budget_mb, r["concurrent_seqs"], r["mean_concurrent_seqs_saturated"],
                    r["slot_utilisation_at_peak"], r["slot_utilisation_mean"], r["kv_cache_bytes"] / MiB,
                    entry.get("ratio_peak")]]


def print_report(rows: list[list], runs: dict, small: bool) -> None:
    def pct(v):
        return None if v is None else f"{100 * v:.1f}%"
    for row in rows:
        row[4], row[5] = pct(row[4]), pct(row[5])
    print(format_table(["system", "budget MiB", "concurrent seqs (peak)", "mean seqs (saturated)",
                        "slot util at peak", "slot util mean", "KV MiB used/reserved", "x HF padded"], rows))
    for dist, entry in runs.items():
        if "ratio_peak" in entry:
            p = entry["hf_paged"]
            meets = entry["ratio_peak"] >= 3 and p["slot_utilisation_at_peak"] >= 0.95
            verdict = "" if small else f" -> {'meets' if meets else 'misses'} the targets (>= 3x, >= 95%)"
            print(f"{dist}: hf_paged holds {entry['ratio_peak']:.2f}x the sequences at peak "
                  f"({entry['ratio_mean_saturated']:.2f}x on average while memory-bound), "
                  f"{100 * p['slot_utilisation_at_peak']:.1f}% of slots real at peak{verdict}")


if __name__ == "__main__":
    sys.exit(main())
