"""What the soak test (soak.py) checks and counts: the tally of a soak (`Soak`: counts and violations), the
unpressured reference engine every round's outputs are compared with, and the rounding-flip test (`flip_gap`) that
forgives a differing token only where the two tokens' decision values were tied to the last bits."""
from __future__ import annotations

import resource
import threading
from collections import Counter
from dataclasses import dataclass, field

import torch

from hf_paged import LLM
from hf_paged.model import describe_model
from hf_paged.sampling import _penalize, _truncate

from .soak_draw import EOS, Spec

COUNTS = ("rounds", "requests", "samples", "stream_rounds", "batch_rounds", "aborts", "aborts_running",
          "aborts_preempted", "aborts_swapped", "compared", "steps",
          "preemptions", "swap_outs", "swap_ins", "recomputed_tokens", "prefix_hit_tokens", "generated_tokens",
          "fault_rounds", "faults_injected", "faults_hit", "consumer_rounds", "weight_rounds", "weight_changes",
          "fp8_rounds", "fp8_skipped", "near_ties", "mismatches", "errors", "lost", "duplicated", "foreign",
          "bad_lengths", "leaks", "exceptions")
# a flip is forgiven when the two tokens' decision values differ by less than this: greedy, in logits (absolute);
# seeded sampling, in the race value p / E (relative). Rounding moves them by ~1e-7.
NEAR_TIE = {"greedy": 1e-4, "sampled": 1e-5}
NEAR_TIES_PER = 10_000  # compared samples per forgiven flip (plus one)
VIOLATION_COUNTS = ("mismatches", "errors", "lost", "duplicated", "foreign", "bad_lengths", "leaks", "exceptions")


@dataclass
class Soak:
    seed: int = 0
    counts: dict = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))
    violations: list[str] = field(default_factory=list)
    fault_points: Counter = field(default_factory=Counter)  # "point when error" of each injected fault that fired
    model_rounds: Counter = field(default_factory=Counter)  # rounds per model (--model with several)
    notes: list[str] = field(default_factory=list)  # what a model cannot take (e.g. fp8 on state layers)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # consumers report from their threads

    def violate(self, kind: str, message: str) -> None:
        with self.lock:
            self.counts[kind] += 1
            if len(self.violations) < 50:
                self.violations.append(message)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def model_name(model) -> str:
    return getattr(getattr(model, "config", None), "model_type", type(model).__name__)


def has_state(model) -> bool:
    return describe_model(model).has_state


def flip_gap(model, spec: Spec, index: int, before: list[int], tokens: tuple[int, int]) -> tuple[float, float]:
    """(gap, limit): how far apart sample `index`'s decision values for `tokens` were after output `before`,
    recomputed the way the engine's sampler decides (penalties, min_tokens bans, then the greedy logit or the race
    p / E with the sample's generator replayed: one draw per output token). A gap below the limit is a rounding tie."""
    p = spec.params
    prefix = spec.prompt + before
    with torch.no_grad():
        logits = model(torch.tensor([prefix])).logits[:, -1].float()
    logits = _penalize(logits, [prefix], [before], [p]).clone()
    if len(before) < p.min_tokens:
        logits[0, list(p.stop_token_ids) + ([] if p.ignore_eos else [EOS])] = float("-inf")
    if p.greedy:
        a, b = (logits[0, t].item() for t in tokens)
        return abs(a - b), NEAR_TIE["greedy"]
    generator = torch.Generator().manual_seed(p.seed + index)
    for _ in range(len(before) + 1):
        noise = torch.empty(logits.shape[1]).exponential_(generator=generator)
    race = _truncate(logits / p.temperature, [p]).softmax(dim=-1)[0] / noise
    a, b = (race[t].item() for t in tokens)
    return abs(a - b) / max(a, b, 1e-30), NEAR_TIE["sampled"]


def compare(soak: Soak, reference: LLM, specs: list[Spec], ended: dict, options: dict, model) -> None:
    """Outputs must equal the same requests' outputs on an unpressured engine, per sample index (a rounding tie
    at the first differing token is counted, not a violation, within the bound; see the module's docstring)."""
    if not specs:
        return
    before = reference.stats()["num_preemptions"]
    outs = reference.generate([s.prompt for s in specs], [s.params for s in specs], use_tqdm=False)
    if reference.stats()["num_preemptions"] != before:
        raise RuntimeError("the reference engine preempted: make its pool bigger")
    for spec, out in zip(specs, outs):
        for want in out.outputs:
            got = ended.get((spec.rid, want.index))
            if got is None:
                continue  # counted as lost
            soak.counts["compared"] += 1
            if (got.token_ids, got.finish_reason) != (want.token_ids, want.finish_reason):
                at = next((i for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids)) if a != b),
                          min(len(got.token_ids), len(want.token_ids)))
                gap = None
                if at < min(len(got.token_ids), len(want.token_ids)):
                    gap, limit = flip_gap(model, spec, want.index, list(want.token_ids[:at]),
                                          (got.token_ids[at], want.token_ids[at]))
                    if gap < limit and soak.counts["near_ties"] < 1 + soak.counts["compared"] // NEAR_TIES_PER:
                        soak.counts["near_ties"] += 1
                        continue
                soak.violate("mismatches", f"{spec.rid}/{want.index} differs from the unpressured run at output "
                                           f"token {at} ({got.finish_reason}/{want.finish_reason}; decision gap "
                                           f"{'-' if gap is None else f'{gap:.2e}'}; prompt "
                                           f"{len(spec.prompt)} tokens, {spec.params}; engine {options})")


def reference_engine(model, fp8: bool = False, scales=None) -> LLM:
    """Big pool, every request admitted at once, no chunking: nothing is ever preempted, and every block is kept
    (also on a sliding-window model, whose soaked engines give back the blocks behind the window). `fp8`: an fp8
    cache with scales calibrated as every engine of the model does; `scales`: with these (None: unquantized). On a
    model with state layers no prefix cache either: every prompt's state is computed from its first token."""
    fp8 = dict(kv_cache_dtype="fp8_e4m3", kv_scales=scales) if fp8 or scales is not None else {}
    llm = LLM(model, block_size=16, num_blocks=12000, max_num_seqs=512, max_num_batched_tokens=1 << 17,
              enable_chunked_prefill=False, preemption_mode="recompute", attention_backend="torch",
              enable_prefix_caching=not has_state(model), **fp8)
    llm.engine.scheduler.release_window = None
    return llm
