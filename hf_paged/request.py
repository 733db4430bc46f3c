"""A request's life: WAITING -> RUNNING <-> PREEMPTED (recompute) or SWAPPED (host copy) -> FINISHED."""
from __future__ import annotations

import enum
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed; recomputed on resume
    SWAPPED = "swapped"  # blocks copied to host swap space; copied back on resume
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class ParentRequest:
    """One prompt as the caller sees it: its id, its place in the caller's input and its `n` samples.

    Invariant: `samples[i].sample_index == i` and every sample points back here through `parent`. Aborting the
    parent ends exactly these samples; ids are the caller's strings, never parsed.
    """

    request_id: str
    index: int  # position in the caller's input, used to order outputs and name bad requests
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list["Request"] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.perf_counter)

    @property
    def is_finished(self) -> bool:
        return all(r.is_finished for r in self.samples)


@dataclass(slots=True, eq=False)
class Request:
    """One sequence being generated (one sample of a `ParentRequest`).

    Invariants: `all_token_ids == prompt_token_ids + output_token_ids`;
    `num_computed_tokens <= len(all_token_ids)` counts tokens whose K/V are in the cache;
    `block_tables` (one per KV group, written by the KV manager only) each hold ceil(num_computed_tokens /
    block_size) or more physical block ids while the request holds memory (in a group whose layers attend through a
    sliding window, a leading run of them may be the null block: given back behind the window), and there are none
    while it waits; `block_table` is the first group's. Only the scheduler changes `status`,
    `num_computed_tokens` and the outputs (through `append_token` / `finish`).
    """

    parent: ParentRequest
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival: int = 0
    priority: int = 0
    sample_index: int = 0  # which of the n samples of its parent this is
    controller: Any = None  # optional per-request sampling hook (see integrations.generate)
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_tables: list[list[int]] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    error: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache at first admission (-1: not yet)
    block_hashes: list[bytes] = field(default_factory=list)  # chain keys of full blocks of all_token_ids
    num_published_blocks: int = 0  # leading table blocks already in the prefix map
    stale_kv: bool = False  # holds K/V computed before what produces K/V changed: publishes nothing (kv.manager)
    swapped_blocks: list[int] = field(default_factory=list)  # host swap blocks while SWAPPED
    state_slot: int = -1  # its slot in the state layers' `StateSlots` while it holds one (hybrid models)
    swapped_state: dict | None = None  # its state layers' state in host memory while SWAPPED
    forks: list["Request"] = field(default_factory=list)  # other samples of this prompt, started from it
    # HF's right padding: the first output is sampled from the logits of this (token id, position), a query that
    # attends to the whole prompt and whose own K/V are never stored; outputs then continue from its position + 1
    first_query: tuple[int, int] | None = None
    # token type ids (HF's `token_type_ids`): one per prompt token, and the one every output token takes (HF repeats
    # the input's last column); None: the model is called without them
    token_types: tuple[list[int], int] | None = None
    kv_salt: str | None = None  # set from the above: K/V are shared only between requests with equal inputs

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)
        extra = []
        if self.position_shift:
            extra.append(f"positions{self.position_shift:+d}")
        if self.token_types is not None:
            extra.append("types" + hashlib.blake2b(repr(self.token_types).encode(), digest_size=16).hexdigest())
        if extra:
            salt = self.params.cache_salt
            self.kv_salt = "\x00".join(["-" if salt is None else "+" + salt, *extra])

    def __repr__(self) -> str:
        return (f"Request({self.parent.request_id!r}, sample={self.sample_index}, status={self.status.value}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")

    @property
    def block_table(self) -> list[int]:
        """The first KV group's table (the only one of a model whose attention layers share one kind)."""
        return self.block_tables[0] if self.block_tables else []

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.block_tables = [table] if table else []

    @property
    def index(self) -> int:
        return self.parent.index

    @property
    def arrival_time(self) -> float:
        return self.parent.arrival_time

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def cache_salt(self) -> str | None:
        """Blocks are shared only between requests whose tokens sit at the same positions with the same types."""
        return self.params.cache_salt if self.kv_salt is None else self.kv_salt

    @property
    def position_shift(self) -> int:
        """Position of output token j minus its index (num_prompt_tokens + j): 0 unless `first_query` is set."""
        if self.first_query is None:
            return 0
        return self.first_query[1] + 1 - len(self.prompt_token_ids)

    @property
    def needs_first_query(self) -> bool:
        """The step that completes the prompt samples from `first_query`, not from the last prompt token."""
        return self.first_query is not None and not self.output_token_ids

    def types(self, start: int, end: int) -> list[int]:
        """Token type ids of tokens start..end-1 (requests with `token_types` only)."""
        prompt, output = self.token_types
        return prompt[start:end] + [output] * (end - max(start, len(prompt)))

    def positions(self, start: int, end: int) -> range | list[int]:
        """Position ids of tokens start..end-1: prompt tokens at their index, outputs shifted by `position_shift`."""
        shift = self.position_shift
        prompt = len(self.prompt_token_ids)
        if not shift or end <= prompt:
            return range(start, end)
        split = max(start, prompt)
        return [*range(start, split), *range(split + shift, end + shift)]

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def finish(self, reason: str, error: str | None = None) -> None:
        self.finished_time = time.perf_counter()
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.error = error

    def snapshot(self) -> tuple:
        """Everything a step may change in this request (see `restore`)."""
        return (self.status, self.num_computed_tokens, [list(t) for t in self.block_tables], len(self.output_token_ids),
                self.finish_reason, self.error, self.stop_reason, None if self.logprobs is None else len(self.logprobs),
                None if self.generator is None else self.generator.get_state(), self.num_preemptions,
                self.first_token_time, self.finished_time, self.num_cached_tokens, len(self.block_hashes),
                self.num_published_blocks, list(self.swapped_blocks), list(self.forks), self.stale_kv,
                self.state_slot, self.swapped_state)

    def restore(self, saved: tuple) -> None:
        """Put back what `snapshot` saw (a failed step is undone; outputs only ever grow within one)."""
        (self.status, self.num_computed_tokens, self.block_tables, num_outputs, self.finish_reason, self.error,
         self.stop_reason, num_logprobs, generator_state, self.num_preemptions, self.first_token_time,
         self.finished_time, self.num_cached_tokens, num_hashes, self.num_published_blocks, self.swapped_blocks,
         self.forks, self.stale_kv, self.state_slot, self.swapped_state) = saved
        del self.output_token_ids[num_outputs:]
        del self.all_token_ids[len(self.prompt_token_ids) + num_outputs:]
        if num_logprobs is not None:
            del self.logprobs[num_logprobs:]
        if generator_state is not None:
            self.generator.set_state(generator_state)
        del self.block_hashes[num_hashes:]

    def banned_token_ids(self) -> list[int]:
        """Tokens that may not be sampled now: stop tokens and EOS until `min_tokens` outputs exist."""
        if self.num_output_tokens >= self.params.min_tokens:
            return []
        eos = [] if self.params.ignore_eos else list(self.eos_token_ids)
        return list(self.params.stop_token_ids) + eos


def apply_stop_rules(request: Request, token: int, stop_now: bool, max_model_len: int | None,
                     detokenize: Callable[[list[int]], str] | None) -> None:
    """Append a sampled token and finish the request if a stop rule fires. The one place stop rules live.

    Order: the sampling hook's own stop, stop token ids and EOS (from `min_tokens` on; EOS is the hook's business
    when there is one), stop strings (from `min_tokens` on: one that the newest token completes; see
    `find_stop_string`), then length limits (a stop string completed by the last allowed token is a "stop"). A
    tokenizer failing to decode for the stop-string check ends the request with finish_reason "error".
    """
    request.append_token(token)
    params = request.params
    past_min = request.num_output_tokens >= params.min_tokens
    if stop_now:
        request.finish("stop")
    elif past_min and token in params.stop_token_ids:
        request.finish("stop")
        request.stop_reason = token
    elif past_min and not params.ignore_eos and token in request.eos_token_ids and request.controller is None:
        request.finish("stop")
    elif params.stop and past_min and detokenize is not None and _stop_string(request, detokenize):
        pass
    elif request.num_output_tokens >= params.max_tokens:
        request.finish("length")
    elif max_model_len is not None and request.num_tokens >= max_model_len:
        request.finish("length")


def _stop_string(request: Request, detokenize: Callable[[list[int]], str]) -> bool:
    """Finish the request if its newest token completes a stop string; whether it did."""
    try:
        hit = find_stop_string(request.output_token_ids, request.params.stop, detokenize)
    except Exception as e:  # noqa: BLE001 - the tokenizer failing on stop strings ends only this request
        request.finish("error", f"checking stop strings failed: {type(e).__name__}: {e}")
        return True
    if hit is None:
        return False
    request.finish("stop")
    request.stop_reason = hit
    return True


def find_stop_string(token_ids: list[int], stops: list[str], detokenize: Callable[[list[int]], str]) -> str | None:
    """The first of `stops` that the newest token completes: an occurrence that ends inside the newest token's text
    (one that ended earlier, e.g. before `min_tokens`, does not count), decoding only the output's tail.

    The tail starts a few tokens further back (its first token may decode differently alone, e.g. a dropped leading
    space) and doubles until the text before the newest token is longer than the longest stop string, or the tail is
    the whole output: the work per step is bounded by the stop strings' length, not by the output's.
    """
    longest = max(len(s) for s in stops)
    count = longest + 4
    while True:
        tail = token_ids[-count:]
        text, before = detokenize(tail), detokenize(tail[:-1])
        if count >= len(token_ids) or len(before) >= longest + 8:
            break
        count *= 2
    new_from = _common_prefix(text, before)
    return next((s for s in stops if text.find(s, max(0, new_from - len(s) + 1)) >= 0), None)


def stop_string_start(token_ids: list[int], stop: str, detokenize: Callable[[list[int]], str]) -> int | None:
    """Where in the decoded output the stop string that the last token completed begins (None: not found)."""
    text, before = detokenize(token_ids), detokenize(token_ids[:-1])
    found = text.find(stop, max(0, _common_prefix(text, before) - len(stop) + 1))
    return found if found >= 0 else None


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


@dataclass(slots=True)
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None
    error: str | None = None


@dataclass(slots=True)
class RequestOutput:
    """What `LLM.generate` returns per prompt. Flat fields describe the first sample; `outputs` holds all n."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = True
    metrics: dict = field(default_factory=dict)  # time_to_first_token_s, latency_s, num_preemptions

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self):
        return self.outputs[0].logprobs

    @property
    def error(self) -> str | None:
        return self.outputs[0].error
