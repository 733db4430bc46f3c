"""`hf-paged demo`: the same greedy prompts through hf_paged and through HF `generate` on one padded batch.

Default model: a built-in 4-layer Llama with random weights and a character tokenizer (no download; its text is
noise). With `--model DIR` the same comparison runs on a real model, with short English prompts.
"""
from __future__ import annotations

import random
import time

SENTENCES = ("The history of the printing press begins", "A good recipe for bread needs", "In a distant galaxy, the",
             "The three laws of motion say that", "My favourite programming language is", "Once upon a time there",
             "The capital of France is a city where", "To train a neural network you first",
             "The ocean covers most of the planet and", "Music theory explains why some chords",
             "The quickest way to learn a language is", "Rain forests are important because")


def demo_model():
    """The built-in model (random weights, 4.3 M parameters) and a character tokenizer over its vocabulary."""
    from ..tiny import tiny_model, tiny_tokenizer

    model = tiny_model("llama", vocab_size=4096, hidden=256, layers=4, heads=8, kv_heads=2, max_len=1024,
                       sharpen=4.0)
    return model, tiny_tokenizer(4096)


def random_prompts(count: int, vocab: int, seed: int, low: int = 8, high: int = 96) -> list[list[int]]:
    """Prompts of random token ids (ids 0-3 are the special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(low, high))] for _ in range(count)]


def text_prompts(tokenizer, count: int) -> list[list[int]]:
    """Short English prompts, each different (so no two share a whole prompt)."""
    return [list(tokenizer(f"{SENTENCES[k % len(SENTENCES)]} (variant {k // len(SENTENCES) + 1})")["input_ids"])
            for k in range(count)]


def hf_padded(model, prompts: list[list[int]], max_tokens: int, pad_id: int) -> tuple[list[list[int]], float]:
    """HF `generate` on one left-padded batch: the new tokens of each prompt and the seconds taken."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                         do_sample=False, pad_token_id=pad_id)
    elapsed = time.perf_counter() - start
    return [row[width:].tolist() for row in out], elapsed


def paged_run(llm, prompts: list[list[int]], params, bar) -> tuple[list[list[int]], float, int]:
    """All prompts through the engine step by step (the bar advances per token): new tokens of each prompt, the
    seconds taken and the most KV blocks in use at once."""
    start = time.perf_counter()
    ids = [llm.add_request(p, params) for p in prompts]
    tokens, peak = {}, 0
    while llm.has_unfinished_requests():
        outputs = llm.step()
        stats = llm.stats()
        peak = max(peak, stats["num_blocks_total"] - stats["num_blocks_free"])
        for out in outputs:
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
        if bar is not None:
            bar.update(len(outputs))
    return [tokens[i] for i in ids], time.perf_counter() - start, peak


def needed_blocks(prompts: list[list[int]], max_tokens: int, block_size: int) -> int:
    return sum(-(-(len(p) + max_tokens) // block_size) for p in prompts) + 1


def show(text: str, limit: int = 160) -> str:
    text = repr(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def run_demo(model, tokenizer, args, options: dict) -> int:
    """Run the comparison and print it; 0 when every output equals HF's (always 0 for a model of your own, where
    batched fp arithmetic may flip a near-tie)."""
    from tqdm.auto import tqdm

    from hf_paged import LLM, SamplingParams

    builtin = model is None
    if builtin:
        import torch

        model, tokenizer = demo_model()
        auto = "cuda" if torch.cuda.is_available() else "cpu"
        model = model.to(device=auto if args.device == "auto" else args.device,
                         dtype=torch.float32 if args.dtype == "auto" else getattr(torch, args.dtype))
        prompts = random_prompts(args.requests, model.config.vocab_size, args.seed)
        params_m = sum(p.numel() for p in model.parameters()) / 1e6
        print(f"hf-paged demo: a built-in Llama with RANDOM weights ({params_m:.1f} M params), so its text is noise; "
              f"what counts is the speed and that both systems produce the same tokens.")
    else:
        prompts = text_prompts(tokenizer, args.requests)
        print(f"hf-paged demo: {args.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params)")
    lengths = [len(p) for p in prompts]
    print(f"{len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens, {args.max_tokens} new tokens each, "
          f"greedy; each system runs twice and keeps its faster time")
    options.setdefault("num_blocks", needed_blocks(prompts, args.max_tokens, options["block_size"]))
    llm = LLM(model, tokenizer=tokenizer, max_num_seqs=max(len(prompts), 1), **options)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    paged_s = hf_s = float("inf")
    for attempt in range(2):  # a run this short otherwise mostly measures first-call costs and machine noise
        bar = tqdm(total=len(prompts) * args.max_tokens, desc="hf_paged", unit="tok") if attempt == 0 else None
        steps_before = llm.stats()["num_steps"]
        paged_tokens, seconds, peak = paged_run(llm, prompts, params, bar)
        steps = llm.stats()["num_steps"] - steps_before
        if bar is not None:
            bar.close()
        paged_s = min(paged_s, seconds)
        hf_tokens, seconds = hf_padded(model, prompts, args.max_tokens, pad)
        hf_s = min(hf_s, seconds)
    report(llm, prompts, paged_tokens, hf_tokens, paged_s, hf_s, steps, peak, tokenizer)
    same = sum(a == b for a, b in zip(paged_tokens, hf_tokens))
    return 0 if same == len(prompts) or not builtin else 1


def report(llm, prompts, paged_tokens, hf_tokens, paged_s, hf_s, steps, peak, tokenizer) -> None:
    total = sum(len(t) for t in paged_tokens)
    print(f"\n{'system':<28}{'seconds':>10}{'output tok/s':>15}")
    print(f"{'hf_paged LLM.generate':<28}{paged_s:>10.2f}{total / paged_s:>15.1f}")
    print(f"{'HF generate (padded batch)':<28}{hf_s:>10.2f}{total / hf_s:>15.1f}")
    same = sum(a == b for a, b in zip(paged_tokens, hf_tokens))
    print(f"\nspeed-up {hf_s / paged_s:.2f}x; outputs identical to HF for {same}/{len(prompts)} prompts; "
          f"{steps} engine steps per run")
    if same < len(prompts):
        print("(greedy outputs can part where two tokens score within rounding of each other: the two systems sum "
              "the same products in a different order)")
    stats = llm.stats()
    per_block = stats["kv_cache_bytes"] / stats["num_blocks_total"] / 2**20
    print(f"KV cache: {stats['num_blocks_total']} blocks of {stats['block_size']} tokens reserved for this workload "
          f"({stats['num_blocks_total'] * per_block:.1f} MiB), at most {peak} in use at once ({peak * per_block:.1f} "
          f"MiB)")
    print(f"\nprompt 0 ({len(prompts[0])} tokens): {show(tokenizer.decode(prompts[0]))}")
    print(f"  hf_paged: {show(tokenizer.decode(paged_tokens[0]))}")
    verdict = "the same tokens" if hf_tokens[0] == paged_tokens[0] else show(tokenizer.decode(hf_tokens[0]))
    print(f"  HF:       {verdict}")
    print(NEXT_STEPS)


NEXT_STEPS = """
Next, in your own code (docs/README.md indexes the rest):
  import hf_paged                                           # then, on any transformers causal LM:
  model.generate(ids, attention_mask=mask, cache_implementation="paged", max_new_tokens=64)
  llm = hf_paged.LLM(model, tokenizer=tokenizer)            # many requests, vLLM's API
  llm.generate(prompts, hf_paged.SamplingParams(max_tokens=64, temperature=0.7))
  llm.chat([[{"role": "user", "content": "Hello!"}]])
  hf-paged serve MODEL                                      # an OpenAI-compatible server
  hf-paged bench throughput --small                         # measure on this machine"""
