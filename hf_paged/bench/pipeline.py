"""`pipeline("text-generation")`: HF's own batch-by-batch run vs hf_paged's one engine run, same outputs.

    python -m hf_paged.bench.pipeline                    # 48 prompts, batch_size=4, 32 new tokens each
    python -m hf_paged.bench.pipeline --json pipeline.json
    python -m hf_paged.bench.pipeline --small            # smoke run: 8 prompts, 8 new tokens, no verdict

Workload: a random-weight Llama built from a config (4 layers, hidden 256, 4 heads, 2 KV heads, vocab 256, fp32,
output head sharpened so greedy choices have clear margins), hf_paged.tiny's character-level tokenizer (built in
code, no downloads), prompts of 8-120 random characters (seed 0), greedy, `max_new_tokens` new tokens (EOS stops a row).
Systems (same pipeline object, same call, `batch_size=4`):
  hf        pipe(prompts, max_new_tokens=N, do_sample=False)
  hf_paged  pipe(prompts, max_new_tokens=N, do_sample=False, cache_implementation="paged")
Each system runs once untimed (warm-up, 4 prompts) and then `--repeats` timed calls; the best time counts. The
generated texts must be identical or the benchmark fails. The target is hf_paged >= 1.5x faster than hf.
"""
from __future__ import annotations

import argparse
import random
import string
import sys
import time

from .common import machine_info, set_threads, write_json

TARGET = 1.5


def make_prompts(count: int, low: int, high: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(low, high))) for _ in range(count)]


def timed(pipe, prompts, repeats: int, **kwargs) -> tuple[float, list]:
    pipe(prompts[:4], **kwargs)  # warm-up
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = pipe(prompts, **kwargs)
        best = min(best, time.perf_counter() - start)
    return best, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="smoke run: 8 prompts, 8 new tokens, no verdict")
    parser.add_argument("--prompts", type=int, default=48, help="number of prompts (default 48)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="new tokens per prompt (default 32)")
    parser.add_argument("--batch-size", type=int, default=4, help="the pipeline's batch_size (default 4)")
    parser.add_argument("--repeats", type=int, default=2, help="timed calls per system; the best counts (default 2)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if args.small:
        args.prompts, args.max_new_tokens, args.repeats = 8, 8, 1
    threads = set_threads(args.threads)

    import hf_paged  # noqa: F401  (patches the pipeline)
    from hf_paged.tiny import text_generation_pipeline, tiny_model, tiny_tokenizer

    model = tiny_model("llama", hidden=256, layers=4, heads=4, kv_heads=2, vocab_size=256, max_len=512)
    pipe = text_generation_pipeline(model, tiny_tokenizer(256), batch_size=args.batch_size)
    prompts = make_prompts(args.prompts, 8, 120)
    common = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    hf_s, hf_out = timed(pipe, prompts, args.repeats, **common)
    paged_s, paged_out = timed(pipe, prompts, args.repeats, cache_implementation="paged", **common)
    same = hf_out == paged_out
    result = {"workload": {"prompts": args.prompts, "prompt_chars": [8, 120], "max_new_tokens": args.max_new_tokens,
                           "batch_size": args.batch_size, "model": "llama 4 layers hidden 256 vocab 256 (random)",
                           "threads": threads, "repeats": args.repeats, "small": args.small},
              "hf_s": hf_s, "hf_paged_s": paged_s, "speedup": hf_s / paged_s, "same_outputs": same,
              "machine": machine_info()}
    print(f"HF pipeline      {hf_s:8.3f} s")
    print(f"hf_paged         {paged_s:8.3f} s   ({hf_s / paged_s:.2f}x)")
    print(f"same outputs:    {same}")
    if not args.small:
        verdict = "meets" if hf_s / paged_s >= TARGET else "misses"
        print(f"{verdict} the {TARGET}x target")
    if args.json:
        print(f"wrote {write_json(args.json, result)}")
    if not same:
        print("FAILED: hf_paged's outputs differ from HF's", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
