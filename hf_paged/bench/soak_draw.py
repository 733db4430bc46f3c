"""What the soak test (soak.py) draws: random requests and the pressured engine a round runs them on; and
how a drawn request must end (`check_tokens`)."""
from __future__ import annotations

import random
from dataclasses import dataclass

from hf_paged import SamplingParams
from hf_paged.kv import blocks_needed
from hf_paged.model import describe_model


MODES = ("recompute", "swap", "auto")
SYSTEM_LENGTHS = (16, 40, 96, 160)  # shared system prompts (prefix-cache hits, same-step hits, salts)
MAX_PROMPT, MAX_NEW, MAX_LEN = 300, 64, 512
VOCAB, EOS = 256, 2


@dataclass
class Spec:
    """One request as drawn: what is sent, and (stream rounds) when it is aborted: `abort_when` "queued" (`abort_after`
    steps after it was added), "running" (after it received `abort_after` tokens) or "preempted" (as soon as one of
    its samples is preempted or swapped out)."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    priority: int = 0
    abort_when: str | None = None
    abort_after: int = 0


def draw_prompt(rng: random.Random, systems: list[list[int]], earlier: list[list[int]]) -> list[int]:
    roll = rng.random()
    if earlier and roll < 0.1:
        return list(rng.choice(earlier))  # the very same prompt again (a hit on a block computed this step)
    length = rng.choice([rng.randint(1, 24), rng.randint(1, 80), rng.randint(1, MAX_PROMPT)])
    if roll < 0.45:
        system = rng.choice(systems)
        tail = [rng.randrange(3, VOCAB) for _ in range(rng.randint(0, max(0, MAX_PROMPT - len(system))) // 4)]
        return (system + tail)[:MAX_PROMPT]
    return [rng.randrange(3, VOCAB) for _ in range(length)]


def draw_params(rng: random.Random) -> SamplingParams:
    max_tokens = rng.choice([1, rng.randint(1, 8), rng.randint(1, 24), rng.randint(1, MAX_NEW)])
    kwargs = dict(max_tokens=max_tokens, n=rng.choice([1, 1, 1, 2, 3, 4]),
                  ignore_eos=rng.random() < 0.5, cache_salt=rng.choice([None, None, None, "a", "b"]))
    if rng.random() < 0.5:
        kwargs["temperature"] = 0.0
    else:  # seeded sampling: reproducible whatever else is in the batch
        kwargs.update(temperature=rng.choice([0.6, 1.0, 1.5]), seed=rng.randrange(2**31),
                      top_k=rng.choice([0, 0, 5, 50]), top_p=rng.choice([1.0, 1.0, 0.9]))
        if rng.random() < 0.2:
            kwargs.update(presence_penalty=0.5, repetition_penalty=1.2)
    if rng.random() < 0.3:
        kwargs["stop_token_ids"] = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 8))]
    if rng.random() < 0.15:
        kwargs["min_tokens"] = rng.randint(0, max_tokens)
    return SamplingParams(**kwargs)


def draw_round(rng: random.Random, systems, number: int, size: int) -> list[Spec]:
    specs, earlier = [], []
    for i in range(size):
        prompt = draw_prompt(rng, systems, earlier)
        earlier.append(prompt)
        params = draw_params(rng)
        when = rng.choice(["queued", "running", "preempted", "preempted"]) if rng.random() < 0.1 else None
        after = rng.choice([0, rng.randint(1, 10)]) if when == "queued" else rng.randint(1, params.max_tokens)
        specs.append(Spec(f"r{number}-{i}", prompt, params, rng.choice([0, 0, 0, 1, 2]), when, after))
    return specs


def draw_engine(rng: random.Random, model, number: int, specs: list[Spec]) -> dict:
    """A pressured engine: a pool for one to one and a half of the round's biggest requests, a small token budget."""
    block_size = rng.choice([4, 8, 16])
    biggest = max(blocks_needed(len(s.prompt) + s.params.max_tokens, block_size) for s in specs)
    options = dict(block_size=block_size, num_blocks=biggest + rng.randint(0, biggest // 2),
                   max_num_batched_tokens=rng.choice([32, 48, 64, 96, 128]),
                   long_prefill_token_threshold=rng.choice([0, 0, 8, 16, 40]),
                   max_num_seqs=rng.choice([3, 8, 32, 128, 128]), enable_prefix_caching=rng.random() < 0.85,
                   preemption_mode=MODES[number % len(MODES)], attention_backend="torch")
    if options["preemption_mode"] != "recompute":
        per_block = describe_model(model).kv.bytes_per_block(block_size)
        options["swap_space"] = per_block * rng.choice([1, biggest // 2 + 1, 4 * biggest])
    return options


def check_tokens(soak, spec: Spec, completion) -> None:
    """The right number of tokens, or the first stop (else a violation of the `soak`)."""
    p, tokens, reason = spec.params, completion.token_ids, completion.finish_reason
    if reason == "error":
        soak.violate("errors", f"{spec.rid}/{completion.index} ended with an error: {completion.error}")
        return
    stops = set(p.stop_token_ids) | (set() if p.ignore_eos else {EOS})
    early = [i for i, t in enumerate(tokens[:-1]) if t in stops and i + 1 >= p.min_tokens]
    if reason == "length":
        ok = len(tokens) == p.max_tokens or len(spec.prompt) + len(tokens) == MAX_LEN
    else:
        ok = reason == "stop" and tokens and tokens[-1] in stops and p.min_tokens <= len(tokens) <= p.max_tokens
    if not ok or early:
        soak.violate("bad_lengths", f"{spec.rid}/{completion.index}: {reason!r} after {len(tokens)} tokens "
                                    f"(max_tokens {p.max_tokens}, min_tokens {p.min_tokens}, early stops {early})")
