"""Requests coming in: tokenizing prompts and refusing what can never be served, before any work starts.

Every refusal is a ValueError naming the request by its index ("request 2: ..."); a value of the wrong type raises
`InputTypeError`, which is a TypeError and a ValueError at once (see docs/reliability.md for the whole table).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..config import EngineConfig, InputTypeError, is_integer
from ..kv import blocks_needed
from ..sampling import SamplingParams


@dataclass(slots=True)
class Limits:
    """What a request must fit: the vocabulary, the model's length, the KV pool and (unchunked) one step."""

    vocab_size: int
    max_model_len: int | None
    num_blocks: int
    config: EngineConfig
    blocks_for: Callable[[int], int] | None = None  # blocks a sequence of n tokens holds at once (KV manager's)

# ---- the shape of a whole call --------------------------------------------------------------------------------
def _is_scalar(value: Any) -> bool:
    return isinstance(value, (bool, int, float, np.generic)) or (isinstance(value, torch.Tensor) and value.dim() == 0)


def as_prompt_list(prompts: Any) -> list:
    """The prompts of one `generate` call as a list: one prompt (a string, token ids, a 1-D tensor / array, a vLLM
    style dict) becomes a list of one; a 2-D tensor / array gives one prompt per row; any other iterable is read
    once (a generator works). Raises InputTypeError for anything else."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (torch.Tensor, np.ndarray)):
        if prompts.ndim == 1:
            return [prompts]
        if prompts.ndim == 2:
            return list(prompts)
        raise InputTypeError(f"a tensor of prompts must be 1-D (one prompt) or 2-D (one per row), got shape "
                             f"{tuple(prompts.shape)}")
    if isinstance(prompts, (list, tuple)) and prompts and _is_scalar(prompts[0]):
        return [prompts]  # one prompt of token ids (each id is checked by `tokenize`)
    if prompts is None or isinstance(prompts, (bytes, bytearray)) or not hasattr(prompts, "__iter__"):
        raise InputTypeError(f"prompts must be a string, a list of token ids or a list of such prompts, got "
                             f"{type(prompts).__name__}")
    return list(prompts)


def as_params_list(params: Any, count: int) -> list[SamplingParams]:
    """One SamplingParams per prompt: None (the defaults), one SamplingParams or dict for every prompt, or a list of
    them, one per prompt. A dict is built into SamplingParams(**dict) (as vLLM's keyword form)."""
    if params is None or isinstance(params, (SamplingParams, dict)):
        return [as_params(params, None)] * count
    if isinstance(params, (str, bytes)) or not hasattr(params, "__iter__"):
        raise InputTypeError(f"sampling_params must be a SamplingParams, a dict of its fields or a list of them (one "
                             f"per prompt), got {type(params).__name__}")
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling params for {count} prompts")
    return [as_params(p, i) for i, p in enumerate(params)]


def as_params(params: Any, index: int | None) -> SamplingParams:
    """A SamplingParams from None, a SamplingParams or a dict of its fields."""
    where = f"request {index}: " if index is not None else ""
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params
    if isinstance(params, dict):
        known = {f.name for f in fields(SamplingParams)}
        unknown = sorted(str(k) for k in params if k not in known)
        if unknown:
            raise ValueError(f"{where}unknown sampling parameter(s) {unknown}; known: {sorted(known)}")
        return SamplingParams(**params)
    raise InputTypeError(f"{where}sampling params must be a SamplingParams or a dict of its fields, got "
                         f"{type(params).__name__}")


def as_priority(value: Any, index: int) -> int:
    if not is_integer(value):
        raise InputTypeError(f"request {index}: priority must be an integer, got {type(value).__name__} {value!r}")
    return int(value)


def as_priorities(priority: Any, count: int) -> list[int]:
    """One integer priority per prompt (None: all 0)."""
    if priority is None:
        return [0] * count
    if isinstance(priority, (str, bytes, dict)) or not hasattr(priority, "__iter__"):
        raise InputTypeError(f"priority must be a list of integers, one per prompt, got {type(priority).__name__}")
    priority = list(priority)
    if len(priority) != count:
        raise ValueError(f"got {len(priority)} priorities for {count} prompts")
    return [as_priority(p, i) for i, p in enumerate(priority)]


# ---- one request ----------------------------------------------------------------------------------------------
def prompt_text(prompt: Any) -> str | None:
    if isinstance(prompt, dict):
        prompt = prompt.get("prompt")
    return prompt if isinstance(prompt, str) else None


def tokenize(tokenizer: Any, prompt: Any, index: int) -> list[int]:
    """A prompt's token ids: text (needs a tokenizer), token ids (a list / tuple of integers, or a 1-D integer
    tensor / array) or a vLLM-style dict {"prompt": text} / {"prompt_token_ids": ids}. Raises ValueError (a wrong
    type: InputTypeError) as 'request {index}: ...'."""
    if isinstance(prompt, dict):
        if set(prompt) not in ({"prompt"}, {"prompt_token_ids"}):
            raise ValueError(f"request {index}: a dict prompt needs exactly one key, 'prompt' (text) or "
                             f"'prompt_token_ids', got {sorted(map(str, prompt))}")
        prompt = next(iter(prompt.values()))
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"request {index}: a text prompt needs a tokenizer (LLM(model, tokenizer=...))")
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if isinstance(prompt, (torch.Tensor, np.ndarray)):
        if prompt.ndim != 1:
            raise InputTypeError(f"request {index}: a prompt tensor must be 1-D, got shape {tuple(prompt.shape)}")
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple, range)):
        raise InputTypeError(f"request {index}: a prompt must be a string or a list of token ids, got "
                             f"{type(prompt).__name__}")
    if all(type(t) is int for t in prompt):  # the common case, at a fraction of the per-token checks' cost
        return list(prompt)
    for position, token in enumerate(prompt):
        if isinstance(token, dict) and "role" in token:
            raise InputTypeError(f"request {index}: this prompt is a chat conversation (message dicts); use "
                                 f"LLM.chat(messages) for conversations")
        if not is_integer(token):
            raise InputTypeError(f"request {index}: token ids must be integers; position {position} holds "
                                 f"{type(token).__name__} {token!r}")
    return [int(t) for t in prompt]


def check_request(limits: Limits, index: int, token_ids: list[int], params: SamplingParams,
                  has_tokenizer: bool | None = None) -> None:
    """Raise ValueError('request {index}: ...') (InputTypeError for a wrong type) for anything that can never be
    served. `has_tokenizer=False` also refuses stop strings (they are matched on decoded text)."""
    if not isinstance(params, SamplingParams):
        raise InputTypeError(f"request {index}: sampling params must be a SamplingParams, got "
                             f"{type(params).__name__} (LLM.generate also takes a dict of its fields)")
    try:
        params.validate()
    except ValueError as e:
        raise type(e)(f"request {index}: {e}") from None
    if not token_ids:
        raise ValueError(f"request {index}: the prompt is empty")
    vocab = limits.vocab_size
    bad = [t for t in token_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"request {index}: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    bad = [t for t in params.stop_token_ids if t >= vocab]
    if bad:
        raise ValueError(f"request {index}: stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    if params.logprobs is not None and params.logprobs > vocab:
        raise ValueError(f"request {index}: logprobs={params.logprobs} asks for more top tokens than the "
                         f"vocabulary has ({vocab})")
    if params.stop and has_tokenizer is False:
        raise ValueError(f"request {index}: stop strings {params.stop} need a tokenizer (LLM(model, tokenizer=...)); "
                         f"without one use stop_token_ids")
    total = len(token_ids) + params.max_tokens
    if limits.max_model_len is not None and total > limits.max_model_len:
        raise ValueError(f"request {index}: prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) = "
                         f"{total} exceeds the model's maximum length {limits.max_model_len}")
    config = limits.config
    need = limits.blocks_for(total) if limits.blocks_for is not None else blocks_needed(total, config.block_size)
    if need > limits.num_blocks:
        raise ValueError(f"request {index}: prompt + max_tokens = {total} tokens can never fit the KV pool (they hold "
                         f"{need} blocks of {config.block_size} tokens at once, the pool has {limits.num_blocks}); "
                         f"raise num_blocks or kv_cache_memory")
    if not config.enable_chunked_prefill and total > config.max_num_batched_tokens:
        raise ValueError(f"request {index}: {total} tokens exceed max_num_batched_tokens "
                         f"({config.max_num_batched_tokens}) with chunked prefill disabled")


# ---- the engine as a whole ------------------------------------------------------------------------------------
def check_model_len(config: EngineConfig, model_max_len: int | None) -> None:
    """Refuse a max_model_len beyond the model's position table (max_position_embeddings): positions past it index
    out of a learned table (an IndexError mid-step) or leave the range a rotary model was trained for."""
    if config.max_model_len is not None and model_max_len is not None and config.max_model_len > model_max_len:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's maximum length "
                         f"(max_position_embeddings={model_max_len}); leave it unset or use at most {model_max_len}")
