"""The first `generate` call of a new process: what a script that loads a model and generates once waits for.

    hf-paged bench first_call                          # Llama of the throughput workload's sizes, 3 rounds
    hf-paged bench first_call --arch qwen2.5-0.5b      # a released model's sizes
    hf-paged bench first_call --small                  # quick smoke run

Every measurement is a fresh worker process that builds the random model (`--arch`, as `hf-paged bench throughput`
builds it; not timed), then times `generate` of `--rows` prompts of `--prompt-len` tokens and `--new-tokens` greedy
tokens twice: the first call (all one-time costs: hf_paged's start-up check, its padding probe, the fast paths'
trials and weight copies, oneDNN's set-up for each system) and a second, identical one. Systems, in turn each round:
- `hf`: plain `model.generate` (hf_paged not imported);
- `paged_fresh`: `cache_implementation="paged"`, with nothing of the model kept on disk (HF_PAGED_CHECK_CACHE=0): a
  machine's first process for this model;
- `paged`: the same, once an untimed process has kept the model's start-up answers on disk (`model/verdict_disk.py`,
  in the native-code cache folder): every later process.
Native kernels are built before the first round (an install's one-time cost, not a call's). Reported: each system's
median first and second call over the rounds, and their ratio to HF's (below 1: faster), with the same tokens
checked.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from .common import (default_json, emit_result, format_table, machine_info, machine_load, run_worker, set_threads,
                     write_json)

SYSTEMS = ("hf", "paged_fresh", "paged")


def parse_args(argv):
    from .throughput_models import ARCHS

    parser = argparse.ArgumentParser(prog="hf-paged bench first_call", description=__doc__.split("\n")[0])
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--rows", type=int, default=1, help="prompts in the call (default: 1)")
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="worker processes per system (default: 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    parser.add_argument("--small", action="store_true", help="tiny model, 8 new tokens, 1 round")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds allowed per worker")
    parser.add_argument("--json", default=default_json("first_call"))
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def worker(args) -> None:
    """One process: build the model, time two identical generate calls, emit both times and the tokens."""
    import torch

    if args.worker != "hf":
        import hf_paged  # noqa: F401 - the generate take-over
    from .throughput_models import build_model, workload

    set_threads(args.threads)
    model = build_model(args.arch, workload(args.arch, args.small)["model"]).to(getattr(torch, args.dtype))
    vocab = model.config.get_text_config(decoder=True).vocab_size
    ids = torch.randint(3, min(vocab, 32000), (args.rows, args.prompt_len), generator=torch.Generator().manual_seed(0))
    options = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                   do_sample=False, pad_token_id=0, eos_token_id=None)
    if args.worker != "hf":
        options["cache_implementation"] = "paged"
    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        out = model.generate(ids, **options)
        seconds.append(time.perf_counter() - start)
    emit_result({"first_s": seconds[0], "second_s": seconds[1], "tokens": out[:, args.prompt_len:].tolist()})


def run(system: str, args, extra: list[str]) -> dict:
    import os

    switch = os.environ.get("HF_PAGED_CHECK_CACHE")
    os.environ["HF_PAGED_CHECK_CACHE"] = "0" if system == "paged_fresh" else "1"
    try:
        return run_worker(["-m", "hf_paged.bench.first_call", "--worker", system, *extra], timeout=args.timeout)
    finally:
        if switch is None:
            os.environ.pop("HF_PAGED_CHECK_CACHE")
        else:
            os.environ["HF_PAGED_CHECK_CACHE"] = switch


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.small:
        args.new_tokens, args.rounds, args.prompt_len = 8, 1, 24
    extra = ["--arch", args.arch, "--dtype", args.dtype, "--rows", str(args.rows), "--prompt-len",
             str(args.prompt_len), "--new-tokens", str(args.new_tokens), "--threads", str(args.threads)]
    extra += ["--small"] if args.small else []
    machine = machine_info()
    print(f"{machine.get('cpu_model', machine['processor'])}, {machine['cpu_count']} CPUs, {args.threads} torch "
          f"thread(s), load {machine_load()}; {args.arch} {args.dtype}, {args.rows} x {args.prompt_len} prompt "
          f"tokens, {args.new_tokens} new")
    run("paged", args, extra)  # untimed: builds the native kernels, keeps the model's start-up answers on disk
    runs = {system: [] for system in SYSTEMS}
    for _ in range(args.rounds):
        for system in SYSTEMS:
            runs[system].append(run(system, args, extra))
    want = runs["hf"][0]["tokens"]
    hf_first = statistics.median(r["first_s"] for r in runs["hf"])
    hf_second = statistics.median(r["second_s"] for r in runs["hf"])
    results = []
    for system, done in runs.items():
        first = statistics.median(r["first_s"] for r in done)
        second = statistics.median(r["second_s"] for r in done)
        results.append({"system": system, "first_s": first, "second_s": second, "first_vs_hf": first / hf_first,
                        "second_vs_hf": second / hf_second, "rounds": [[r["first_s"], r["second_s"]] for r in done],
                        "same_tokens": all(r["tokens"] == want for r in done)})
    print(format_table(["system", "first call s", "second call s", "first / HF's", "second / HF's", "same tokens"],
                       [[r["system"], r["first_s"], r["second_s"], r["first_vs_hf"], r["second_vs_hf"],
                         r["same_tokens"]] for r in results]))
    path = write_json(args.json, {"benchmark": "first_call", "machine": machine, "load": machine_load(),
                                  "args": {k: v for k, v in vars(args).items() if k not in ("worker", "json")},
                                  "results": results})
    print(f"results written to {path}")
    return 0 if all(r["same_tokens"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
