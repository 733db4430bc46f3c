"""Requests coming in: tokenizing prompts and refusing what can never be served, before any work starts."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..config import EngineConfig
from ..kv import blocks_needed
from ..sampling import SamplingParams


@dataclass(slots=True)
class Limits:
    """What a request must fit: the vocabulary, the model's length, the KV pool and (unchunked) one step."""

    vocab_size: int
    max_model_len: int | None
    num_blocks: int
    config: EngineConfig


def tokenize(tokenizer: Any, prompt: str | Sequence[int], index: int) -> list[int]:
    """A prompt's token ids. Raises ValueError('request {index}: ...') for anything else than text or token ids."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"request {index}: a text prompt needs a tokenizer (LLM(model, tokenizer=...))")
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if isinstance(prompt, torch.Tensor):
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
        raise ValueError(f"request {index}: a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    return list(prompt)


def check_request(limits: Limits, index: int, token_ids: list[int], params: SamplingParams) -> None:
    """Raise ValueError('request {index}: ...') for anything that can never be served."""
    try:
        params.validate()
    except ValueError as e:
        raise ValueError(f"request {index}: {e}") from None
    if not token_ids:
        raise ValueError(f"request {index}: the prompt is empty")
    bad = [t for t in token_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise ValueError(f"request {index}: token ids {bad[:5]} are outside the vocabulary [0, {limits.vocab_size})")
    total = len(token_ids) + params.max_tokens
    if limits.max_model_len is not None and total > limits.max_model_len:
        raise ValueError(f"request {index}: prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) = "
                         f"{total} exceeds the model's maximum length {limits.max_model_len}")
    config = limits.config
    if blocks_needed(total, config.block_size) > limits.num_blocks:
        raise ValueError(f"request {index}: prompt + max_tokens = {total} tokens can never fit the KV pool "
                         f"({limits.num_blocks} blocks = {limits.num_blocks * config.block_size} tokens); raise "
                         f"num_blocks or kv_cache_memory")
    if not config.enable_chunked_prefill and total > config.max_num_batched_tokens:
        raise ValueError(f"request {index}: {total} tokens exceed max_num_batched_tokens "
                         f"({config.max_num_batched_tokens}) with chunked prefill disabled")
