"""`LLM`: the offline batch API (vLLM-style) on top of the engine."""
from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from .engine import Engine
from .engine.intake import (as_params, as_params_list, as_priorities, as_priority, as_prompt_list, check_request,
                            prompt_text)
from .request import RequestGroup, RequestOutput
from .sampling import SamplingParams


class LLM:
    """Generate for many prompts at once with continuous batching over a paged KV cache.

    `LLM(model, tokenizer=tok, block_size=16, max_num_seqs=128)` takes the same keys as
    `generate(..., cache_config={...})` (see `EngineConfig`).
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, **options):
        self.engine = Engine(model, tokenizer, **options)

    # streaming-style access -----------------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams | dict | None = None, *, request_id: str | None = None,
                    priority: int = 0) -> str:
        """Queue one prompt; returns its request id. Invalid input raises ValueError (InputTypeError for a wrong type)
        before anything is queued. `params` may also be a dict of SamplingParams fields."""
        engine = self.engine
        params = as_params(params, 0)
        priority = as_priority(priority, 0)
        token_ids = engine.tokenize(prompt, 0)
        check_request(engine.limits, 0, token_ids, params, has_tokenizer=engine.tokenizer is not None)
        return engine.add_request(token_ids, params, request_id=request_id, priority=priority,
                                  prompt_text=prompt_text(prompt)).request_id

    def step(self) -> list[RequestOutput]:
        """One engine step; an output for every sample that received a token or finished (with `n` > 1, one per
        sample: `outputs[0].index` says which). A prompt whose samples have all finished is forgotten."""
        outputs = []
        for request in self.engine.step():
            outputs.append(self.engine.output(request.group, [request]))
            if request.group.is_finished:
                self.engine.release(request.group)
        return outputs

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished

    def stats(self) -> dict:
        return self.engine.stats()

    # offline batch ---------------------------------------------------------------------------------
    def generate(self, prompts: str | Sequence, sampling_params: SamplingParams | dict | Sequence | None = None,
                 *, use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Outputs in input order. Every prompt and its parameters are validated before any work starts: a bad one
        raises ValueError (InputTypeError, also a TypeError, for a wrong type) naming it ("request 2: ...") and nothing
        is queued. `sampling_params`: None, one SamplingParams (or dict of its fields) for all, or one per prompt."""
        prompts = as_prompt_list(prompts)
        params_list = as_params_list(sampling_params, len(prompts))
        priorities = as_priorities(priority, len(prompts))
        engine = self.engine
        has_tokenizer = engine.tokenizer is not None
        tokenized = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            tokenized.append(engine.tokenize(prompt, i))
            check_request(engine.limits, i, tokenized[-1], params, has_tokenizer=has_tokenizer)
        groups: list[RequestGroup] = []
        try:
            for i, (ids, params) in enumerate(zip(tokenized, params_list)):
                groups.append(engine.add_request(ids, params, index=i, prompt_text=prompt_text(prompts[i]),
                                                 priority=priorities[i]))
            self._run(groups, use_tqdm)
        except BaseException:
            for group in groups:  # an exception (or Ctrl-C) leaves none of this call's requests behind
                engine.abort(group.request_id)
            raise
        outputs = [engine.output(group) for group in groups]
        for group in groups:
            engine.release(group)
        return outputs

    def _run(self, groups: list[RequestGroup], use_tqdm: bool) -> None:
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(groups), desc="Processed prompts", unit="req", dynamic_ncols=True)
        counted: set[int] = set()
        start = time.perf_counter()
        prompt_tokens = output_tokens = 0
        while self.engine.has_unfinished:
            stepped = self.engine.step()
            if bar is None:
                continue
            for request in stepped:
                group = request.group
                if id(group) not in counted and group.is_finished:
                    counted.add(id(group))
                    prompt_tokens += len(group.prompt_token_ids)
                    output_tokens += sum(r.num_output_tokens for r in group.samples)
                    elapsed = max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(f"est. input {prompt_tokens / elapsed:.0f} tok/s, "
                                        f"output {output_tokens / elapsed:.0f} tok/s", refresh=False)
                    bar.update(1)
        if bar is not None:
            bar.close()
