"""The background thread's side of `PagedBatchingManager`: requests into the engine, engine outputs out as
transformers' `GenerationOutput` (integrations/cb_manager.py). Runs on that thread only."""
from __future__ import annotations

import time

from .cb_params import request_params


class OutputBuilder:
    """Adds requests to the manager's LLM and turns its per-sample outputs into `GenerationOutput`s.

    Invariant: `manager._live` holds every request added and not yet finished nor cancelled, with what its outputs
    need (its sample names, prompt, creation time, streaming flag, per-sample timestamps, start / end times)."""

    def __init__(self, manager):
        self.manager = manager
        self.llm = manager.llm

    def _failed(self, names: list[str], prompt: list[int], created: float, message: str) -> None:
        m = self.manager
        for name in names:
            m._deliver(m._output_class(request_id=name, prompt_ids=prompt, error=message, status=m._status.FAILED,
                                       created_time=created))

    def add(self, request_id: str, prompt: list[int], max_new_tokens, streaming: bool, record_timestamps: bool,
            eos_token_id, keywords: dict, created: float) -> None:
        from .cb_manager import _names

        m = self.manager
        if eos_token_id is None:
            eos_token_id = m.generation_config.eos_token_id
        names = _names(request_id, m.num_return_sequences)  # read now, as transformers does (it may have changed)
        if request_id in m._live:
            self._failed(names, prompt, created, f"request id {request_id!r} is already running")
            return
        try:
            params = request_params(m._base_params, m.generation_config, len(prompt), max_new_tokens, eos_token_id,
                                    keywords, n=len(names))
            self.llm.add_request(prompt, params, request_id=request_id)
        except ValueError as e:  # refused up front: the request ends at once, naming why
            self._failed(names, prompt, created, str(e))
            return
        m._live[request_id] = {"names": names, "prompt": prompt, "created": created, "streaming": streaming,
                               "timestamps": [[] for _ in names] if record_timestamps else None,
                               "sent": [0] * len(names), "done": [False] * len(names), "start": -1.0}

    def cancel(self, request_id: str) -> None:
        """As transformers does: the request stops and delivers nothing more."""
        if self.manager._live.pop(request_id, None) is not None:
            self.llm.abort(request_id)

    def emit(self, out) -> None:
        m = self.manager
        info = m._live.get(out.request_id)
        if info is None:  # cancelled meanwhile
            return
        now = time.perf_counter()
        if info["start"] < 0:
            info["start"] = now
        for sample in out.outputs:
            index = sample.index
            tokens = list(sample.token_ids)
            if info["timestamps"] is not None:
                info["timestamps"][index].extend([now] * (len(tokens) - info["sent"][index]))
            info["sent"][index] = len(tokens)
            finished = sample.finish_reason is not None
            if finished:
                info["done"][index] = True
            if not (finished or info["streaming"]):
                continue
            failed = sample.finish_reason == "error"
            logprobs = [] if not sample.logprobs else [entry[token] for entry, token in zip(sample.logprobs, tokens)
                                                        if entry is not None and token in entry]
            status = m._status.FAILED if failed else m._status.FINISHED if finished else m._status.DECODING
            m._deliver(m._output_class(
                request_id=info["names"][index], prompt_ids=info["prompt"], generated_tokens=tokens,
                logprobs=logprobs, error=(sample.error or "generation failed") if failed else None, status=status,
                created_time=info["created"], lifespan=(info["start"], now if finished else -1),
                timestamps=list(info["timestamps"][index]) if info["timestamps"] is not None else None))
        if all(info["done"]):
            m._live.pop(out.request_id, None)
