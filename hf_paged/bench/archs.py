"""Throughput across architectures: each listed model type at one modest size, HF padded `generate` against
`generate(cache_implementation="paged")`, in a process of its own per type (a crash or a hang costs only that type).

    hf-paged bench archs                        # the default families: 16 prompts of 16-120 tokens, 32 new each
    hf-paged bench archs --only gpt2 opt falcon # a few (any model type transformers registers for causal LM)
    hf-paged bench archs --small                # smoke run: 2 types, 4 prompts, 4 new tokens, 1 round

Every other benchmark runs a few model shapes; a user runs whatever family they have, on whichever path hf_paged
has for it (the native fast paths where a layer is Llama-coded, transformers' own modules elsewhere). Each type is
built as the model census builds it (`models_census.tiny`: its config class with only the sizes it declares
changed; a stack that mixes layer types with the fewest layers that hold them all), at SIZES (hidden 256, 4 heads of
64, 2 KV heads, intermediate 688, vocab 8,000), random weights (seed 0), the output head scaled x8 so that greedy
choices have clear margins, fp32, eval. Prompts: `--requests` random prompts of 16-120 tokens, left-padded into one
batch for HF, greedy, `--new-tokens` each, no EOS. In each process the two systems alternate (two untimed calls of
each first, then `--rounds` of each in turn: a busy machine slows both alike); reported: each system's fastest
round, the speed-up (HF's time / hf_paged's), how many rows gave HF's tokens in every round, or what failed (building
the model, HF's generate, or hf_paged's: only the last counts against hf_paged, with other tokens in fp32; `--dtype
bfloat16` casts the models, whose rows may part on rounding flips).
"""
from __future__ import annotations

import argparse
import subprocess
import sys

from .common import (
    default_json,
    emit_result,
    format_table,
    machine_info,
    machine_load,
    run_worker,
    set_threads,
    write_json,
)
from .models_census import SIZES as CENSUS_SIZES

# families users run, each a model type the census builds (docs/models.md): Llama-coded ones, others with
# transformers' own attention modules, mixtures of experts, sliding / full stacks, hybrids
DEFAULT = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi", "phi3", "gpt2", "gpt_neox",
           "gptj", "opt", "falcon", "bloom", "mpt", "starcoder2", "olmo2", "granite", "cohere", "stablelm", "smollm3",
           "glm", "qwen3_moe", "mixtral", "gpt_bigcode", "codegen", "ernie4_5", "exaone4", "lfm2", "qwen3_5_text",
           "qwen3_5_moe_text", "qwen3_next", "olmo_hybrid", "falcon_h1")
SMALL = ("llama", "gpt2")
# the census's sizes (models_census.SIZES: its layer counts too), larger: a step does matmuls worth timing, not
# only Python
SIZES = {**CENSUS_SIZES, "hidden_size": 256, "n_embd": 256, "d_model": 256, "num_attention_heads": 4, "n_head": 4,
         "attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 688, "ffn_dim": 688, "n_inner": 688,
         "ffn_hidden_size": 688, "vocab_size": 8000, "head_dim": 64, "max_position_embeddings": 512,
         "n_positions": 512, "rotary_dim": 32, "decoder_attention_heads": 4, "decoder_ffn_dim": 688,
         "linear_num_heads": 4, "linear_head_dim": 64, "hidden_size_global": 256, "encoder_hash_byte_group_vocab": 8000,
         "mamba_n_heads": 8, "mamba_d_head": 64, "mamba_d_ssm": 512, "mamba_num_heads": 8, "mamba_head_dim": 64,
         "mamba_headdim": 64}


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="hf-paged bench archs", description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", help="model types (default: the families in DEFAULT)")
    parser.add_argument("--requests", type=int, default=16, help="prompts per call (default: 16)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="timed calls of each system (default: 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the models' dtype (default: float32); in bf16 rows may part on rounding flips: the "
                             "rows that stayed the same are counted, only hf_paged's failures count against it")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per model type (default: 600)")
    parser.add_argument("--small", action="store_true", help="smoke run: 2 types, 4 prompts, 4 new tokens, 1 round")
    parser.add_argument("--json", default=default_json("archs"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.small:
        args.only, args.requests, args.new_tokens, args.rounds = args.only or list(SMALL), 4, 4, 1
    return args


def batch(requests: int, vocab: int, seed: int = 0):
    """`requests` random prompts of 16-120 tokens (ids 3 .. vocab - 1), left-padded with 0: (ids, mask)."""
    import random

    import torch

    rng = random.Random(seed)
    lengths = [rng.randint(16, 120) for _ in range(requests)]
    ids = torch.zeros(requests, max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, ids.shape[1] - length:] = torch.tensor([rng.randint(3, vocab - 1) for _ in range(length)])
        mask[row, ids.shape[1] - length:] = 1
    return ids, mask


def measure(model_type: str, requests: int, new_tokens: int, rounds: int, dtype: str = "float32") -> dict:
    """One type, in this process (the worker's part): see the module doc."""
    import time

    import torch

    import hf_paged  # noqa: F401 - the generate take-over

    from .models_census import tiny

    phase = "build"
    try:
        model = tiny(model_type, SIZES).eval()
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(8.0)
        model = model.to(getattr(torch, dtype))
        ids, mask = batch(requests, model.config.get_text_config(decoder=True).vocab_size)
        options = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                       pad_token_id=0, eos_token_id=None)

        def call(paged: bool):
            start = time.perf_counter()
            out = model.generate(ids, **options, **({"cache_implementation": "paged"} if paged else {}))
            return time.perf_counter() - start, out

        seconds = {"hf": [], "paged": []}
        same, rows_same = True, ids.shape[0]
        for round_ in range(rounds + 2):
            phase = "hf"
            took, reference = call(False)
            phase = "paged"
            took_paged, out = call(True)
            same = same and torch.equal(out, reference)
            rows_same = min(rows_same, sum(torch.equal(a, b) for a, b in zip(out, reference)))
            if round_ >= 2:
                seconds["hf"].append(took)
                seconds["paged"].append(took_paged)
    except Exception as error:  # noqa: BLE001 - the type's outcome, reported
        return {"type": model_type, "failed": phase, "error": f"{type(error).__name__}: {error}"[:300]}
    hf, paged = min(seconds["hf"]), min(seconds["paged"])
    return {"type": model_type, "hf_s": hf, "paged_s": paged, "speedup": hf / paged, "same_tokens": same,
            "rows_same": rows_same, "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            "layers": getattr(model.config.get_text_config(decoder=True), "num_hidden_layers", None)}


def run_type(model_type: str, args) -> dict:
    """One type in a worker process. A process that dies or runs out of time reports no phase: it is counted as
    hf_paged's failure (the conservative reading), with the last line it printed."""
    command = ["-m", "hf_paged.bench.archs", "--worker", model_type, "--requests", str(args.requests),
               "--new-tokens", str(args.new_tokens), "--rounds", str(args.rounds), "--threads", str(args.threads),
               "--dtype", args.dtype]
    try:
        return run_worker(command, timeout=args.timeout)
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        return {"type": model_type, "failed": "process", "error": str(error).strip().splitlines()[-1][:300]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        set_threads(args.threads)
        emit_result(measure(args.worker, args.requests, args.new_tokens, args.rounds, args.dtype))
        return 0
    machine = machine_info()
    print(f"{machine.get('cpu_model', machine['processor'])}, {machine['cpu_count']} CPUs, {args.threads} torch "
          f"thread(s), load {machine_load()}", flush=True)
    results = []
    for model_type in args.only or DEFAULT:
        result = run_type(model_type, args)
        results.append(result)
        if "failed" in result:
            print(f"{model_type:16s} failed ({result['failed']}): {result['error'][:150]}", flush=True)
        else:
            print(f"{model_type:16s} HF {result['hf_s']:.3f} s  hf_paged {result['paged_s']:.3f} s  "
                  f"{result['speedup']:.2f}x  rows the same: {result['rows_same']}/{args.requests}", flush=True)
    timed = [r for r in results if "failed" not in r]
    if timed:
        print(format_table(["type", "HF s", "hf_paged s", "speed-up", "rows the same"],
                           [[r["type"], r["hf_s"], r["paged_s"], r["speedup"], f"{r['rows_same']}/{args.requests}"]
                            for r in timed]))
    exact = args.dtype == "float32"  # bf16: rows may part on rounding flips (docs/PERFORMANCE.md)
    ours = [r["type"] for r in results if r.get("failed") in ("paged", "process")
            or (exact and r.get("same_tokens") is False)]
    slower = [r["type"] for r in timed if r["speedup"] < 1.0]
    print(f"{len(timed)} of {len(results)} types timed; slower than HF: {slower or 'none'}; "
          f"hf_paged failed{' or gave other tokens' if exact else ''}: {ours or 'none'}")
    path = write_json(args.json, {"benchmark": "archs", "machine": machine, "load": machine_load(),
                                  "threads": args.threads, "requests": args.requests, "new_tokens": args.new_tokens,
                                  "rounds": args.rounds, "dtype": args.dtype, "sizes": SIZES, "results": results})
    print(f"results written to {path}")
    return 1 if ours else 0


if __name__ == "__main__":
    sys.exit(main())
