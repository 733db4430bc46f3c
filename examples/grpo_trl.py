"""TRL's GRPOTrainer with its rollouts on hf_paged (no download: a tiny random chat model from hf_paged.tiny).

    pip install hf_paged trl peft            # trl >= 1.16, transformers 5.25
    python examples/grpo_trl.py --mode paged # GRPOConfig(cache_implementation="paged"): generate runs on hf_paged
    python examples/grpo_trl.py --mode cb    # use_transformers_continuous_batching: generate_batch on hf_paged
    python examples/grpo_trl.py --mode cb --lora             # the same with a LoRA adapter (peft)
    python examples/grpo_trl.py --mode cb --no-hf-paged      # transformers' own continuous batching, for timing
    python examples/grpo_trl.py --mode cb --num-blocks 64 [--no-hf-paged]   # the same, both with a 16k-token cache

Rollouts are greedy (`do_sample=False`), so every rollout must equal transformers' plain `generate` (dynamic cache,
hf_paged not involved) at the same weights: each rollout call is recorded and checked against it, prompt by prompt,
and the time of each rollout call is printed. `--sample` samples instead (then only the timing is reported).
"""
import argparse
import copy
import time

import torch
from datasets import Dataset
from transformers import GenerationConfig
from trl import GRPOConfig, GRPOTrainer

import hf_paged
from hf_paged.tiny import tiny_chat_model

parser = argparse.ArgumentParser()
parser.add_argument("--mode", choices=["paged", "cb"], default="cb")
parser.add_argument("--lora", action="store_true", help="train a LoRA adapter (peft) instead of the whole model")
parser.add_argument("--no-hf-paged", action="store_true", help="transformers' own continuous batching (--mode cb)")
parser.add_argument("--sample", action="store_true", help="sampled rollouts (no parity check)")
parser.add_argument("--num-blocks", type=int, help="cache size for --mode cb (default: transformers' memory share)")
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--new-tokens", type=int, default=48)
args = parser.parse_args()
if args.no_hf_paged:
    assert args.mode == "cb", "--no-hf-paged needs --mode cb (cache_implementation='paged' is hf_paged's)"
    hf_paged.disable()  # transformers exactly as without hf_paged

torch.manual_seed(0)
model, tokenizer = tiny_chat_model()
model.train()
questions = ["What is 2 + 2?", "Name a colour.", "Say hello.", "Count to three.", "Why is the sky blue?",
             "Write a haiku.", "Spell 'cat'.", "Give me a number."]
dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q in questions]})


def reward_len(completions, **kwargs):
    """Reward short answers with vowels (any signal will do: the model is random)."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ch in "aeiou" for ch in t) - 0.1 * len(t) for t in texts]


def hf_greedy(generate, prompt: list[int], config: GenerationConfig) -> list[int]:
    """transformers' own greedy generate (dynamic cache) of one prompt: the reference every rollout must equal."""
    config = copy.deepcopy(config)
    config.cache_implementation, config.do_sample = None, False
    out = generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                   generation_config=config)[0, len(prompt):].tolist()
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    while out and out[-1] == config.pad_token_id and config.pad_token_id not in eos:
        out.pop()
    return out


stats = {"seconds": [], "rollouts": 0, "mismatches": 0}
plain_generate, plain_generate_batch = model.generate, model.generate_batch


def check(prompts: list[list[int]], completions: list[list[int]], config: GenerationConfig) -> None:
    if args.sample:
        return
    with torch.no_grad():
        for prompt, got in zip(prompts, completions):
            want = hf_greedy(plain_generate, prompt, config)
            stats["rollouts"] += 1
            if got != want:
                stats["mismatches"] += 1
                print(f"  MISMATCH prompt {tokenizer.decode(prompt)!r}\n    rollout  {got}\n    generate {want}")


def recorded_generate_batch(inputs, generation_config=None, **kwargs):
    """TRL's continuous-batching rollout (mode cb): timed, then checked."""
    start = time.perf_counter()
    outputs = plain_generate_batch(inputs, generation_config=generation_config, **kwargs)
    stats["seconds"].append(time.perf_counter() - start)
    completions = [o.generated_tokens for o in outputs.values()]
    assert len(completions) == len(inputs) and all(o.error is None for o in outputs.values())
    check(inputs, completions, generation_config)
    return outputs


def recorded_generate(input_ids=None, attention_mask=None, generation_config=None, **kwargs):
    """TRL's plain-generate rollout (mode paged): left-padded rows, timed, then checked row by row."""
    start = time.perf_counter()
    out = plain_generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config,
                         **kwargs)
    stats["seconds"].append(time.perf_counter() - start)
    width, pad, eos = input_ids.shape[1], generation_config.pad_token_id, generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    prompts = [row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask)]
    completions = []
    for row in out[:, width:].tolist():  # up to and with the first end token (TRL cuts there too)
        ends = [i for i, t in enumerate(row) if t in eos]
        completions.append(row[:ends[0] + 1] if ends else [t for t in row if t != pad])
    check(prompts, completions, generation_config)
    return out


model.generate_batch, model.generate = recorded_generate_batch, recorded_generate
# greedy groups have no reward spread (zero advantages, no gradient): weight decay still moves the weights every
# step, so each rollout runs at new weights. fp32 (TRL's CPU default is bf16, where near-ties flip greedy picks)
config = GRPOConfig(
    output_dir="/tmp/grpo_trl_example", max_steps=args.steps, per_device_train_batch_size=8, num_generations=4,
    max_completion_length=args.new_tokens, learning_rate=1e-2, weight_decay=1.0, logging_steps=1,
    report_to="none", save_strategy="no", use_cpu=True, bf16=False, seed=0,
    generation_kwargs=None if args.sample else {"do_sample": False},
    cache_implementation="paged" if args.mode == "paged" else None,
    use_transformers_continuous_batching=args.mode == "cb",
    transformers_continuous_batching_config={"num_blocks": args.num_blocks} if args.num_blocks else None)
peft_config = None
if args.lora:
    from peft import LoraConfig

    # init_lora_weights=False: the adapter changes the outputs from the start (peft's default starts it at zero)
    peft_config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False,
                             task_type="CAUSAL_LM")
trainer = GRPOTrainer(model=model, reward_funcs=reward_len, args=config, train_dataset=dataset,
                      processing_class=tokenizer, peft_config=peft_config)
before = {k: v.detach().clone() for k, v in trainer.model.named_parameters() if v.requires_grad}
trainer.train()
moved = sum(not torch.equal(before[k], v) for k, v in trainer.model.named_parameters() if k in before)
engine = "transformers' own" if args.no_hf_paged else "hf_paged"
print(f"mode={args.mode} lora={args.lora} engine={engine}: {args.steps} steps done, {moved} trained tensors moved")
print(f"rollout calls: {len(stats['seconds'])}, seconds each: {[round(s, 3) for s in stats['seconds']]}, "
      f"total {sum(stats['seconds']):.3f} s")
if not args.sample:
    print(f"greedy rollouts checked against generate: {stats['rollouts']}, mismatches: {stats['mismatches']}")
    raise SystemExit(1 if stats["mismatches"] or not stats["rollouts"] else 0)
