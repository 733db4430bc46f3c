"""Sampling parameters (vLLM names) and the batched sampler that runs on the model's device."""
from __future__ import annotations

import math
import numbers
import dataclasses
from dataclasses import dataclass, field

import torch

from .config import SEED_LIMIT, InputTypeError, is_integer

GREEDY_BELOW = 1e-5  # a temperature below this samples greedily
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


@dataclass(slots=True)
class SamplingParams:
    """Per-request decoding settings. `validate()` raises ValueError naming the bad field (InputTypeError, a TypeError
    and a ValueError, for a value of the wrong type). A temperature below 1e-5 samples greedily."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    # what `logprobs` reports (vLLM's names): "raw_logprobs", the model's own distribution; "processed_logprobs", the
    # one the token was drawn from (after penalties, temperature, top-k / top-p / min-p: what transformers' continuous
    # batching reports, and what RL importance weights compare against)
    logprobs_mode: str = "raw_logprobs"
    cache_salt: str | None = None  # requests with different salts never share KV blocks

    def __post_init__(self) -> None:
        # one stop string / one stop token id is a list of one; anything else odd is left for validate() to name
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None or isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop or [])
        if isinstance(self.stop_token_ids, torch.Tensor):
            self.stop_token_ids = self.stop_token_ids.reshape(-1).tolist()
        elif is_integer(self.stop_token_ids):
            self.stop_token_ids = [self.stop_token_ids]
        elif self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids or [])

    def copy(self) -> "SamplingParams":
        """An independent copy (its lists are new lists)."""
        return dataclasses.replace(self)

    @property
    def greedy(self) -> bool:
        # below this, logits / temperature overflow float32 to inf and softmax gives NaN: take the argmax (vLLM's rule)
        return self.temperature < GREEDY_BELOW

    def validate(self) -> None:
        """Raise InputTypeError (a TypeError and a ValueError) for a value of the wrong type, ValueError for a bad
        value; the message starts with the field's name. Integer-like values (numpy / torch scalars) become int.
        Limits that depend on the model (the vocabulary for logprobs and stop_token_ids) are checked by the engine."""
        def integer(name: str, low: int) -> None:
            value = getattr(self, name)
            if not is_integer(value):
                raise InputTypeError(f"{name} must be an integer >= {low}, got {type(value).__name__} {value!r}")
            if value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
            setattr(self, name, int(value))

        def real(name: str, allowed: str, ok) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise InputTypeError(f"{name} must be a number {allowed}, got {type(value).__name__} {value!r}")
            try:
                number = float(value)
            except OverflowError:  # an int beyond float's range
                number = math.inf
            if not (math.isfinite(number) and ok(number)):  # also rejects NaN and inf
                raise ValueError(f"{name} must be a finite number {allowed}, got {value!r}")
            setattr(self, name, number)

        integer("max_tokens", 1)
        integer("min_tokens", 0)
        integer("n", 1)
        integer("top_k", -1)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        real("temperature", ">= 0", lambda v: v >= 0.0)
        real("top_p", "in (0, 1]", lambda v: 0.0 < v <= 1.0)
        real("min_p", "in [0, 1]", lambda v: 0.0 <= v <= 1.0)
        real("repetition_penalty", "> 0", lambda v: v > 0.0)
        real("presence_penalty", "in [-2, 2]", lambda v: -2.0 <= v <= 2.0)
        real("frequency_penalty", "in [-2, 2]", lambda v: -2.0 <= v <= 2.0)
        if self.seed is not None:  # sample i of n draws from a torch generator seeded with seed + i
            if not is_integer(self.seed):
                raise InputTypeError(f"seed must be an integer in [0, 2**64) or None, got {type(self.seed).__name__} "
                                     f"{self.seed!r}")
            if not 0 <= self.seed <= SEED_LIMIT - self.n:
                raise ValueError(f"seed must be an integer in [0, 2**64 - n] (sample i of n uses seed + i), got "
                                 f"{self.seed!r}")
            self.seed = int(self.seed)
        if self.logprobs is not None:
            integer("logprobs", 0)
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if not isinstance(self.ignore_eos, bool):
            raise InputTypeError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise InputTypeError(f"cache_salt must be a string or None, got {type(self.cache_salt).__name__}")
        if not isinstance(self.stop, list) or any(not isinstance(s, str) for s in self.stop):
            raise InputTypeError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list) or not all(is_integer(t) for t in self.stop_token_ids):
            raise InputTypeError(f"stop_token_ids must be a list of integer token ids, got {self.stop_token_ids!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]


def _penalize(logits: torch.Tensor, history: list[list[int]], outputs: list[list[int]], params: list[SamplingParams]):
    """Repetition penalty (HF semantics, prompt + output) and presence / frequency penalties (output only)."""
    num_rows, vocab = logits.shape
    device = logits.device
    if any(p.repetition_penalty != 1.0 for p in params):
        rep = torch.tensor([p.repetition_penalty for p in params], device=device, dtype=logits.dtype)
        seen = torch.zeros(num_rows, vocab, dtype=torch.bool, device=device)
        for row, tokens in enumerate(history):
            if tokens:
                seen[row, torch.tensor(tokens, device=device)] = True
        penalized = torch.where(logits > 0, logits / rep[:, None], logits * rep[:, None])
        logits = torch.where(seen, penalized, logits)
    if any(p.presence_penalty != 0 or p.frequency_penalty != 0 for p in params):
        presence = torch.tensor([p.presence_penalty for p in params], device=device, dtype=logits.dtype)
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device, dtype=logits.dtype)
        counts = torch.zeros(num_rows, vocab, dtype=logits.dtype, device=device)
        for row, tokens in enumerate(outputs):
            if tokens:
                idx = torch.tensor(tokens, device=device)
                counts[row].index_add_(0, idx, torch.ones(len(tokens), dtype=logits.dtype, device=device))
        logits = logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)
    return logits


def _truncate(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """top-k, top-p and min-p in one sort; rows that use none of them pass through untouched."""
    device = logits.device
    top_k = torch.tensor([p.top_k if p.top_k > 0 else logits.shape[1] for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device, dtype=logits.dtype)
    min_p = torch.tensor([p.min_p for p in params], device=device, dtype=logits.dtype)
    if bool((top_k >= logits.shape[1]).all() and (top_p >= 1.0).all() and (min_p <= 0.0).all()):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1], device=device)[None, :]
    # top-k first: top-p and min-p see the renormalized top-k distribution (HF's and vLLM's order)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # keep a token while the mass strictly before it is < top_p (the top token always survives)
    drop = (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    drop |= probs < (min_p[:, None] * probs[:, :1])
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


def picks_by_argmax(params: SamplingParams, banned: list[int]) -> bool:
    """Whether `Sampler` gives this request the first maximum of its raw logits and nothing else (greedy; no
    repetition, presence or frequency penalty; no banned token this step; no log-probs): then only that index is
    needed, not the logits (`model.greedy_head`)."""
    return (params.greedy and params.logprobs is None and params.repetition_penalty == 1.0
            and params.presence_penalty == 0 and params.frequency_penalty == 0 and not banned)


ARGMAX_BLOCK = 128  # vocabulary entries per block of `first_argmax`
ARGMAX_BLOCKED_FROM = 1 << 16  # logits entries from which the blocked form pays for its half-dozen extra ops


def first_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Index of each row's first maximum: `logits.max(dim=-1).indices`, the same for every input (ties, -inf).
    On CPU torch's arg-reductions run element by element (64 x 32,000 fp32: ~0.9 ms on two cores) while a plain
    max is vectorized (~0.05 ms): so take the max of each block of ARGMAX_BLOCK entries, the first block holding
    the row's maximum, the first maximum inside it, and compare a last partial block on its own (~0.14 ms). Below
    ARGMAX_BLOCKED_FROM entries (4 x 1,000: ~5 us plain, ~40 us blocked) the plain reduction is faster."""
    rows, vocab = logits.shape
    if logits.device.type != "cpu" or vocab < 2 * ARGMAX_BLOCK or rows * vocab < ARGMAX_BLOCKED_FROM:
        return logits.max(dim=-1).indices
    full = vocab - vocab % ARGMAX_BLOCK
    block = logits[:, :full].reshape(rows, -1, ARGMAX_BLOCK).amax(dim=-1).max(dim=-1).indices
    columns = block[:, None] * ARGMAX_BLOCK + torch.arange(ARGMAX_BLOCK, device=logits.device)
    candidates = logits.gather(1, columns)
    best, inside = candidates.max(dim=-1)
    token_ids = block * ARGMAX_BLOCK + inside
    if full < vocab:  # strictly greater: on a tie the earlier block's index stands
        tail_best, tail_index = logits[:, full:].max(dim=-1)
        token_ids = torch.where(tail_best > best, tail_index + full, token_ids)
    return token_ids


class Sampler:
    """Samples one token per row in one batched pass.

    Reproducibility: a row whose request has a `seed` draws its noise from its own generator, so its
    tokens do not depend on what else is in the batch. Sampling uses the exponential-race form of
    multinomial sampling: argmax(p / E) with E ~ Exp(1) per vocabulary entry.
    """

    def __init__(self, device: torch.device, seed: int | None = None):
        self.device = device
        self.generator = torch.Generator(device=device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], history: list[list[int]],
                 outputs: list[list[int]], generators: list[torch.Generator | None],
                 banned: list[list[int]]) -> SampleResult:
        raw = logits
        logits = _penalize(logits, history, outputs, params)
        if any(banned):
            logits = logits.clone() if logits is raw else logits
            for row, tokens in enumerate(banned):
                if tokens:
                    logits[row, tokens] = float("-inf")
        processed = logits  # the distribution each row's token is drawn from (for processed log-probs)
        if all(p.greedy for p in params):
            token_ids = first_argmax(logits)
        else:
            greedy = torch.tensor([p.greedy for p in params], device=logits.device)
            temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params],
                                       device=logits.device, dtype=logits.dtype)
            scaled = _truncate(logits / temperature[:, None], params)
            probs = scaled.softmax(dim=-1)
            noise = torch.empty_like(probs).exponential_(generator=self.generator)
            for row, gen in enumerate(generators):
                if gen is not None:
                    noise[row].exponential_(generator=gen)
            sampled = (probs / noise).argmax(dim=-1)
            token_ids = torch.where(greedy, logits.argmax(dim=-1), sampled)
            processed = torch.where(greedy[:, None], logits, scaled)
        token_list = token_ids.tolist()
        return SampleResult(token_list, _logprobs(raw, processed, token_list, params))


def _logprobs(raw: torch.Tensor, processed: torch.Tensor, token_ids: list[int], params: list[SamplingParams]):
    """Per row, None or {token: log-prob} for the chosen token and the top `logprobs` ones, from the model's own
    distribution (`raw`) or the processed one its token was drawn from, as the row's `logprobs_mode` says."""
    wanted = [p.logprobs for p in params]
    if all(k is None for k in wanted):
        return [None] * len(params)
    modes = {p.logprobs_mode for p, k in zip(params, wanted) if k is not None}
    logp = {mode: (raw if mode == "raw_logprobs" else processed).float().log_softmax(dim=-1) for mode in modes}
    result: list[dict[int, float] | None] = []
    for row, k in enumerate(wanted):
        if k is None:
            result.append(None)
            continue
        row_logp = logp[params[row].logprobs_mode][row]
        entry = {token_ids[row]: float(row_logp[token_ids[row]])}
        if k > 0:
            values, indices = row_logp.topk(k)
            entry.update(zip(indices.tolist(), values.tolist()))
        result.append(entry)
    return result
