"""Prefix reuse on a hybrid (Gated DeltaNet + attention, Qwen3.5-shaped) model: 64 prompts sharing a 1,024-token
prefix, with and without prefix caching. The hits restore the state layers' state from checkpoints (every 16th
block); reported: prefill tokens computed, wall time, and whether both runs give the same tokens.

    python -m hf_paged.bench.hybrid_prefix [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from .common import machine_info, write_json


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prefix", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    import torch

    import hf_paged
    from hf_paged.tiny import tiny_hybrid

    torch.set_num_threads(args.threads)
    model = tiny_hybrid("qwen3_5_text", hidden=args.hidden, layers=4, vocab_size=1024,
                        max_position_embeddings=args.prefix + 256)
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 1024, (args.prefix,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 1024, (int(n),), generator=gen).tolist()
               for n in torch.randint(16, 65, (args.requests,), generator=gen)]
    params = hf_paged.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    runs = {}
    for caching in (False, True):
        llm = hf_paged.LLM(model, block_size=16, enable_prefix_caching=caching, max_model_len=args.prefix + 256)
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
        runs["prefix caching" if caching else "no prefix caching"] = {
            "seconds": round(time.perf_counter() - started, 2),
            "prompt_tokens": sum(map(len, prompts)),
            "prefill_tokens_computed": sum(map(len, prompts)) - stats["prefix_cache_hit_tokens"],
            "tokens": [list(o.outputs[0].token_ids) for o in outputs]}
    plain, cached = runs["no prefix caching"], runs["prefix caching"]
    result = {"machine": machine_info(), "threads": args.threads,
              "fewer_prefill_tokens": round(plain["prefill_tokens_computed"] / cached["prefill_tokens_computed"], 2),
              "same_tokens": plain["tokens"] == cached["tokens"],
              **{name: {k: v for k, v in run.items() if k != "tokens"} for name, run in runs.items()}}
    print(json.dumps(result, indent=2))
    if args.json:
        write_json(args.json, result)
    return 0 if result["same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
