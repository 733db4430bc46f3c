"""Per-call cost of `generate(cache_implementation="paged")` against plain HF `generate`, on tiny models where the
call's fixed and per-step work (not the matmuls) decides: what RL rollouts of a small policy pay on every step.

    hf-paged bench calls                      # both models, 4 and 16 rows, 32 new tokens
    hf-paged bench calls --rows 4 --calls 60  # more calls per system
    hf-paged bench calls --small              # quick smoke run

Models (random weights, fp32, `hf_paged.tiny`): `qwen` is shaped like the tiny Qwen2 policies TRL's own tests train
(hidden 16, 2 layers, 4 heads, 2 KV heads, vocab 151,665: the LM head dominates a step); `llama` is smaller still
(hidden 64, 2 layers, vocab 1,000: a step is almost all Python). Workload: `--rows` prompts of 24 random tokens, no
padding, greedy, `--new-tokens` new tokens, no EOS. In one process the two systems alternate call by call (a busy
machine slows both alike); reported: the median wall time per call of each, their ratio (paged / HF: below 1 is
faster), the CPU time ratio, and whether every call gave HF's tokens.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from .common import default_json, format_table, machine_info, machine_load, set_threads, write_json

MODELS = {
    "qwen": ("qwen2", dict(vocab_size=151665, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2)),
    "llama": ("llama", dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2)),
}


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="hf-paged bench calls", description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 16], help="prompts per call (default: 4 16)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--calls", type=int, default=30, help="timed calls per system and case (default: 30)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    parser.add_argument("--small", action="store_true", help="quick smoke run: llama, 4 rows, 4 new tokens, 5 calls")
    parser.add_argument("--json", default=default_json("calls"))
    return parser.parse_args(argv)


def build(name: str):
    from hf_paged.tiny import tiny_model

    arch, sizes = MODELS[name]
    return tiny_model(arch, sharpen=1.0, **sizes)


def time_case(model, rows: int, new_tokens: int, calls: int, seed: int = 0) -> dict:
    """Alternate HF's and the paged generate `calls` times each (after two untimed calls of each)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, min(model.config.vocab_size, 1000), (rows, 24), generator=generator)
    mask = torch.ones_like(ids)
    options = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                   eos_token_id=None)
    wall = {"hf": [], "paged": []}
    cpu = {"hf": [], "paged": []}
    outputs, same = {}, True
    for call in range(calls + 2):
        for system in ("hf", "paged"):
            extra = {"cache_implementation": "paged"} if system == "paged" else {}
            start, start_cpu = time.perf_counter(), time.process_time()
            outputs[system] = model.generate(ids, attention_mask=mask, **options, **extra)
            if call >= 2:
                wall[system].append(time.perf_counter() - start)
                cpu[system].append(time.process_time() - start_cpu)
        same = same and torch.equal(outputs["hf"], outputs["paged"])
    ms = {system: statistics.median(values) * 1000 for system, values in wall.items()}
    cpu_ms = {system: statistics.median(values) * 1000 for system, values in cpu.items()}
    return {"rows": rows, "new_tokens": new_tokens, "calls": calls, "hf_ms": ms["hf"], "paged_ms": ms["paged"],
            "ratio": ms["paged"] / ms["hf"], "cpu_ratio": cpu_ms["paged"] / cpu_ms["hf"], "same_tokens": same}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.small:
        args.models, args.rows, args.new_tokens, args.calls = ["llama"], [4], 4, 5
    import hf_paged  # noqa: F401 - the generate take-over
    threads = set_threads(args.threads)
    machine = machine_info()
    print(f"{machine.get('cpu_model', machine['processor'])}, {machine['cpu_count']} CPUs, {threads} torch "
          f"thread(s), load {machine_load()}")
    results = []
    for name in args.models:
        model = build(name)
        for rows in args.rows:
            results.append({"model": name, **time_case(model, rows, args.new_tokens, args.calls)})
    print(format_table(["model", "rows", "HF ms/call", "paged ms/call", "paged / HF", "CPU time ratio", "same tokens"],
                       [[r["model"], r["rows"], r["hf_ms"], r["paged_ms"], r["ratio"], r["cpu_ratio"],
                         r["same_tokens"]] for r in results]))
    from hf_paged.model.step_choice import step_choices

    steps = step_choices()  # whether the paged steps ran the CPU fast paths, per row bucket (measured here)
    for c in steps:
        print(f"paged steps of <={c['rows']} rows ({c['model']}): {c['path']} ("
              + ", ".join(f"{n} {ms:.3f} ms" for n, ms in c["ms"].items()) + ")")
    path = write_json(args.json, {"benchmark": "calls", "machine": machine, "load": machine_load(),
                                  "threads": threads, "results": results, "step_paths": steps})
    print(f"results written to {path}")
    return 0 if all(r["same_tokens"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
