"""Beam search memory: KV bytes a `PagedCache` holds at the end of `generate(num_beams=...)` vs `DynamicCache`.

    hf-paged bench beam                      # 1,000-token prompt, num_beams 4 and 8, 32 new tokens
    hf-paged bench beam --small              # quick smoke run (smaller model and prompt)
    hf-paged bench beam --arch gemma2        # sliding-window layers (every other layer, window 256)

Workload: a random-weight Llama built from a config (hidden 256, 4 layers, 4 heads, 2 KV heads, vocab 1000, fp32,
output head scaled so greedy choices have clear margins), one prompt of `--prompt-len` random tokens, greedy beam
search (`do_sample=False`), `--new-tokens` new tokens, the same call with `cache=PagedCache(config,
block_size=16)` and with HF's default `DynamicCache`. Checked: identical `sequences`. Reported per beam count: KV
bytes each cache holds at the end (PagedCache: distinct blocks its tables hold, shared blocks counted once;
DynamicCache: its K/V tensors), the saving, and the wall time of each call (one run each, after a warm-up call).
Also timed: greedy on 4 rows of `--prompt-len` tokens, 2 x `--new-tokens` new tokens (best of 2): DynamicCache,
PagedCache read in place (the "paged_cache" attention `generate` switches sdpa models to), and PagedCache read
through a gathered copy (hf_paged disabled), against DynamicCache's concatenation.
Beams start as copies of one prompt; HF's first reorder points every beam at the best hypothesis, so with paged
memory they share its blocks and copy only a shared, partly filled block when they write into it.
`--arch mistral` / `gemma2`: the same sizes with sliding-window attention (`--window`, default 256) on every layer /
every other layer (gemma2 on eager attention, as HF runs it). HF's sliding layers keep only the window; so do the
PagedCache's, whose sliding layers have their own block tables and give back the blocks the window has left.
"""
from __future__ import annotations

import argparse
import time

from .common import default_json, format_table, write_json


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="hf-paged bench beam", description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-len", type=int, default=1000, help="prompt tokens (default: %(default)s)")
    parser.add_argument("--beams", type=int, nargs="+", default=[4, 8], help="num_beams values (default: 4 8)")
    parser.add_argument("--new-tokens", type=int, default=32, help="new tokens per call (default: %(default)s)")
    parser.add_argument("--block-size", type=int, default=16, help="PagedCache block size (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--small", action="store_true", help="hidden 64, 2 layers, 200-token prompt, 8 new tokens")
    parser.add_argument("--arch", choices=["llama", "mistral", "gemma2"], default="llama",
                        help="architecture of the random model (default: %(default)s)")
    parser.add_argument("--window", type=int, default=256,
                        help="sliding window of mistral / gemma2 (default: %(default)s)")
    parser.add_argument("--json", default=default_json("beam"),
                        help="where to write the results (default: %(default)s in the current folder)")
    return parser.parse_args(argv)


def build_model(small: bool, arch: str = "llama", window: int = 256):
    from hf_paged.tiny import tiny_model

    size = dict(hidden=64, layers=2) if small else dict(hidden=256, layers=4)
    extra = {} if arch == "llama" else {"sliding_window": window}
    return tiny_model(arch, vocab_size=1000, heads=4, kv_heads=2, max_len=2048, **size, **extra)


def dynamic_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if t is not None)


def measure(model, prompt, beams: int, new_tokens: int, block_size: int) -> dict:
    import torch

    from hf_paged import PagedCache

    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, num_beams=beams, do_sample=False,
                  return_dict_in_generate=True)
    start = time.perf_counter()
    dynamic = model.generate(prompt, **kwargs)
    dynamic_s = time.perf_counter() - start
    paged = PagedCache(model.config, block_size=block_size)
    start = time.perf_counter()
    out = model.generate(prompt, cache=paged, **kwargs)
    paged_s = time.perf_counter() - start
    if not torch.equal(out.sequences, dynamic.sequences):
        raise AssertionError(f"num_beams={beams}: PagedCache and DynamicCache outputs differ")
    held, reference = paged.num_bytes_in_use, dynamic_bytes(dynamic.cache)
    return {"num_beams": beams, "paged_bytes": held, "dynamic_bytes": reference,
            "saving": 1 - held / reference, "paged_s": paged_s, "dynamic_s": dynamic_s, "identical": True}


def time_greedy(model, prompts, new_tokens: int, block_size: int) -> dict:
    """Greedy on a batch (best of 2 each): DynamicCache; PagedCache with its pages read in place (the "paged_cache"
    attention that `generate` switches sdpa models to); PagedCache read through a gathered copy (hf_paged disabled:
    HF's own sdpa on what the cache's layers hand it)."""
    import torch

    import hf_paged
    from hf_paged import PagedCache

    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    times = {"dynamic_s": [], "paged_s": [], "paged_gathered_s": []}
    outputs = []
    for _ in range(2):
        for key in times:
            extra = {} if key == "dynamic_s" else {"cache": PagedCache(model.config, block_size=block_size)}
            if key == "paged_gathered_s":
                hf_paged.disable()
            try:
                start = time.perf_counter()
                outputs.append(model.generate(prompts, **kwargs, **extra))
                times[key].append(time.perf_counter() - start)
            finally:
                hf_paged.enable()
    if not all(torch.equal(o, outputs[0]) for o in outputs):
        raise AssertionError("greedy: PagedCache and DynamicCache outputs differ")
    return {"rows": prompts.shape[0], **{k: min(v) for k, v in times.items()}}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.small:
        args.prompt_len, args.new_tokens = min(args.prompt_len, 200), min(args.new_tokens, 8)
    model = build_model(args.small, args.arch, args.window)
    prompt = torch.randint(3, model.config.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
    measure(model, prompt[:, :32], 2, 2, args.block_size)  # warm-up
    results = [measure(model, prompt, beams, args.new_tokens, args.block_size) for beams in args.beams]
    rows = torch.randint(3, model.config.vocab_size, (4, args.prompt_len), generator=torch.Generator().manual_seed(1))
    greedy = time_greedy(model, rows, 2 * args.new_tokens, args.block_size)
    rows = [[r["num_beams"], f"{r['dynamic_bytes'] / 2**20:.2f}", f"{r['paged_bytes'] / 2**20:.2f}",
             f"{100 * r['saving']:.1f} %", f"{r['dynamic_s']:.2f}", f"{r['paged_s']:.2f}"] for r in results]
    window = f", sliding window {args.window}" if args.arch != "llama" else ""
    print(f"beam search, {args.arch}{window}, {args.prompt_len}-token prompt, {args.new_tokens} new tokens, "
          "identical outputs")
    print(format_table(["num_beams", "DynamicCache MiB", "PagedCache MiB", "less memory", "Dynamic s", "Paged s"],
                       rows))
    print(f"greedy, {greedy['rows']} rows of {args.prompt_len} tokens, {2 * args.new_tokens} new tokens (best of 2): "
          f"DynamicCache {greedy['dynamic_s']:.2f} s, PagedCache {greedy['paged_s']:.2f} s (pages read in place), "
          f"{greedy['paged_gathered_s']:.2f} s (a gathered copy)")
    path = write_json(args.json, {"benchmark": "beam", "arch": args.arch,
                                  "sliding_window": args.window if args.arch != "llama" else None,
                                  "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                                  "block_size": args.block_size, "small": args.small, "results": results,
                                  "greedy": greedy})
    print(f"results written to {path}")
    return 0
