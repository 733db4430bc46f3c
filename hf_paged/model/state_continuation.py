"""How each state module must run a continuation: a piece of a sequence after a state (a chunk of a prompt, the rest
of a prompt after a prefix hit, a recompute), of more than one token.

A continuation must give what the whole input at once gives. Not every module's own code does that: HF's generate
prefills a whole prompt at once and then decodes single tokens, so a module may only ever have continued a state one
token at a time (transformers' Mamba-1 scan, `mamba` / `falcon_mamba` / `jamba`, starts any multi-token input from a
zero recurrent state). Which module does what is not a list of families but a check of each module class, once per
model (dtype, device), on its own inputs from one LENGTH-token forward of the model on its own cache: after the
state of its first PREFIX tokens, the rest as a continuation must give (1) the outputs of the whole input at once and
(2), from that state with its recurrent part AMPLIFY times larger (so that a dropped state cannot hide under float
rounding: a tiny model's state may barely reach its outputs), the outputs of a continuation token by token. The first
mode that does both is the module's (`state_layers` runs it):

- `AS_IS`: one call, as the module's own code runs it (every family whose code continues a state; no cost);
- `KEEP_STATES`: calls in which the cache asks for every token's recurrent state, which sends transformers'
  recurrent modules through their recurrent form from the previous state (Mamba-1: one batched projection per call,
  then the scan token by token);
- `TOKEN_BY_TOKEN`: one call per token, the single-token path every decode takes (any module whose decode is right).

A module for which no mode is exact, or whose check cannot run, runs `AS_IS`: the start-up check (`probe`), which
compares the paged forward through such pieces with the model's own forward on each whole prefix, then refuses the
model rather than serve it wrong.
"""
from __future__ import annotations

import inspect
import threading

import torch

from ..kv.state import StateSlots
from .forward_lock import forward_lock
from .state_layers import (AS_IS, KEEP_STATES, TOKEN_BY_TOKEN, StateRun, StateView, UnsupportedState, cache_keyword,
                           own_forward, run_module, split_arguments)
from .state_modules import own_cache

MODES = (AS_IS, KEEP_STATES, TOKEN_BY_TOKEN)  # tried in this order: the cheapest exact one is taken
PREFIX, LENGTH = 2, 5  # the check's continuation: tokens PREFIX:LENGTH after a state of PREFIX tokens
AMPLIFY = 1000.0  # the recurrent state of the second check is this many times the real one
# the largest |difference| relative to the largest |output| that is still float rounding (the start-up check's
# tolerances): a continuation that drops the previous state is off by the order of the outputs themselves
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
HALF_TOLERANCE = 3e-2


@torch.inference_mode()
def continuation_modes(model: torch.nn.Module, state_modules: dict[str, int]) -> dict[str, str]:
    """{module name: mode} for the state modules `state_modules` names ({module name: its layer}), one check per
    module class (see the module doc). Kept on the model per (dtype, device)."""
    if not state_modules:
        return {}
    param = next(model.parameters())
    key = (str(param.dtype), str(param.device))
    known = model.__dict__.setdefault("_hf_paged_continuation", {})
    if key not in known:
        modules = {name: model.get_submodule(name) for name in state_modules}
        firsts: dict[type, tuple[int, torch.nn.Module]] = {}
        for name, module in modules.items():
            firsts.setdefault(type(module), (state_modules[name], module))
        inputs = module_inputs(model, [module for _, module in firsts.values()])
        modes = {cls: _mode(module, layer, inputs.get(module), param.dtype)
                 for cls, (layer, module) in firsts.items()}
        known[key] = {name: modes[type(module)] for name, module in modules.items()}
    return known[key]


def module_inputs(model: torch.nn.Module, modules: list) -> dict:
    """{module: (args, kwargs) of its first call} in one LENGTH-token forward of the model on the cache its forward
    keeps its states on (`own_cache`), in this thread ({} if that forward fails)."""
    inputs: dict = {}
    thread = threading.get_ident()

    def capture(module, args, kwargs):
        if threading.get_ident() == thread:
            inputs.setdefault(module, (args, kwargs))

    device = next(model.parameters()).device
    text = model.config.get_text_config(decoder=True)
    vocab = min(getattr(text, "vocab_size", None) or 256, 1000)
    ids = torch.randint(3, max(vocab, 4), (1, LENGTH), generator=torch.Generator().manual_seed(0)).to(device)
    cache = own_cache(model)  # (before the hooks: finding which cache may run a forward of its own)
    try:
        given = {cache_keyword(model.forward): cache}
    except UnsupportedState:  # a forward taking no cache (rwkv passes its blocks a state of its own making)
        given = {}
    with forward_lock(model):
        hooks = [module.register_forward_pre_hook(capture, with_kwargs=True) for module in modules]
        try:
            model(input_ids=ids, use_cache=True, **given)
        except Exception:  # noqa: BLE001 - no inputs: every module runs AS_IS and the start-up check decides
            return {}
        finally:
            for hook in hooks:
                hook.remove()
    return inputs


def _mode(module: torch.nn.Module, layer: int, call: tuple | None, dtype: torch.dtype) -> str:
    """The first of MODES in which `module`'s continuation of tokens PREFIX:LENGTH gives (1) after the state of tokens
    :PREFIX its outputs for all LENGTH tokens at once, and (2) after that state with every recurrent state AMPLIFY
    times larger (a state whose part in the outputs float rounding cannot hide) the outputs of a continuation token by
    token; AS_IS if none does or the check cannot run."""
    if call is None:
        return AS_IS
    own = own_forward(module)
    signature = inspect.signature(own)
    keyword = cache_keyword(own)
    model_type = getattr(getattr(module, "config", None), "model_type", type(module).__name__)
    try:
        hidden_states, per_row = split_arguments(signature, keyword, *call, f"model type {model_type!r}")
        if hidden_states.shape[1] != LENGTH:
            return AS_IS
        device = hidden_states.device
        slots = StateSlots(device, 2)
        tail = slice(PREFIX, LENGTH)

        def outputs(rows: slice, slot: int, fresh: bool, store: bool, mode: str = AS_IS) -> torch.Tensor:
            run = StateRun(rows, torch.tensor([slot], device=device), fresh, store)
            parts = run_module(own, keyword, hidden_states, per_row, StateView(slots, layer, run, model_type, mode))
            return torch.cat([out[0] if isinstance(out, tuple) else out for _, out in parts], dim=1).float()

        whole = outputs(slice(0, LENGTH), 0, True, False)[:, PREFIX:]
        outputs(slice(0, PREFIX), 0, True, True)  # slot 0: the state after PREFIX tokens
        slots.copy(0, 1)
        for key, tensor in slots.tensors.items():  # slot 1: that state, its recurrent part amplified
            if key[1] == "recurrent":
                tensor[1] *= AMPLIFY
        stepped = outputs(tail, 1, False, False, TOKEN_BY_TOKEN)
        tolerance = TOLERANCE.get(dtype, HALF_TOLERANCE)
        for mode in MODES:  # continuations store nothing: each starts from the same states
            if (_close(outputs(tail, 0, False, False, mode), whole, tolerance)
                    and _close(outputs(tail, 1, False, False, mode), stepped, tolerance)):
                return mode
    except Exception:  # noqa: BLE001 - a module the check cannot run: the start-up check decides
        return AS_IS
    return AS_IS


def _close(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> bool:
    """Largest |difference| within `tolerance` of the largest |want| (NaN is not close)."""
    return float((got - want).abs().max()) <= tolerance * max(float(want.abs().max()), 1e-6)
