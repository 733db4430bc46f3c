"""What lasts across the soak test's rounds (`Context`), and its weight-change sessions (soak.py --weight-changes):
one long-lived LLM whose model's weights change in place between rounds."""
from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field

import torch

from hf_paged import LLM
from hf_paged.kv import blocks_needed

from .soak_draw import MAX_NEW, MAX_PROMPT, Spec


@dataclass
class Session:
    """--weight-changes: one LLM kept over several rounds (prefix caching on) on its own copy of the model, whose
    weights change before every round after the first; `reference` is None until built for the weights of now."""

    model: torch.nn.Module
    llm: LLM
    options: dict
    length: int
    rounds: int = 0
    reference: LLM | None = None
    change: str = "none yet"  # the latest weight change
    last: list[Spec] = field(default_factory=list)  # the last requests that finished in the round before

    @property
    def fp8(self) -> bool:
        return "kv_cache_dtype" in self.options

    def begin_round(self, soak, rng: random.Random, reference_engine, number: int) -> list[Spec]:
        """Before each round after the first the weights change (counted); then the reference of the weights of now
        (an fp8 session's with the scales its LLM fixed at its start) is built if there is none. Returns the requests
        to send first: the last ones of the round before again, whose blocks the prefix cache most likely still
        holds (computed with the old weights: they must not be hit)."""
        if self.rounds:
            self.change = change_weights(self.model, self.llm, rng)
            soak.counts["weight_changes"] += 1
            self.reference = None
        if self.reference is None:
            cache = self.llm.engine.memory.cache
            self.reference = reference_engine(self.model, scales=cache.kv_scales if self.fp8 else None)
        soak.counts["weight_rounds"] += 1
        return [Spec(f"r{number}-again{i}", s.prompt, s.params, s.priority) for i, s in enumerate(self.last)]

    def end_round(self, done: list[Spec]) -> None:
        self.rounds += 1
        self.last = done[-4:]


@dataclass
class Context:
    """What lasts across a soak's rounds: the model, its reference engines, the extra modes, the weight session."""

    model: torch.nn.Module
    reference: LLM
    faults: bool = False
    consumers: int = 0
    weight_changes: bool = False
    fp8: bool = False
    fp8_reference: LLM | None = None
    session: Session | None = None


def start_session(model, options: dict, fp8: bool, rounds: int) -> Session:
    """A long-lived LLM for --weight-changes on a copy of the model: the round's pressured options with prefix
    caching on and a pool that fits the biggest request any round can draw."""
    options = dict(options, enable_prefix_caching=True,
                   num_blocks=max(options["num_blocks"], blocks_needed(MAX_PROMPT + MAX_NEW, options["block_size"])))
    if fp8:
        options["kv_cache_dtype"] = "fp8_e4m3"
    model = copy.deepcopy(model)
    return Session(model, LLM(model, **options), options, rounds)


WEIGHT_CHANGES = ("scale", "one_tensor", "sgd", "data_and_reset")


def change_weights(model: torch.nn.Module, llm, rng: random.Random) -> str:
    """Change `model`'s weights in place, one of: every tensor scaled (`mul_` under no_grad), one tensor given noise,
    an SGD step on a random batch, or noise written through `.data` (invisible to the version counters) followed by
    `llm.reset_prefix_cache()`. Each is big (every tensor scaled by 0.5-1.5, noise of 0.5-1 standard deviation, a
    step of 20% of the weights' norm), so that a stale prefix hit shows in the tokens."""
    kind = rng.choice(WEIGHT_CHANGES)
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    params = [p for p in model.parameters()]

    def noise(p, size):  # a one-element tensor (a learned scalar) has no spread: its own magnitude instead
        spread = p.detach().float().std().item() if p.numel() > 1 else p.detach().float().abs().item()
        return torch.randn(p.shape, generator=generator, dtype=p.dtype) * size * spread

    if kind == "sgd":
        optimizer = torch.optim.SGD(params, lr=1.0)
        tokens = torch.randint(3, model.config.vocab_size, (2, 24), generator=generator)
        loss = torch.nn.functional.cross_entropy(model(tokens).logits[:, :-1].flatten(0, 1).float(),
                                                 tokens[:, 1:].flatten())
        loss.backward()
        with torch.no_grad():  # a step of 20% of the weights' norm, whatever the gradients' size
            norm = torch.sqrt(sum(p.grad.float().pow(2).sum() for p in params if p.grad is not None)).item()
            scale = sum(p.float().pow(2).sum() for p in params).sqrt().item()
        for group in optimizer.param_groups:
            group["lr"] = 0.2 * scale / max(norm, 1e-12)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    else:
        with torch.no_grad():
            if kind == "scale":
                for p in params:
                    p.mul_(rng.uniform(0.5, 1.5))
            elif kind == "one_tensor":
                p = rng.choice([p for p in params if p.dim() == 2])
                p.add_(noise(p, 1.0))
            else:
                for p in params:
                    p.data.add_(noise(p, 0.5))
                llm.reset_prefix_cache()
    return kind
