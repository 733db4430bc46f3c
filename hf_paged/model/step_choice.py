"""Whether a step runs hf_paged's CPU fast paths at all: measured per model and row bucket, as each of them is.

Each fast path of a forward (the few-row products of `small_linear` and `packed_linear`, the greedy head, the native
norms and rotary, the fused layers, the experts' products) is chosen against its plain alternative call by call.
What no such trial sees is what the paths cost together around their calls: the forwards swapped in and out every
step, the checks that copies still hold their weights' values, each linear's dispatch to its choice. On a model
small enough that a step is mostly Python (hidden 64, 2 layers: `hf-paged bench calls`) that cost outweighed what the
paths save.

So the stack is itself a candidate: the first few-row steps (at most BUCKETS[-1], 128 packed rows) of each key (the
model's class, parameter count and dtype, the step's row bucket, the torch thread count) run in turn with the paths
on (`FAST`) and off (`PLAIN`: transformers' modules as they are; attention still reads the paged cache, as it must),
each step's run (forward and sampling) timed whole in a `trials.Trial`, and the paths stay unless plain measured
more than `trials.MARGIN` faster (`trials.fastest`, FAST the baseline: each path already earned its place call by
call).

Invariants:
- Only few-row steps of CPU models take part; every other step is FAST, as before: CUDA (no synchronized timing
  here), and steps of more rows (prefill), whose products' own trials time what dominates them and where a plain
  step tried could cost seconds.
- A key's trial starts only after one of its FAST steps ran without another trial recording a call (`trials.recorded`,
  `SETTLED`): until then its steps time the candidates of its products, not the stack, and run FAST, so that those
  trials end as soon as they would without this one. A trial step during which another trial recorded a call is not
  counted either. The process-wide `TABLE` holds a key's choice for the rest of the
  process (the generate door builds an engine per call: a per-engine choice would be measured again every call).
- Both candidates give the same tokens up to the order of floating-point sums, as every other choice does; plain
  steps read no copy and swap no forward, so they are right whatever happened to the weights.
- `HF_PAGED_STEP_CHOICE`: unset / `auto` measures; `fast` (or `1`) always runs the paths (the suite does, so that it
  exercises them); `plain` (or `0`) never does.
"""
from __future__ import annotations

import logging
import os

import torch

from .. import trials
from .linear_choice import BUCKET_OF, BUCKETS

logger = logging.getLogger("hf_paged")

FAST, PLAIN = "fast", "plain"
SWITCH = "HF_PAGED_STEP_CHOICE"
MODES = {"": "auto", "auto": "auto", "fast": FAST, "1": FAST, "plain": PLAIN, "0": PLAIN}
TABLE = trials.Table(FAST)
SETTLED: set = set()  # keys whose fast steps have run without another trial: their own trial may start


def mode() -> str:
    """`HF_PAGED_STEP_CHOICE` as "auto", FAST or PLAIN (an unknown value: auto)."""
    return MODES.get(os.environ.get(SWITCH, "").strip().lower(), "auto")


class StepChoice:
    """One runner's view of `TABLE`: `next(rows)` says whether a step of `rows` packed rows runs the fast paths and,
    for a trial step, what to `record` once it ran."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        first = next(iter(model.parameters()), None)
        self.measured = device.type == "cpu" and first is not None
        self.signature = (type(model).__qualname__, sum(p.numel() for p in model.parameters()),
                          None if first is None else first.dtype) if self.measured else None

    def next(self, rows: int | None) -> tuple[bool, tuple | None]:
        """(whether this step runs the fast paths, what `record` needs after it: (key, candidate or None,
        `trials.recorded` now), or None where nothing is measured)."""
        chosen = mode()
        if chosen != "auto" or not self.measured or rows is None or rows > BUCKETS[-1]:
            return chosen != PLAIN, None
        key = (self.signature, BUCKET_OF[rows], torch.get_num_threads())
        choice = TABLE.choices.get(key)
        if choice is not None:
            return choice.path == FAST, None
        if key not in SETTLED:  # FAST until one such step ran no other trial
            return True, (key, None, trials.recorded.calls)
        name = TABLE.next_call(key, {FAST: FAST, PLAIN: PLAIN})
        if name is None:
            return TABLE.choices[key].path == FAST, None
        return name == FAST, (key, name, trials.recorded.calls)

    @staticmethod
    def record(trial: tuple | None, seconds: float) -> None:
        """The step's time for its trial, unless another trial recorded a call during the step."""
        if trial is None:
            return
        key, name, mark = trial
        if trials.recorded.calls != mark:
            return
        if name is None:
            SETTLED.add(key)
            return
        choice = TABLE.record(key, name, seconds)
        if choice is not None:
            logger.debug("hf_paged: steps of %s rows: %s (%s)", key[1], choice.path,
                         ", ".join(f"{n} {s * 1e3:.2f} ms" for n, s in choice.seconds.items()))


def step_choices() -> list[dict]:
    """Every key chosen so far: the model's class, the row bucket, threads, the choice, each candidate's ms."""
    return [{"model": key[0][0], "rows": key[1], "threads": key[2], "path": choice.path,
             "ms": {name: round(seconds * 1e3, 3) for name, seconds in choice.seconds.items()}}
            for key, choice in sorted(TABLE.choices.items(), key=lambda item: (item[0][0][0], item[0][1:]))]
