"""What transformers' continuous-batching settings mean on hf_paged: engine options from a `ContinuousBatchingConfig`,
`SamplingParams` from a `GenerationConfig` (and a request's `logit_processor_kwargs`), and what hf_paged leaves to
transformers' own manager (`reason_to_decline`)."""
from __future__ import annotations

import dataclasses

from ..sampling import SamplingParams

# transformers' logits processors the sampler reproduces (by class name), and the SamplingParams field each sets
KNOWN_PROCESSORS = {"TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
                    "RepetitionPenaltyLogitsProcessor", "MinNewTokensLengthLogitsProcessor"}
# per-request keywords of transformers' continuous-batching processors that map onto SamplingParams fields
REQUEST_KEYWORDS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                    "repetition_penalty": "repetition_penalty"}
REQUEST_KEYWORD_TYPES = {"temperature": float, "top_k": int, "top_p": float, "min_p": float,
                         "repetition_penalty": float}


def reason_to_decline(model, generation_config, cb_config) -> str | None:
    """Why transformers' own manager must serve this (None: hf_paged serves it): beam search, a tensor-parallel
    model, a logits processor the sampler does not have."""
    if (getattr(generation_config, "num_beams", 1) or 1) > 1:
        return "beam search (num_beams > 1)"
    if int(getattr(model, "_tp_size", None) or 1) > 1:
        return "a tensor-parallel model"
    try:
        processors = model._get_logits_processor(generation_config)
    except Exception as e:  # noqa: BLE001 - transformers' manager would fail the same way: let it say so
        return f"its logits processors could not be built ({type(e).__name__}: {e})"
    odd = sorted({type(p).__name__ for p in processors} - KNOWN_PROCESSORS)
    if odd:
        return f"logits processors hf_paged's sampler does not have: {odd}"
    return None


def engine_options(cb_config, workload_hints=None) -> dict:
    """hf_paged engine options from transformers' `ContinuousBatchingConfig` (None: the engine's defaults): the pool
    (num_blocks x block_size tokens), tokens per step, sequences per step, prefix sharing, the seed. Without
    num_blocks, `workload_hints` of a whole workload (generate_batch's: requests, longest prompt, new tokens) size the
    pool to hold it all at once (`hinted` in the result; the engine's default pool can be 100x larger, and making
    its blocks costs a TRL rollout, which makes a manager per call, more than generating)."""
    options: dict = {}
    hints = [int(getattr(workload_hints, name, 0) or 0)
             for name in ("num_requests", "max_prompt_length", "max_generated_length")]
    if cb_config is None:
        cb_config = object()
    block_size = getattr(cb_config, "block_size", None)
    num_blocks = getattr(cb_config, "num_blocks", None)
    if block_size:
        options["block_size"] = int(block_size)
    if num_blocks:
        tokens = int(num_blocks) * int(block_size or getattr(cb_config, "page_size", 16) or 16)
        options["num_blocks"] = -(-tokens // options.get("block_size", 16))
    if getattr(cb_config, "max_batch_tokens", None):
        options["max_num_batched_tokens"] = int(cb_config.max_batch_tokens)
    if getattr(cb_config, "max_requests_per_batch", None):
        options["max_num_seqs"] = int(cb_config.max_requests_per_batch)
    if getattr(cb_config, "allow_block_sharing", True) is False:
        options["enable_prefix_caching"] = False
    if getattr(cb_config, "seed", None) is not None:
        options["seed"] = int(cb_config.seed)
    if "num_blocks" not in options and all(hints):
        size = options.get("block_size", 16)
        options["num_blocks"] = options["hinted"] = hints[0] * -(-(hints[1] + hints[2]) // size)
    return options


def sampling_params(generation_config, model, plain: bool = False) -> SamplingParams:
    """The SamplingParams a GenerationConfig asks for (greedy unless `do_sample`), without a length or stop tokens
    (each request sets those), log-probs of the chosen token on, after the processors (as transformers' manager
    reports them). `plain`: without its processors (temperature 1, no top-k / p, min-p, penalty, min length), as
    after transformers' `logit_processor.clear()`."""
    fields: dict = {"logprobs": 0, "logprobs_mode": "processed_logprobs", "ignore_eos": True,
                    "n": getattr(generation_config, "num_return_sequences", None) or 1}
    if plain:
        fields["temperature"] = 1.0 if getattr(generation_config, "do_sample", False) else 0.0
        return SamplingParams(**fields)
    if getattr(generation_config, "do_sample", False):
        fields["temperature"] = float(generation_config.temperature if generation_config.temperature is not None
                                      else 1.0)
        fields["top_k"] = int(generation_config.top_k or 0)
        fields["top_p"] = float(generation_config.top_p if generation_config.top_p is not None else 1.0)
        fields["min_p"] = float(getattr(generation_config, "min_p", None) or 0.0)
    else:
        fields["temperature"] = 0.0
    penalty = getattr(generation_config, "repetition_penalty", None)
    if penalty is not None:
        fields["repetition_penalty"] = float(penalty)
    if getattr(generation_config, "min_new_tokens", None):
        fields["min_tokens"] = int(generation_config.min_new_tokens)
    return SamplingParams(**fields)


def request_params(base: SamplingParams, generation_config, prompt_len: int, max_new_tokens: int | None,
                   eos_token_id, keywords: dict, n: int = 1) -> SamplingParams:
    """One request's SamplingParams: `base` with its length, its end-of-sequence tokens (-1 / None: none), its `n`
    samples and the per-request keywords. Raises ValueError naming a keyword it cannot apply."""
    unknown = sorted(set(keywords) - set(REQUEST_KEYWORDS))
    if unknown:
        raise ValueError(f"unknown logit_processor_kwargs {unknown}; hf_paged applies {sorted(REQUEST_KEYWORDS)}")
    if max_new_tokens is None:
        max_new_tokens = generation_config.max_new_tokens
    if max_new_tokens is None:
        max_new_tokens = max(1, (generation_config.max_length or 20) - prompt_len)
    eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    changes = {REQUEST_KEYWORDS[k]: v for k, v in keywords.items()}
    if base.temperature == 0:  # greedy (do_sample off): as in transformers, no keyword makes the request sample
        changes = {k: v for k, v in changes.items() if k not in ("temperature", "top_k", "top_p", "min_p")}
    return dataclasses.replace(base, max_tokens=int(max_new_tokens), n=int(n),
                               stop_token_ids=[int(t) for t in eos if int(t) >= 0], **changes)
