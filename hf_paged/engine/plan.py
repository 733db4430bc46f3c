"""What passes between the engine's pieces in one step: the scheduler's plan and the runner's outcome."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..request import Request


@dataclass(slots=True)
class StepPlan:
    """One step's work, made by `Scheduler.schedule()` and applied by `Scheduler.update()`.

    `num_new_tokens[i]` tokens of `requests[i]` run, starting at its `num_computed_tokens`. `sampled` lists the
    requests that receive a token this step, in the order the runner returns their results: every scheduled
    request whose tokens are all computed after this step, plus the samples that fork from it (`forks`: (parent,
    child), the child starting from the parent's just-computed prompt); `sample_sources[j]` is the index in
    `requests` whose last row gives `sampled[j]` its logits. Before the forward pass the memory moves run in this
    order: `swap_out`, `copies` (copy-on-write), `blocks_to_clear` (less the copies' destinations), `swap_in` (freed
    blocks may be handed out again in the same step).
    """

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    sampled: list[Request] = field(default_factory=list)
    sample_sources: list[int] = field(default_factory=list)
    forks: list[tuple[Request, Request]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    swap_out: list[tuple[list[int], list[int]]] = field(default_factory=list)  # (device ids, host ids)
    swap_in: list[tuple[list[int], list[int]]] = field(default_factory=list)  # (host ids, device ids)
    blocks_to_clear: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (source block, destination block)
    # per entry of `requests`: state checkpoints its rows write, (rows in, checkpoint slot) (state models only)
    checkpoints: list[list[tuple[int, int]]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def add(self, request: Request, num_new_tokens: int) -> None:
        self.requests.append(request)
        self.num_new_tokens.append(num_new_tokens)

    def remove(self, request: Request) -> int:
        """Take a request back out (it was preempted later in the same schedule). Returns its token count."""
        for i, placed in enumerate(self.requests):
            if placed is request:
                del self.requests[i]
                return self.num_new_tokens.pop(i)
        return 0


@dataclass(slots=True)
class Sampled:
    """The runner's result for one sampled request: a token (and whether the sampling hook says stop now), or an
    error that ends only this request (`non_finite`: its logits, and so maybe its K/V, were NaN / inf)."""

    token: int | None = None
    stop_now: bool = False
    logprobs: dict[int, float] | None = None
    error: str | None = None
    non_finite: bool = False


@dataclass(slots=True)
class StepOutcome:
    """`results[j]` belongs to `plan.sampled[j]`; `elapsed_s` is the wall time of the forward pass and sampling."""

    results: list[Sampled]
    elapsed_s: float = 0.0


@dataclass(slots=True)
class PreemptionCosts:
    """Measured rates behind preemption_mode="auto": swapping moves a request's bytes out and back at the
    measured copy bandwidth; recomputing re-runs its tokens at the observed prefill throughput (until a
    prefill-sized step has been seen, a conservative prior that favours recompute)."""

    copy_bytes_per_s: float = 8e9
    prefill_tokens_per_s: float | None = None

    def swap_is_cheaper(self, num_bytes: int, num_tokens: int) -> bool:
        prefill = self.prefill_tokens_per_s or 1e5
        return 2 * num_bytes / self.copy_bytes_per_s < num_tokens / prefill

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """Fold a prefill-sized step into the throughput estimate (exponential moving average)."""
        if num_tokens >= 64 and seconds > 0:
            rate = num_tokens / seconds
            previous = self.prefill_tokens_per_s
            self.prefill_tokens_per_s = rate if previous is None else 0.5 * previous + 0.5 * rate
