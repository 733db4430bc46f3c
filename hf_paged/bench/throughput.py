"""CPU throughput: hf_paged `LLM.generate` vs HF padded `generate` vs HF's built-in `generate_batch`.

Full run (takes a while; use a quiet machine):

    hf-paged bench throughput                      # == --requests 16 64 --max-tokens 64
    hf-paged bench throughput --threads 8
    hf-paged bench throughput --repeats 3         # 3 interleaved rounds: each system's fastest, paired ratios

Quick smoke test: `hf-paged bench throughput --small` (hidden 128, 2 layers, vocab 1000, 4 and 8 requests,
8 new tokens): every system in the calling process, no worker (importing transformers again would cost more than
such runs; the full runs give each system a fresh process), about 10 s and 0.9 GB on a 2-core machine.

`--arch qwen3_5_text`: a random Qwen3.5-shaped hybrid instead (hidden 512, 8 layers 3 Gated DeltaNet : 1 full
attention, 8 heads / 2 KV heads of 64, linear attention 4 key / 8 value heads of 64, intermediate 1024, vocab 32000;
`--small`: hidden 128, 4 layers), same prompts; `--arch nemotron_h`: Nemotron-H's pattern (Mamba-2 and MLP layers
alternating, one attention layer in 8; 16 Mamba heads of 64, state 128, 2 groups); `--arch falcon_h1`: attention and
a Mamba-2 mixer side by side in each of 8 layers (16 heads of 64, state 128); `--arch lfm2`: LFM2's short gated
convolutions (3-token window) in 5 of 8 layers, attention in the others; `--arch falcon_mamba`: Mamba-1 mixers only
(8 layers, state 16, expand 2). HF's `generate_batch` does not run linear-attention or Mamba layers, so the default
systems there are hf_paged and hf_padded. `--arch gemma3_text | gemma2 | gpt_oss`: a stack mixing sliding-window and
full-attention layers in that family's pattern (gemma 3: 5 sliding : 1 full, window 512, head dim 256; gemma 2:
alternating, window 4096, soft-capped scores and logits, head dim 256; gpt-oss: alternating, window 128, attention
sinks, 8 experts, 2 per token), sizes near the Llama's (bench/throughput_models.py); `--arch mixtral`: the Llama's
sizes with a mixture of 8 experts (2 per token, stored output-major as Mixtral and Qwen-MoE store them); default
systems hf_paged and hf_padded.

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
warm-up of the same shape (prompts of the same lengths, other tokens, 4 new tokens: what happens once per shape, such
as oneDNN's set-up or hf_paged's trials of its few-row products, whose cost the table reports, stays out of the timing
for every system; hf_paged's warm-up generates 3 x (1 + SAMPLES) + 4 tokens, again while a trial is open, at most
MAX_WARMUPS times: a trial takes that many calls of its row bucket), then
times one call with time.perf_counter; engine construction (LLM(...)) is outside the timing, generate_batch's
per-call manager start-up is inside it (that is its API). Peak RSS is
the worker's ru_maxrss. "matmul limit" = output tokens / (workload FLOPs / best 1024^3 matmul FLOP/s of torch.matmul
and oneDNN's GEMM),
FLOPs = 2*non-embedding params*(prompt+output tokens) + 2*lm_head params*output tokens (attention ignored).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time

from .common import (add_common_args, emit_result, machine_info, machine_load, matmul_rates,
                     peak_rss_mb, plot_path, run_worker, set_threads, write_json)
from .throughput_models import ARCHS, SEED, build_model, workload
from .throughput_plot import plot
from .throughput_report import _linear_paths, print_report, summarise

SYSTEMS = ("hf_paged", "hf_padded", "hf_generate_batch")
EXTRA = ("hf_generate_batch_sized",)  # opt-in: generate_batch with num_blocks sized to the workload
MODULE = "hf_paged.bench.throughput"


def make_prompts(count: int, vocab: int, low: int, high: int, seed: int = SEED) -> list[list[int]]:
    """Deterministic random prompts (ids 3.. avoid pad/bos/eos); stdlib only so the parent stays torch-free."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(low, high))] for _ in range(count)]


MAX_WARMUPS = 3  # hf_paged's warm-ups at most (each of warmup_tokens() new tokens)


def warmup_tokens() -> int:
    """hf_paged's warm-up length: a whole trial of three candidates (linear_choice) and 4 tokens more."""
    from ..trials import SAMPLES

    return 3 * (1 + SAMPLES) + 4


def open_trials() -> int:
    """How many of hf_paged's trials of few-row products, and of steps with or without the fast paths, are still open
    in this process."""
    from ..model import linear_choice, step_choice

    return len(linear_choice.TABLE.trials) + len(step_choice.TABLE.trials)


def other_tokens(prompts: list[list[int]], vocab: int, seed: int) -> list[list[int]]:
    """Prompts of the same lengths as `prompts`, with other random tokens (ids 3..)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in prompt] for prompt in prompts]


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


def fused_passes(model) -> dict:
    """Which of the model's modules an engine gives the native RMSNorm / rotary passes (bit-exact and timed faster
    here; the verdicts are cached per process, so this is what the timed engine used), and the passes' load status."""
    from hf_paged.model import FusedNorms, FusedRotary
    from hf_paged.model.fused_norms import fused_norms_status
    from hf_paged.model.fused_rotary import fused_rotary_status

    return {"norms": len(FusedNorms(model).modules), "norms_status": fused_norms_status(),
            "rotary": len(FusedRotary(model).modules), "rotary_status": fused_rotary_status()}


def worker(args, setup: dict) -> None:
    threads = set_threads(args.threads)
    if args.worker == "matmul":
        emit_result(_matmul(args.dtype, threads))
    else:
        emit_result(measure(args.worker, args.requests[0], args, setup, threads))


def _matmul(dtype: str, threads: int) -> dict:
    rates = matmul_rates(dtype=dtype)
    return {"gflops": max(rates.values()), "rates": rates, "threads": threads}


def measure_all(args, setup: dict, threads: int) -> dict:
    """The matmul ceiling and every system at every request count, in this process (hf_paged's systems first)."""
    return {"matmul": _matmul(args.dtype, threads),
            "results": [measure(system, n, args, setup, threads)
                        for system in sorted(args.systems, key=lambda name: name != "hf_paged")
                        for n in args.requests]}


def small_in_process(args, setup: dict) -> dict:
    """--small's round in the calling process: it has imported transformers already (the CLI imports hf_paged), and
    a worker would spend longer importing it again than running the whole smoke workload. The take-over's state and
    torch's thread count are put back afterwards; the result goes through JSON as a worker's would."""
    import torch

    import hf_paged

    was_enabled, threads = hf_paged.is_enabled(), torch.get_num_threads()
    try:
        return json.loads(json.dumps(measure_all(args, setup, set_threads(args.threads))))
    finally:
        torch.set_num_threads(threads)
        (hf_paged.enable if was_enabled else hf_paged.disable)()


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
    prompts = make_prompts(n, vocab, low, high)
    # warm-up on prompts of the timed ones' lengths, other tokens (no prefix-cache hits), 4 new tokens: one-time costs
    # of the timed call's shapes stay out of its timing for every system alike (oneDNN's per-shape set-up; hf_paged's
    # packed copies and its trials of the few-row products for each row bucket its steps reach: those take up to
    # 3 x (1 + SAMPLES) calls each, so hf_paged's warm-up generates that many tokens more, again while any is open)
    warmups = [runner(other_tokens(prompts, vocab, seed=SEED + 1), 4 if system != "hf_paged" else warmup_tokens())]
    while system == "hf_paged" and open_trials() and len(warmups) < MAX_WARMUPS:
        warmups.append(runner(other_tokens(prompts, vocab, seed=SEED + 1 + len(warmups)), warmup_tokens()))
    start, cpu_start = time.perf_counter(), time.process_time()
    tokens = runner(prompts, args.max_tokens)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    embed_weight, head_weight = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    embed, head = embed_weight.numel(), head_weight.numel()
    total = sum(p.numel() for p in model.parameters())
    body = total - embed - (0 if head_weight is embed_weight else head)  # a tied head: the embedding's weight, once
    extra = {}
    if system == "hf_paged":  # what the few-row linears chose, measured on this machine in this process
        from hf_paged.model.small_linear import small_linear_choices, small_linear_status

        extra["small_linears"] = {"status": small_linear_status(), "choices": small_linear_choices()}
        extra["fused"] = fused_passes(model)
        from hf_paged.attention.decode_choice import decode_choices

        extra["decode_attention"] = decode_choices()
        from hf_paged.attention.prefill_kernel import prefill_choices

        extra["prefill_attention"] = prefill_choices()
        from hf_paged.model.expert_products import expert_choices

        extra["expert_products"] = expert_choices()
        from hf_paged.model.step_choice import step_choices

        extra["step_paths"] = step_choices()
        extra["warmups"], extra["open_trials"] = len(warmups), open_trials()
    return {"system": system, "requests": len(prompts), "seconds": seconds, "cpu_seconds": cpu_seconds,
            "threads": threads, **extra,
            "output_tokens": sum(len(t) for t in tokens), "peak_rss_mb": peak_rss_mb(), "tokens": tokens,
            "params": {"total": total, "embedding": embed, "lm_head": head, "non_embedding": body,
                       "active_non_embedding": body - idle_expert_params(model)}}


def idle_expert_params(model) -> int:
    """How many of a mixture's expert weights a token does not use (each token runs top-k of each layer's experts;
    0 without experts): the matmul limit counts the weights a token multiplies."""
    top_k = getattr(getattr(model, "config", None), "num_experts_per_tok", None)
    idle = 0
    for module in model.modules():
        experts = getattr(module, "num_experts", None)
        if top_k and experts and all(hasattr(module, a) for a in ("has_gate", "is_transposed")):
            idle += round(sum(p.numel() for p in module.parameters()) * (1 - min(top_k, experts) / experts))
    return idle


def _measure(system: str, n: int, common_args: list[str], timeout: float, round_index: int, rounds: int) -> dict:
    label = f"  {system:<23} {n:>3} requests" + (f" (round {round_index + 1}/{rounds})" if rounds > 1 else "")
    try:
        r = run_worker(["-m", MODULE, "--worker", system, "--requests", str(n), *common_args], timeout=timeout)
        print(f"{label}: {r['seconds']:8.2f} s, peak RSS {r['peak_rss_mb']:.0f} MB", flush=True)
        return r
    except Exception as exc:  # noqa: BLE001 - report and keep going with the other systems
        print(f"{label}: FAILED\n{exc}", flush=True)
        return {"system": system, "requests": n, "error": str(exc)}


def _small_rounds(args, setup: dict) -> tuple[dict, list[dict]]:
    """--small: each round runs every system and request count in this process (`small_in_process`; no --timeout);
    each system's fastest round."""
    runs, matmul = {}, None
    for round_index in range(args.repeats):
        out = small_in_process(args, setup)
        matmul = matmul or out["matmul"]
        for r in out["results"]:
            rounds = f" (round {round_index + 1}/{args.repeats})" if args.repeats > 1 else ""
            print(f"  {r['system']:<23} {r['requests']:>3} requests{rounds}: {r['seconds']:8.2f} s", flush=True)
            runs.setdefault((r["system"], r["requests"]), []).append(r)
    return matmul, [_best_of(system, n, runs[system, n]) for n in args.requests for system in args.systems]


def _best_of(system: str, n: int, measured: list[dict]) -> dict:
    """One system's rounds at one request count: the fastest run (timeit's rule: noise only ever adds time),
    with every round's seconds kept. A failure in any round is the result. Rounds whose tokens differ are reported
    (`round_rows_differ`: per round, the rows unlike the fastest round's), not an error: each round is a process that
    chose its few-row products afresh, and other products round differently (bf16 flips on near ties)."""
    failed = [r for r in measured if "error" in r]
    if failed:
        return failed[0]
    best = dict(min(measured, key=lambda r: r["seconds"]))
    best["round_seconds"] = [r["seconds"] for r in measured]
    best["round_cpu_seconds"] = [r.get("cpu_seconds") for r in measured]
    best["peak_rss_mb"] = max(r["peak_rss_mb"] for r in measured)
    if "small_linears" in best:  # each round is a process of its own that measured afresh
        best["round_small_linear_paths"] = [_linear_paths(r) for r in measured]
    differ = [sum(a != b for a, b in zip(r["tokens"], best["tokens"])) for r in measured]
    if any(differ):
        best["round_rows_differ"] = differ
    return best


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(prog="hf-paged bench throughput", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, nargs="+", default=None, help="request counts (default 16 64)")
    parser.add_argument("--max-tokens", type=int, default=None, help="new tokens per request (default 64)")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS + EXTRA, default=None,
                        help="default: all three (hf_paged and hf_padded for a hybrid --arch; with --small, "
                             "generate_batch sized to the workload)")
    parser.add_argument("--arch", choices=ARCHS, default="llama",
                        help="the random model: Llama, or a hybrid, a sliding / full stack or a mixture of experts "
                             "of that family's shape "
                             "(default: %(default)s)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the model's dtype for every system (bfloat16: greedy tokens may part from HF's on "
                             "rounding flips; 'same tokens' counts the rows that do not; the matmul limit is measured "
                             "in this dtype)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds of every system, interleaved; each system's fastest round is reported")
    add_common_args(parser, "throughput", (*SYSTEMS, *EXTRA, "matmul"), timeout=3600,
                    plot_help="output tok/s against the number of requests")
    args = parser.parse_args(argv)
    setup = workload(args.arch, args.small)
    if args.systems is None:  # --small (a smoke run): HF's generate_batch with a pool sized to the workload, not its
        # default share of host RAM (tens of seconds and GBs to set up on a large machine)
        args.systems = ["hf_paged", "hf_padded"] if args.arch != "llama" else \
            ["hf_paged", "hf_padded", "hf_generate_batch_sized"] if args.small else list(SYSTEMS)
    args.requests = args.requests or setup["requests"]
    args.max_tokens = args.max_tokens or setup["max_tokens"]
    return args, setup


def main(argv: list[str] | None = None) -> int:
    args, setup = parse_args(argv)
    if args.worker:
        worker(args, setup)
        return 0
    load_before = machine_load()
    matmul, results = _small_rounds(args, setup) if args.small else collect(args)
    rates = ", ".join(f"{name} {rate:.1f}" for name, rate in matmul.get("rates", {}).items())
    print(f"{args.dtype} matmul (1024^3, best of 10): {matmul['gflops']:.1f} GFLOP/s with {matmul['threads']} threads"
          + (f" (best of {rates})" if rates else ""), flush=True)
    params = next((r["params"] for r in results if "params" in r), None)
    vocab, (low, high) = setup["model"]["vocab_size"], setup["prompt_len"]
    prompt_tokens = {n: sum(len(p) for p in make_prompts(n, vocab, low, high)) for n in args.requests}
    limits, rows = summarise(args, prompt_tokens, matmul["gflops"], params, results)
    report = {"benchmark": "throughput", "arch": args.arch, "small": args.small, "model": setup["model"],
              "dtype": args.dtype, "prompt_len": list(setup["prompt_len"]), "seed": SEED, "max_tokens": args.max_tokens,
              "requests": args.requests, "systems": args.systems, "threads": matmul["threads"],
              "matmul_gflops": matmul["gflops"], "params": params, "matmul_limit_tok_per_s": limits,
              "machine": machine_info(), "load_average": {"before": load_before, "after": machine_load()},
              "results": results}
    path = write_json(args.json, report)
    print_report(args, report, rows, path)
    if (png := plot_path(args, path)) is not None:
        plot(png, report)
    return 0 if all("error" not in r for r in results) else 1


def collect(args) -> tuple[dict, list[dict]]:
    """(the matmul measurement, every system's result at every request count): each in a worker of its own, the
    systems interleaved round by round (a slow spell hits all of them), each system's fastest round kept."""
    common_args = ["--max-tokens", str(args.max_tokens), "--arch", args.arch, "--dtype", args.dtype] \
        + (["--small"] if args.small else []) \
        + (["--threads", str(args.threads)] if args.threads else [])
    matmul = run_worker(["-m", MODULE, "--worker", "matmul", *common_args], timeout=args.timeout)
    results = []
    for n in args.requests:
        runs = {system: [] for system in args.systems}
        for round_index in range(args.repeats):
            for system in args.systems:
                runs[system].append(_measure(system, n, common_args, args.timeout, round_index, args.repeats))
        results.extend(_best_of(system, n, measured) for system, measured in runs.items())
    return matmul, results


if __name__ == "__main__":
    sys.exit(main())
