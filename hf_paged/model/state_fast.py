"""Faster forwards for state modules whose transformers code calls the gated delta rule, the short-convolution
helpers or a Mamba selective scan (Qwen3.5, Qwen3-Next, OLMo-Hybrid, ...; the convolutions of Mamba-2, LFM2, ...;
the scans of Mamba-2, Nemotron-H, Falcon-H1, Bamba, Granite-4 hybrids, Zamba2, and of Mamba, Falcon-Mamba, Jamba):
the module's own forward with `gated_delta`'s, `ssd_scan`'s and `mamba_scan`'s functions in place of transformers'
torch reference code, chosen per module class by a check on first use.

The module's own forward still runs (its projections, gates, norms): `fast_forward` is a copy of its function whose
globals name our functions in place of transformers' (`SUBSTITUTES`; where one function has a substitute per part,
"name@decode" and "name@prefill", each wraps the one before and passes on what it does not cover), so only the
engine's calls through `state_layers.state_forward` see them; transformers' module, its functions and every plain
forward stay as they are.

Which substitutes a module class takes (`fast_paths`, once per model, dtype, device and torch threads):
1. agreement: the module's forward with every substitute it can take gives its own forward's outputs and stored
   states, to within float rounding (`TOLERANCE`), on its own inputs from a short forward of the model: a prefill, a
   continuation after a state, and two sequences' decode steps in one call; if not, it takes none (logged);
2. speed, on this machine: the decode substitutes (`DECODE`) on TIMING_BATCH sequences' decode step, the prefill
   ones (`PREFILL`) on a TIMING_LENGTH-token prefill, each against the module's own forward, alternated, the
   fastest of two each; a part is taken only if more than MARGIN faster. `HF_PAGED_STATE_FAST` = "fast" / "own"
   takes every agreeing substitute / none without timing (the agreement check runs regardless).

Invariant: a fast forward runs only on a `StateView` (the engine's state runs), whose states are the view's own:
`gated_delta.recurrent_step` updates the state it is given in place.
"""
from __future__ import annotations

import inspect
import logging
import os
import time
import types

import torch

from .. import trials
from ..kv.state import StateSlots
from .gated_delta import chunk_rule, conv_step, recurrent_step
from . import mamba_scan, ssd_scan
from .state_continuation import module_inputs
from .state_layers import StateRun, StateView, cache_keyword, own_forward, run_module, split_arguments

logger = logging.getLogger("hf_paged")

# substitutes: transformers' name in a modeling module (with "@part" where one function has a substitute per part,
# applied in turn, each wrapping the one before) -> what makes our substitute from the function it replaces
SUBSTITUTES = {"torch_recurrent_gated_delta_rule": recurrent_step, "causal_conv1d_forward": conv_step,
               "torch_chunk_gated_delta_rule": chunk_rule,
               "mamba2_scan_forward@decode": ssd_scan.decode_scan, "mamba2_scan_forward@prefill": ssd_scan.prefill_scan,
               "mamba_scan_forward@decode": mamba_scan.decode_scan,
               "mamba_scan_forward@prefill": mamba_scan.prefill_scan}
DECODE = frozenset({"torch_recurrent_gated_delta_rule", "causal_conv1d_forward", "mamba2_scan_forward@decode",
                    "mamba_scan_forward@decode"})
PREFILL = frozenset({"torch_chunk_gated_delta_rule", "mamba2_scan_forward@prefill", "mamba_scan_forward@prefill"})
SWITCH = "HF_PAGED_STATE_FAST"  # "fast" / "own": skip the timing (the agreement check still runs)
TIMING_BATCH, TIMING_LENGTH = 32, 128
MARGIN = 0.05  # a part must be more than 5 % faster to be taken
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8}  # largest |difference| / largest |value| still rounding
HALF_TOLERANCE = 2e-2


def substitutable(module: torch.nn.Module) -> frozenset:
    """The names in `SUBSTITUTES` that the module's forward calls (none for an instance forward, or a module carrying
    accelerate hooks: the copy skips the forward's outer wrappers)."""
    if "forward" in vars(module) or any(hasattr(m, "_hf_hook") for m in module.modules()):
        return frozenset()
    function = inspect.unwrap(type(module).forward)
    if not isinstance(function, types.FunctionType):
        return frozenset()
    called = set(function.__code__.co_names) & set(function.__globals__)
    return frozenset(entry for entry in SUBSTITUTES if modeling_name(entry) in called)


def modeling_name(entry: str) -> str:
    """The modeling module's name a `SUBSTITUTES` entry replaces."""
    return entry.split("@")[0]


def fast_forward(module: torch.nn.Module, names: frozenset):
    """The module's forward with the substitutes `names` in place of transformers' functions (a copy of its innermost
    function with globals of its own), bound to the module; None for no names."""
    names = names & substitutable(module)
    if not names:
        return None
    function = inspect.unwrap(type(module).forward)
    scope = dict(function.__globals__)
    for entry in sorted(names):
        scope[modeling_name(entry)] = SUBSTITUTES[entry](scope[modeling_name(entry)])
    copy = types.FunctionType(function.__code__, scope, function.__name__, function.__defaults__,
                              function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy.__get__(module)


@torch.inference_mode()
def fast_paths(model: torch.nn.Module, state_modules: dict[str, int]) -> dict[str, object]:
    """{module name: its fast forward, or None for its own} for the state modules `state_modules` names ({module
    name: its layer}): one choice per module class (see the module doc), kept on the model per (dtype, device, torch
    threads)."""
    param = next(model.parameters())
    key = (str(param.dtype), str(param.device), torch.get_num_threads())
    known = model.__dict__.setdefault("_hf_paged_state_fast", {})
    if key not in known:
        modules = {name: model.get_submodule(name) for name in state_modules}
        firsts: dict[type, tuple[int, torch.nn.Module]] = {}
        for name, module in modules.items():
            if substitutable(module):
                firsts.setdefault(type(module), (state_modules[name], module))
        inputs = module_inputs(model, [module for _, module in firsts.values()]) if firsts else {}
        chosen = {cls: _choose(module, layer, inputs.get(module), param.dtype)
                  for cls, (layer, module) in firsts.items()}
        known[key] = {name: chosen.get(type(module), frozenset()) for name, module in modules.items()}
    return {name: fast_forward(model.get_submodule(name), names) for name, names in known[key].items()}


def _choose(module: torch.nn.Module, layer: int, call: tuple | None, dtype: torch.dtype) -> frozenset:
    """The substitutes `module`'s class takes (see the module doc)."""
    names = substitutable(module)
    if call is None:
        return frozenset()
    own = own_forward(module)
    model_type = getattr(getattr(module, "config", None), "model_type", type(module).__name__)
    try:
        keyword = cache_keyword(own)
        hidden_states, per_row = split_arguments(inspect.signature(own), keyword, *call, model_type)
        if hidden_states.shape[1] < 4:
            return frozenset()
        trial = _Trial(layer, keyword, per_row, model_type, hidden_states)
        trials.recorded.calls += 1  # this step also ran the module's trial runs (step_choice does not time it)
        if not trial.agrees(own, fast_forward(module, names), TOLERANCE.get(dtype, HALF_TOLERANCE)):
            logger.info("hf_paged: %s's faster state forward differs from its own; it runs its own",
                        type(module).__name__)
            return frozenset()
        choice = os.environ.get(SWITCH, "")
        if choice in ("fast", "own"):
            return names if choice == "fast" else frozenset()
        taken = frozenset()
        for part, timed in ((DECODE, trial.decode_seconds), (PREFILL, trial.prefill_seconds)):
            fast = fast_forward(module, names & part)
            try:
                if fast is not None and timed(fast) < (1 - MARGIN) * timed(own):
                    taken |= names & part
            except Exception:  # noqa: BLE001 - a part the timing cannot run is not taken
                continue
        return taken
    except Exception:  # noqa: BLE001 - a module the check cannot run keeps its own forward
        return frozenset()


class _Trial:
    """Runs of one module on its own captured inputs (`hidden_states` [1, L, ...], L >= 4) through `StateView`s."""

    def __init__(self, layer: int, keyword: str, per_row: dict, model_type: str, hidden_states: torch.Tensor):
        self.layer, self.keyword, self.per_row, self.model_type = layer, keyword, per_row, model_type
        self.hidden_states, self.device = hidden_states, hidden_states.device

    def run(self, forward, rows, slots: StateSlots, ids: list[int], fresh: bool, hidden=None) -> torch.Tensor:
        run = StateRun(rows, torch.tensor(ids, device=self.device), fresh)
        hidden = self.hidden_states if hidden is None else hidden
        per_row = self.per_row if hidden is self.hidden_states else {}
        parts = run_module(forward, self.keyword, hidden, per_row, StateView(slots, self.layer, run, self.model_type))
        return torch.cat([out[0] if isinstance(out, tuple) else out for _, out in parts], dim=1)

    def agrees(self, own, fast, tolerance: float) -> bool:
        """The same outputs and stored states from `own` and `fast`: a whole prefill, a continuation of it after 2
        tokens, and one decode call of two sequences (states after 2 and 3 tokens)."""
        length = self.hidden_states.shape[1]
        results = []
        for forward in (own, fast):
            slots, outputs = StateSlots(self.device, 4), []
            outputs.append(self.run(forward, slice(0, length), slots, [0], True))
            self.run(forward, slice(0, 2), slots, [1], True)
            outputs.append(self.run(forward, slice(2, length), slots, [1], False))
            self.run(forward, slice(0, 2), slots, [2], True)
            self.run(forward, slice(0, 3), slots, [3], True)
            outputs.append(self.run(forward, torch.tensor([2, 3], device=self.device), slots, [2, 3], False))
            results.append((outputs, slots))
        (want, want_slots), (got, got_slots) = results
        return (all(_close(g, w, tolerance) for g, w in zip(got, want))
                and want_slots.tensors.keys() == got_slots.tensors.keys()
                and all(_close(got_slots.tensors[k], t, tolerance) for k, t in want_slots.tensors.items()))

    def decode_seconds(self, forward) -> float:
        """The fastest of two decode calls of TIMING_BATCH sequences (states after 2 and 3 tokens, in turn)."""
        slots = StateSlots(self.device, 2)
        self.run(forward, slice(0, 2), slots, [0], True)
        self.run(forward, slice(0, 3), slots, [1], True)
        rows = torch.tensor([2, 3] * (TIMING_BATCH // 2), device=self.device)
        best = float("inf")
        for _ in range(2):
            many = StateSlots(self.device, TIMING_BATCH)
            many.tensors = {k: t[torch.arange(TIMING_BATCH) % 2].clone() for k, t in slots.tensors.items()}
            start = time.perf_counter()
            self.run(forward, rows, many, list(range(TIMING_BATCH)), False)
            best = min(best, time.perf_counter() - start)
        return best

    def prefill_seconds(self, forward) -> float:
        """The fastest of two TIMING_LENGTH-token prefills (inputs of the captured ones' scale)."""
        generator = torch.Generator().manual_seed(0)
        hidden = (torch.randn((1, TIMING_LENGTH, *self.hidden_states.shape[2:]), generator=generator)
                  .to(self.hidden_states) * self.hidden_states.float().std())
        best = float("inf")
        for _ in range(2):
            start = time.perf_counter()
            self.run(forward, slice(0, TIMING_LENGTH), StateSlots(self.device, 1), [0], True, hidden)
            best = min(best, time.perf_counter() - start)
        return best


def _close(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> bool:
    """Largest |difference| within `tolerance` of the largest |want| (NaN is not close)."""
    return float((got.float() - want.float()).abs().max()) <= tolerance * max(float(want.abs().max()), 1e-6)
