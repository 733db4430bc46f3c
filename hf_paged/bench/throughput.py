"""CPU throughput: hf_paged `LLM.generate` vs HF padded `generate` vs HF's built-in `generate_batch`.

Full run (takes a while; use a quiet machine):

    hf-paged bench throughput                      # == --requests 16 64 --max-tokens 64
    hf-paged bench throughput --threads 8
    hf-paged bench throughput --repeats 3         # 3 interleaved rounds: each system's fastest, paired ratios

Quick smoke test: `hf-paged bench throughput --small` (hidden 128, 2 layers, vocab 1000, 4 and 8 requests,
8 new tokens): every system in one worker process per round (importing transformers costs more than such runs; the
full runs give each system a fresh process), about 10 s and 0.8 GB on a 2-core machine.

`--arch qwen3_5_text`: a random Qwen3.5-shaped hybrid instead (hidden 512, 8 layers 3 Gated DeltaNet : 1 full
attention, 8 heads / 2 KV heads of 64, linear attention 4 key / 8 value heads of 64, intermediate 1024, vocab 32000;
`--small`: hidden 128, 4 layers), same prompts. HF's `generate_batch` does not run linear-attention layers, so the
default systems there are hf_paged and hf_padded.

Workload: random-weight Llama (hidden 512, 8 layers, 8 heads, 2 KV heads, intermediate 1376, vocab 32000,
fp32, sdpa), prompts of 16-200 random tokens (seed 0), `--max-tokens` new tokens each, greedy, EOS ignored.
Systems:
  hf_paged           hf_paged.LLM(model, block_size=16, max_num_seqs=128).generate(prompts,
                     SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True), use_tqdm=False)
  hf_padded          model.generate on the whole left-padded batch with an attention mask (max_new_tokens=
                     min_new_tokens=64, do_sample=False, eos_token_id=None so no token is masked or stops a row)
  hf_generate_batch  model.generate_batch(inputs, GenerationConfig(max_new_tokens=64, do_sample=False,
                     eos_token_id=-1), warmup=False) with hf_paged.disable() called first. HF's default
                     ContinuousBatchingConfig sizes the KV cache from host RAM (GBs, allocated on every call);
                     warmup=False skips its dummy max-size batches, which on CPU capture nothing.
  hf_generate_batch_sized  (opt-in via --systems) the same with ContinuousBatchingConfig(num_blocks=just enough)
"CPU s" is the worker's process CPU time over the timed call (time.process_time): with --threads 1 it hardly moves
when other work shares the machine, while wall seconds do; the JSON also records the load average before and after.
Each (system, request count) runs in its own subprocess (same seed => identical weights and prompts), does a
2-request/4-token warm-up, then times one call with time.perf_counter; engine construction (LLM(...)) is
outside the timing, generate_batch's per-call manager start-up is inside it (that is its API). Peak RSS is
the worker's ru_maxrss. "matmul limit" = output tokens / (workload FLOPs / best fp32 1024^3 matmul FLOP/s),
FLOPs = 2*non-embedding params*(prompt+output tokens) + 2*lm_head params*output tokens (attention ignored).
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

from .common import (add_common_args, emit_result, format_table, machine_info, machine_load, matmul_gflops,
                     peak_rss_mb, plot_path, run_worker, set_threads, write_json)
from .throughput_plot import plot

SYSTEMS = ("hf_paged", "hf_padded", "hf_generate_batch")
EXTRA = ("hf_generate_batch_sized",)  # opt-in: generate_batch with num_blocks sized to the workload
FULL = dict(model=dict(vocab_size=32000, hidden=512, layers=8, heads=8, kv_heads=2, max_len=1024,
                       intermediate_size=1376), prompt_len=(16, 200), requests=[16, 64], max_tokens=64)
SMALL = dict(model=dict(vocab_size=1000, hidden=128, layers=2, heads=4, kv_heads=2, max_len=1024,
                        intermediate_size=344), prompt_len=(16, 200), requests=[4, 8], max_tokens=8)
_THREE_TO_ONE = ["linear_attention"] * 3 + ["full_attention"]
# hybrids (hf_paged.tiny.HYBRIDS): the same workload, a model of the family's shape; keys besides the generic ones
# (vocab_size, hidden, layers, heads, kv_heads, max_len) are the family's config fields
HYBRID_SETUPS = {
    "qwen3_5_text": (
        dict(FULL, model=dict(vocab_size=32000, hidden=512, layers=8, heads=8, kv_heads=2, max_len=1024, head_dim=64,
                              intermediate_size=1024, layer_types=_THREE_TO_ONE * 2, linear_num_key_heads=4,
                              linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64)),
        dict(SMALL, model=dict(vocab_size=1000, hidden=128, layers=4, heads=4, kv_heads=2, max_len=1024, head_dim=32,
                               intermediate_size=256, layer_types=_THREE_TO_ONE, linear_num_key_heads=2,
                               linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32))),
}
ARCHS = ("llama", *HYBRID_SETUPS)
SEED = 0
MODULE = "hf_paged.bench.throughput"


def workload(arch: str, small: bool) -> dict:
    """The model sizes, prompt lengths and default counts of one run."""
    if arch == "llama":
        return SMALL if small else FULL
    return HYBRID_SETUPS[arch][1 if small else 0]


def build_model(arch: str, sizes: dict):
    """The benchmark's random model (seed SEED, output head not sharpened) of `arch` with `sizes` (a setup's model)."""
    from hf_paged.tiny import tiny_hybrid, tiny_model

    if arch == "llama":
        return tiny_model("llama", seed=SEED, sharpen=1.0, **sizes)
    rest = dict(sizes)
    generic = {name: rest.pop(key) for key, name in (("vocab_size", "vocab_size"), ("hidden", "hidden"),
               ("layers", "layers"), ("heads", "num_attention_heads"), ("kv_heads", "num_key_value_heads"),
               ("max_len", "max_position_embeddings"))}
    return tiny_hybrid(arch, seed=SEED, sharpen=1.0, **generic, **rest)


def make_prompts(count: int, vocab: int, low: int, high: int, seed: int = SEED) -> list[list[int]]:
    """Deterministic random prompts (ids 3.. avoid pad/bos/eos); stdlib only so the parent stays torch-free."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(low, high))] for _ in range(count)]


# --- worker side ---------------------------------------------------------------------------------------
def paged_runner(model):
    import hf_paged

    llm = hf_paged.LLM(model, block_size=16, max_num_seqs=128)

    def run(prompts, max_tokens):
        params = hf_paged.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    return run


def padded_runner(model):
    import torch

    def run(prompts, max_tokens):
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
        return [row[width:].tolist() for row in out]
    return run


def generate_batch_runner(model, sized: bool = False):
    from hf_paged.tiny import generate_batch_configs

    def run(prompts, max_tokens):
        # sized: just enough 256-token pages for the workload instead of HF's default (a share of host RAM)
        pages = sum(-(-(len(p) + max_tokens) // 256) for p in prompts) + 1
        config, cb = generate_batch_configs(max_tokens, pages if sized else None)
        # warmup=False: on CPU it only pre-runs dummy max-size batches (no CUDA graphs); the worker warms up itself.
        # hf_paged disabled: with it, generate_batch runs on hf_paged's engine (integrations/cb_manager.py)
        import hf_paged

        hf_paged.disable()
        try:
            outputs = model.generate_batch(inputs=prompts, generation_config=config, continuous_batching_config=cb,
                                           progress_bar=False, warmup=False)
        finally:
            hf_paged.enable()
        if len(outputs) != len(prompts):
            raise RuntimeError(f"generate_batch returned {len(outputs)} results for {len(prompts)} prompts")
        return [list(o.generated_tokens) for o in outputs.values()]
    return run


def worker(args, setup: dict) -> None:
    threads = set_threads(args.threads)
    if args.worker == "matmul":
        emit_result({"gflops": matmul_gflops(dtype=args.dtype), "threads": threads})
    elif args.worker == "all":  # --small: every system and request count in this one process (a smoke run)
        emit_result({"matmul": {"gflops": matmul_gflops(dtype=args.dtype), "threads": threads},
                     "results": [measure(system, n, args, setup, threads)
                                 for system in sorted(args.systems, key=lambda name: name != "hf_paged")
                                 for n in args.requests]})
    else:
        emit_result(measure(args.worker, args.requests[0], args, setup, threads))


def measure(system: str, n: int, args, setup: dict, threads: int) -> dict:
    """One system's timed generate of `n` prompts (after an untimed warm-up) on a freshly built model."""
    import torch

    import hf_paged

    if system == "hf_paged":
        hf_paged.enable()
    else:
        hf_paged.disable()  # HF baselines run on unpatched transformers
    model = build_model(args.arch, setup["model"]).to(getattr(torch, args.dtype))
    runner = {"hf_paged": paged_runner, "hf_padded": padded_runner, "hf_generate_batch": generate_batch_runner,
              "hf_generate_batch_sized": lambda m: generate_batch_runner(m, sized=True)}[system](model)
    vocab, (low, high) = setup["model"]["vocab_size"], setup["prompt_len"]
    runner(make_prompts(2, vocab, low, high, seed=SEED + 1), 4)  # warm-up
    prompts = make_prompts(n, vocab, low, high)
    start, cpu_start = time.perf_counter(), time.process_time()
    tokens = runner(prompts, args.max_tokens)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    embed = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings().weight.numel()
    total = sum(p.numel() for p in model.parameters())
    extra = {}
    if system == "hf_paged":  # what the few-row linears chose, measured on this machine in this process
        from hf_paged.model.small_linear import small_linear_choices, small_linear_status

        extra["small_linears"] = {"status": small_linear_status(), "choices": small_linear_choices()}
    return {"system": system, "requests": len(prompts), "seconds": seconds, "cpu_seconds": cpu_seconds,
            "threads": threads, **extra,
            "output_tokens": sum(len(t) for t in tokens), "peak_rss_mb": peak_rss_mb(), "tokens": tokens,
            "params": {"total": total, "embedding": embed, "lm_head": head, "non_embedding": total - embed - head}}


def _measure(system: str, n: int, common_args: list[str], timeout: float, round_index: int, rounds: int) -> dict:
    label = f"  {system:<23} {n:>3} requests" + (f" (round {round_index + 1}/{rounds})" if rounds > 1 else "")
    try:
        r = run_worker(["-m", MODULE, "--worker", system, "--requests", str(n), *common_args], timeout=timeout)
        print(f"{label}: {r['seconds']:8.2f} s, peak RSS {r['peak_rss_mb']:.0f} MB", flush=True)
        return r
    except Exception as exc:  # noqa: BLE001 - report and keep going with the other systems
        print(f"{label}: FAILED\n{exc}", flush=True)
        return {"system": system, "requests": n, "error": str(exc)}


def _small_rounds(args, common_args: list[str]) -> tuple[dict, list[dict]]:
    """--small: each round one worker process runs every system and request count; each system's fastest round."""
    runs, matmul = {}, None
    for round_index in range(args.repeats):
        out = run_worker(["-m", MODULE, "--worker", "all", "--requests", *map(str, args.requests), "--systems",
                          *args.systems, *common_args], timeout=args.timeout)
        matmul = matmul or out["matmul"]
        for r in out["results"]:
            rounds = f" (round {round_index + 1}/{args.repeats})" if args.repeats > 1 else ""
            print(f"  {r['system']:<23} {r['requests']:>3} requests{rounds}: {r['seconds']:8.2f} s", flush=True)
            runs.setdefault((r["system"], r["requests"]), []).append(r)
    return matmul, [_best_of(system, n, runs[system, n]) for n in args.requests for system in args.systems]


def _best_of(system: str, n: int, measured: list[dict]) -> dict:
    """One system's rounds at one request count: the fastest run (timeit's rule: noise only ever adds time),
    with every round's seconds kept. A failure in any round is the result."""
    failed = [r for r in measured if "error" in r]
    if failed:
        return failed[0]
    best = dict(min(measured, key=lambda r: r["seconds"]))
    best["round_seconds"] = [r["seconds"] for r in measured]
    best["round_cpu_seconds"] = [r.get("cpu_seconds") for r in measured]
    best["peak_rss_mb"] = max(r["peak_rss_mb"] for r in measured)
    if "small_linears" in best:  # each round is a process of its own that measured afresh
        best["round_small_linear_paths"] = [_linear_paths(r) for r in measured]
    if any(r["tokens"] != best["tokens"] for r in measured):
        raise RuntimeError(f"{system} gave different tokens in different rounds at {n} requests")
    return best


def _linear_paths(result: dict) -> dict[str, str]:
    """A worker's small-linear choices as {"out x in rows<=b threads=t": path}."""
    return {f"{c['shape'][0]}x{c['shape'][1]} rows<={c['rows']} threads={c['threads']}": c["path"]
            for c in result.get("small_linears", {}).get("choices", [])}


def print_small_linears(results: list[dict]) -> None:
    """The few-row linear products hf_paged's workers measured and chose (model/linear_choice.py), per weight shape
    and row bucket: each candidate's best time in us, and whether every round chose alike."""
    for r in results:
        if not r.get("small_linears"):
            continue
        rounds = r.get("round_small_linear_paths", [])
        same = all(paths == rounds[0] for paths in rounds)
        status = r["small_linears"]["status"].split("; chosen:")[0]  # the choices: the table below
        print(f"\nsmall linears in hf_paged's worker, {r['requests']} requests (fastest round; "
              f"{'all rounds chose alike' if same else 'rounds chose differently'}): {status}")
        rows = [[f"{c['shape'][0]}x{c['shape'][1]}", c["rows"], c["threads"], c["path"],
                 *(c["us"].get(name) for name in ("kernel", "w_xt", "f_linear")), c["probe_ms"]]
                for c in r["small_linears"]["choices"]]
        if rows:
            print(format_table(["weight", "rows <=", "threads", "chosen", "kernel us", "W @ x^T us", "F.linear us",
                                "probe ms"], rows))


def _paired_ratios(results: list[dict], n: int, system: str, base: str) -> list[float] | None:
    """Per-round speed-up of `system` over `base` (each round ran both back to back), or None."""
    group = {r["system"]: r for r in results if r["requests"] == n and "round_seconds" in r}
    if system not in group or base not in group:
        return None
    return [b / a for a, b in zip(group[system]["round_seconds"], group[base]["round_seconds"])]


def _paired_cpu_ratios(results: list[dict], r: dict) -> list[float] | None:
    """hf_paged's per-round speed-up over hf_padded in worker CPU seconds (`r` is hf_paged's result), or None."""
    padded = next((x for x in results if x["system"] == "hf_padded" and x["requests"] == r["requests"]), {})
    if r["system"] != "hf_paged" or None in (*r.get("round_cpu_seconds", [None]),
                                             *padded.get("round_cpu_seconds", [None])):
        return None
    return [b / a for a, b in zip(r["round_cpu_seconds"], padded["round_cpu_seconds"])]


# --- parent side ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-paged bench throughput", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, nargs="+", default=None, help="request counts (default 16 64)")
    parser.add_argument("--max-tokens", type=int, default=None, help="new tokens per request (default 64)")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS + EXTRA, default=None,
                        help="default: all three (hf_paged and hf_padded for a hybrid --arch; with --small, "
                             "generate_batch sized to the workload)")
    parser.add_argument("--arch", choices=ARCHS, default="llama",
                        help="the random model: Llama, or a hybrid of that family's shape (default: %(default)s)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the model's dtype for every system (bfloat16: greedy tokens may part from HF's on "
                             "rounding flips; 'same tokens' counts the rows that do not; the matmul limit is measured "
                             "in this dtype)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds of every system, interleaved; each system's fastest round is reported")
    add_common_args(parser, "throughput", (*SYSTEMS, *EXTRA, "matmul", "all"), timeout=3600,
                    plot_help="output tok/s against the number of requests")
    args = parser.parse_args(argv)
    setup = workload(args.arch, args.small)
    if args.systems is None:  # --small (a smoke run): HF's generate_batch with a pool sized to the workload, not its
        # default share of host RAM (tens of seconds and GBs to set up on a large machine)
        args.systems = ["hf_paged", "hf_padded"] if args.arch != "llama" else \
            ["hf_paged", "hf_padded", "hf_generate_batch_sized"] if args.small else list(SYSTEMS)
    args.requests = args.requests or setup["requests"]
    args.max_tokens = args.max_tokens or setup["max_tokens"]
    if args.worker:
        worker(args, setup)
        return 0

    common_args = ["--max-tokens", str(args.max_tokens), "--arch", args.arch, "--dtype", args.dtype] \
        + (["--small"] if args.small else []) \
        + (["--threads", str(args.threads)] if args.threads else [])
    load_before = machine_load()
    if args.small:  # a smoke run: one process per round for everything (imports dominate such tiny runs)
        matmul, results = _small_rounds(args, common_args)
    else:
        matmul = run_worker(["-m", MODULE, "--worker", "matmul", *common_args], timeout=args.timeout)
        results = []
        for n in args.requests:
            runs = {system: [] for system in args.systems}
            for round_index in range(args.repeats):  # rounds interleave the systems: slow spells hit all of them
                for system in args.systems:
                    runs[system].append(_measure(system, n, common_args, args.timeout, round_index, args.repeats))
            results.extend(_best_of(system, n, measured) for system, measured in runs.items())

    print(f"{args.dtype} matmul (1024^3, best of 10): {matmul['gflops']:.1f} GFLOP/s with {matmul['threads']} threads",
          flush=True)
    params = next((r["params"] for r in results if "params" in r), None)
    limits, rows = {}, []
    vocab, (low, high) = setup["model"]["vocab_size"], setup["prompt_len"]
    for n in args.requests:
        prompt_tokens = sum(len(p) for p in make_prompts(n, vocab, low, high))
        output_tokens = n * args.max_tokens
        flops = 2 * params["non_embedding"] * (prompt_tokens + output_tokens) + 2 * params["lm_head"] * output_tokens \
            if params else None
        limits[n] = output_tokens / (flops / (matmul["gflops"] * 1e9)) if flops else None
        group = {r["system"]: r for r in results if r["requests"] == n and "error" not in r}
        reference = group.get("hf_padded", {}).get("tokens")
        for r in group.values():
            r["prompt_tokens"], r["tok_per_s"] = prompt_tokens, output_tokens / r["seconds"]
        for r in (r for r in results if r["requests"] == n):
            if "error" in r:
                rows.append([r["system"], n, "failed", None, None, None, None, None, None, None, None])
                continue
            r["complete"] = r["output_tokens"] == output_tokens
            r["vs_hf_padded"] = r["tok_per_s"] / group["hf_padded"]["tok_per_s"] if "hf_padded" in group else None
            # CPU seconds of the worker process: less sensitive than wall time to other work on the machine
            r["vs_hf_padded_cpu"] = group["hf_padded"]["cpu_seconds"] / r["cpu_seconds"] \
                if "hf_padded" in group and r.get("cpu_seconds") else None
            base = group.get("hf_generate_batch")
            r["vs_hf_generate_batch"] = r["tok_per_s"] / base["tok_per_s"] if base else None
            r["matmul_limit_fraction"] = r["tok_per_s"] / limits[n] if limits[n] else None
            for base in ("hf_padded", "hf_generate_batch"):
                if r["system"] != base and (paired := _paired_ratios(results, n, r["system"], base)):
                    r[f"vs_{base}_per_round"] = paired
            if (cpu := _paired_cpu_ratios(results, r)) is not None:
                r["vs_hf_padded_cpu_per_round"] = cpu
            r["same_as_hf_padded"] = sum(a == b for a, b in zip(r["tokens"], reference)) if reference else None
            pct = r["matmul_limit_fraction"]
            same = f"{r['same_as_hf_padded']}/{n}" if reference and r["system"] != "hf_padded" else None
            rows.append([r["system"], n, r["seconds"], r.get("cpu_seconds"), r["tok_per_s"], r["peak_rss_mb"],
                         r["vs_hf_padded"], r["vs_hf_padded_cpu"], r["vs_hf_generate_batch"],
                         None if pct is None else f"{100 * pct:.1f}%", same])
    for r in results:
        r.pop("tokens", None)

    report = {"benchmark": "throughput", "arch": args.arch, "small": args.small, "model": setup["model"],
              "dtype": args.dtype, "prompt_len": list(setup["prompt_len"]), "seed": SEED, "max_tokens": args.max_tokens,
              "requests": args.requests, "systems": args.systems, "threads": matmul["threads"],
              "matmul_gflops": matmul["gflops"], "params": params, "matmul_limit_tok_per_s": limits,
              "machine": machine_info(), "load_average": {"before": load_before, "after": machine_load()},
              "results": results}
    path = write_json(args.json, report)
    if params:
        print(f"\nmodel: {params['total'] / 1e6:.1f} M params ({params['non_embedding'] / 1e6:.1f} M non-embedding), "
              f"{args.max_tokens} new tokens/request; matmul-limit output tok/s: "
              + ", ".join(f"{n} req {v:.0f}" for n, v in limits.items() if v))
    print(f"results written to {path}")
    print(f"CPU: {report['machine'].get('cpu_model', report['machine']['processor'])}, {report['threads']} torch "
          f"threads; load average (1/5/15 min) before {load_before}, after {report['load_average']['after']}\n")
    print(format_table(["system", "requests", "seconds", "CPU s", "out tok/s", "peak RSS MB", "x HF padded",
                        "x padded CPU s", "x HF gen_batch", "of matmul limit", "same tokens as padded"], rows))
    if args.repeats > 1:
        print(f"\nseconds are each system's fastest of {args.repeats} interleaved rounds; speed-ups round by round:")
        for r in results:
            for base in ("hf_padded", "hf_generate_batch"):
                if (paired := r.get(f"vs_{base}_per_round")) and r["system"] == "hf_paged":
                    print(f"  hf_paged x {base:<17} {r['requests']:>3} requests: "
                          + " ".join(f"{v:.2f}" for v in paired) + f"  (median {statistics.median(paired):.2f})")
            if cpu := r.get("vs_hf_padded_cpu_per_round"):
                print(f"  hf_paged x hf_padded, CPU s {r['requests']:>3} requests: "
                      + " ".join(f"{v:.2f}" for v in cpu) + f"  (median {statistics.median(cpu):.2f})")
    print_small_linears(results)
    if (png := plot_path(args, path)) is not None:
        plot(png, report)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
