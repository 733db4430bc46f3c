"""What callers get back: `RequestOutput`s built from a parent request (text decoded once, at the end)."""
from __future__ import annotations

from typing import Callable

from ..request import CompletionOutput, Request, ParentRequest, RequestOutput, stop_string_start


def completion(request: Request, detokenize: Callable[[list[int]], str] | None,
               partial: bool = False) -> CompletionOutput:
    """One sample's result. Text (finished samples only; with `partial`, also the text so far of an unfinished one)
    ends before a stop string that ended it. A tokenizer that fails to decode it makes this output an error
    (finish_reason "error", the tokens kept, no text)."""
    text, reason, error = None, request.finish_reason, request.error
    if (request.is_finished or partial) and detokenize is not None:
        stop = request.stop_reason
        try:
            text = detokenize(request.output_token_ids)
            if isinstance(stop, str):  # the occurrence the last token completed (an earlier one may exist)
                cut = stop_string_start(request.output_token_ids, stop, detokenize)
                text = text if cut is None else text[:cut]
        except Exception as e:  # noqa: BLE001 - the tokenizer failing ends only this output (its tokens are kept)
            text = None
            if reason != "error":
                reason, error = "error", f"decoding the output failed: {type(e).__name__}: {e}"
    return CompletionOutput(request.sample_index, list(request.output_token_ids), text, reason,
                            request.logprobs, error)


def parent_output(parent: ParentRequest, samples: list[Request] | None,
                 detokenize: Callable[[list[int]], str] | None, partial: bool = False) -> RequestOutput:
    """The output of `samples` (default: all) of one prompt, samples in order (`partial`: with the text so far of
    unfinished samples, for streaming snapshots)."""
    samples = parent.samples if samples is None else sorted(samples, key=lambda r: r.sample_index)
    first = parent.samples[0]
    return RequestOutput(parent.request_id, parent.prompt, list(parent.prompt_token_ids),
                         [completion(r, detokenize, partial) for r in samples],
                         num_cached_tokens=max(0, first.num_cached_tokens),
                         finished=all(r.is_finished for r in samples), metrics=metrics(parent))


def metrics(parent: ParentRequest) -> dict:
    """Wall-clock timings of one prompt's samples (seconds since it was added)."""
    firsts = [r.first_token_time for r in parent.samples if r.first_token_time is not None]
    ends = [r.finished_time for r in parent.samples if r.finished_time is not None]
    return {"time_to_first_token_s": min(firsts) - parent.arrival_time if firsts else None,
            "latency_s": max(ends) - parent.arrival_time if len(ends) == len(parent.samples) else None,
            "num_preemptions": sum(r.num_preemptions for r in parent.samples)}
