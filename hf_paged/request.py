"""A request's life: WAITING -> RUNNING <-> PREEMPTED (recompute) or SWAPPED (host copy) -> FINISHED."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed; recomputed on resume
    SWAPPED = "swapped"  # blocks copied to host swap space; copied back on resume
    FINISHED = "finished"


@dataclass(slots=True)
class Request:
    """One sequence being generated.

    Invariants: `all_token_ids == prompt_token_ids + output_token_ids`;
    `num_computed_tokens <= len(all_token_ids)` counts tokens whose K/V are in the cache;
    `block_table` holds ceil(num_computed_tokens / block_size) or more physical block ids while the
    request holds memory, and is empty while it waits.
    """

    request_id: str
    index: int  # position in the caller's input, used to order outputs and name bad requests
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival: int = 0
    priority: int = 0
    prompt: str | None = None
    sample_index: int = 0  # which of the n samples of one prompt this is
    controller: Any = None  # optional per-request sampling hook (see integrations.generate)
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    error: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache at first admission (-1: not yet)
    block_hashes: list[bytes] = field(default_factory=list)  # chain keys of full blocks of all_token_ids
    num_published_blocks: int = 0  # leading table blocks already in the prefix map
    swapped_blocks: list[int] = field(default_factory=list)  # host swap blocks while SWAPPED
    forks: list["Request"] = field(default_factory=list)  # other samples of this prompt, started from it

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def cache_salt(self) -> str | None:
        return self.params.cache_salt

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
