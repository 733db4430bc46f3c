"""State layers whose modules keep their state outside transformers' cache calls, served through the same state slots.

transformers' state modules mostly keep their per-sequence state through the cache's linear-attention calls, which
`state_layers.StateView` answers from the engine's state slots. Two families keep it elsewhere (`OWN_STATE`, by
module class):

- on the module itself (`OnModule`): recurrent_gemma's recurrent block holds its convolution window
  (`conv1d_state`) and its RG-LRU state (`rg_lru.recurrent_states`) as attributes, which its forward reads and
  replaces (with `use_cache`; the model's own forward sets them up for the batch it runs);
- in an argument the model passes down (`PassedIn`): rwkv's forward makes a list of state tensors with the layer
  along their last dimension and hands it to every block, which reads and writes its own layer's entries in place.

`bridge(module)` turns such a module into one that keeps its state through those cache calls: a function taking
the module's arguments and the view (as `cache`, or for a `PassedIn` module as that argument, which the view
replaces; the function's `cache_keyword` names it), which before the module's own forward puts each sequence's
states where the module reads them (the view's `get_recurrent_state(layer, i)`, i in the order `OWN_STATE` lists
them; the view names its layer), and after it hands what the module left there to `update_recurrent_state(value,
layer, i)`. A run of sequences starting from no state gets what the model's own forward starts a batch from: None
on the module (its own code then starts from zeros), the model's own initial state for a `PassedIn` argument
(recorded from one forward: `own_state_modules`). Everything else (runs per group of sequences, how continuations
run, checkpoints, forks, swap) is the state layers' own machinery, and the module's own code computes everything:
recurrent_gemma's own multi-token path starts its convolution from zeros, so `state_continuation` finds that its
continuations must run token by token; rwkv's own single-token step is right for a batch of one only, so its
bridge runs a batch of single tokens one sequence per call (`PassedIn.one_per_call`); the start-up check refuses a
model whose pieces would still go wrong.

recurrent_gemma's attention layers are ordinary sliding-window attention through transformers' attention interface:
their K/V live in the engine's paged K/V like any other sliding layer's.

Invariants: a bridge leaves the module as it found it (its state attributes are put back after every call, even on
error), and it writes nothing but the copies it hands the module (a state read from the view is cloned first). A
bridge runs one sequence per call unless every sequence has one token: it takes no attention mask (recurrent_gemma's
block ignores its mask, so a left-padded batch would feed padding into its convolution). A module's layer is its
place in the model's list of decoder layers: the first integer in its qualified name (`model.layers.3.temporal_block`
is layer 3). Module attributes are not per thread: while an engine's forward runs (under the model's forward lock),
another thread's own forward of the same model would see the bridged states; transformers' own forward of these
models is not safe to run from two threads at once either (each replaces the modules' state for its batch).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from .forward_lock import forward_lock

_INITIAL = "_hf_paged_initial_state"  # kept on a `PassedIn` module: {(dtype, device): its layer's initial states}


@dataclass(frozen=True)
class OnModule:
    """States held as attributes of the module or its submodules (dotted paths), set to None for a fresh start."""

    attributes: tuple[str, ...]


@dataclass(frozen=True)
class PassedIn:
    """States passed to the module's forward as the argument `keyword`: a list of tensors with the layer along their
    last dimension, each module reading and writing its own layer's entries. `one_per_call`: the module's own
    single-token step is right for one sequence only, so a batch of single tokens runs one sequence per call."""

    keyword: str
    one_per_call: bool = False


OWN_STATE = {
    "RecurrentGemmaRecurrentBlock": OnModule(("conv1d_state", "rg_lru.recurrent_states")),
    # transformers' RWKV single-token step adds the previous token's [B, H] to the new tokens' [B, 1, H], which
    # broadcasts to [B, B, H] (every sequence mixed with every other) when B > 1; HF's own batched generate of rwkv
    # goes wrong the same way
    "RwkvBlock": PassedIn("state", one_per_call=True),
}


def own_state_modules(model: torch.nn.Module) -> dict[str, int]:
    """{qualified name of a module that keeps its state on itself or in a passed argument (`OWN_STATE`): its layer},
    in module order; {} when the model has none. Records a `PassedIn` module's initial state for the model's current
    dtype and device (one 1-token forward of the model, the first time)."""
    found = {}
    for name, module in model.named_modules():
        how = OWN_STATE.get(type(module).__name__)
        layer = _layer_of(name)
        if how is None or layer is None:
            continue
        if isinstance(how, OnModule) and not all(_has(module, path) for path in how.attributes):
            continue  # not the module this entry describes (another transformers version): not served
        found[name] = layer
    passed = {name: layer for name, layer in found.items()
              if isinstance(OWN_STATE[type(model.get_submodule(name)).__name__], PassedIn)}
    modules = [model.get_submodule(name) for name in passed]
    if modules and any(_key(m) not in m.__dict__.get(_INITIAL, {}) for m in modules):
        _record_initial_states(model, modules, list(passed.values()))
    return found


def has_own_state(model: torch.nn.Module) -> bool:
    """Whether some module of the model keeps its state on itself or in a passed argument (`OWN_STATE`)."""
    return any(type(m).__name__ in OWN_STATE for m in model.modules())


def bridge(module: torch.nn.Module):
    """The module as one keeping its state through the cache calls (see the module doc), or None for a module not
    in `OWN_STATE`."""
    how = OWN_STATE.get(type(module).__name__)
    if how is None:
        return None
    forward = vars(module).get("forward") or type(module).forward.__get__(module)
    return (_on_module if isinstance(how, OnModule) else _passed_in)(module, how, forward)


def _on_module(module: torch.nn.Module, how: OnModule, forward):
    takes = inspect.signature(forward).parameters

    def bridged(hidden_states, position_ids=None, cache=None, **kwargs):
        layer = cache.layer
        saved = [_get(module, path) for path in how.attributes]
        states = [cache.get_recurrent_state(layer, i) for i in range(len(how.attributes))]
        fresh = any(state is None for state in states)
        try:
            for path, state in zip(how.attributes, states):
                _set(module, path, None if fresh else state.clone())
            options = {"use_cache": True} if "use_cache" in takes else {}
            if "attention_mask" in takes:
                options["attention_mask"] = None
            out = forward(hidden_states, position_ids=position_ids, **options)
            for i, path in enumerate(how.attributes):
                cache.update_recurrent_state(_get(module, path), layer, i)
        finally:
            for path, value in zip(how.attributes, saved):
                _set(module, path, value)
        return out

    bridged.cache_keyword = "cache"
    return bridged


def _passed_in(module: torch.nn.Module, how: PassedIn, forward):
    takes = inspect.signature(forward).parameters

    def bridged(hidden_states, **kwargs):
        cache = kwargs.pop(how.keyword)
        layer = cache.layer
        initial, num_layers = _initial(module)
        states = [cache.get_recurrent_state(layer, i) for i in range(len(initial))]
        batch = hidden_states.shape[0]
        if any(state is None for state in states):  # a fresh start: the model's own initial state
            states = [s.to(hidden_states.device).expand(batch, *s.shape[1:]) for s in initial]
        states = [s.clone() for s in states]
        if "use_cache" in takes:
            kwargs["use_cache"] = True
        rows = [slice(b, b + 1) for b in range(batch)] if how.one_per_call else [slice(0, batch)]
        outs = []
        for part in rows:
            # the layer's entries are views of `states`; every other layer's entry of the list is the same memory
            argument = [s[part].unsqueeze(-1).expand(*s[part].shape, num_layers) for s in states]
            out = forward(hidden_states[part], **{how.keyword: argument}, **kwargs)
            # the passed state back: nothing per row of the packed step
            outs.append(tuple(None if item is argument else item for item in out) if isinstance(out, tuple) else out)
        for i, state in enumerate(states):
            cache.update_recurrent_state(state, layer, i)
        return outs[0] if len(outs) == 1 else _stacked(outs)

    bridged.__signature__ = inspect.Signature([
        inspect.Parameter("hidden_states", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter(how.keyword, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None),
        inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])
    bridged.cache_keyword = how.keyword
    return bridged


def _stacked(outs: list):
    """The outputs of one-sequence calls as the output of one call on all of them (tensors joined along the batch;
    a tuple entry that is not a tensor is None)."""
    if isinstance(outs[0], torch.Tensor):
        return torch.cat(outs)
    return tuple(torch.cat(items) if isinstance(items[0], torch.Tensor) else None for items in zip(*outs))


def _initial(module: torch.nn.Module) -> tuple[list[torch.Tensor], int]:
    """A `PassedIn` module's recorded initial states ([1, *shape] each, its layer's entries) and the number of layers
    the model's list holds."""
    recorded = module.__dict__.get(_INITIAL, {}).get(_key(module))
    if recorded is None:
        raise ValueError(f"{type(module).__name__}: no initial state recorded for its dtype and device (the engine "
                         f"records it when it describes the model)")
    return recorded


@torch.inference_mode()
def _record_initial_states(model: torch.nn.Module, modules: list, layers: list[int]) -> None:
    """Each `PassedIn` module's layer entries of the state argument as the model's own forward makes it for one
    sequence (recorded at the first such module, before any module wrote it; one 1-token forward)."""
    first, seen = modules[0], []
    keyword = OWN_STATE[type(first).__name__].keyword
    signature = inspect.signature(type(first).forward)

    def record(module, args, kwargs):
        if not seen:
            value = signature.bind(module, *args, **kwargs).arguments.get(keyword)
            seen.append([t.clone() for t in value] if value is not None else None)

    hook = first.register_forward_pre_hook(record, with_kwargs=True)
    device = next(model.parameters()).device
    try:
        with forward_lock(model):
            model(input_ids=torch.ones((1, 1), dtype=torch.long, device=device), use_cache=True)
    finally:
        hook.remove()
    if not seen or seen[0] is None:
        raise ValueError(f"model type {model.config.model_type!r}: its forward passed no {keyword!r} to its blocks")
    for module, layer in zip(modules, layers):
        entries = ([t[..., layer] for t in seen[0]], seen[0][0].shape[-1])
        module.__dict__.setdefault(_INITIAL, {})[_key(module)] = entries


def _key(module: torch.nn.Module) -> tuple[str, str]:
    param = next(module.parameters())
    return str(param.dtype), str(param.device)


def _layer_of(name: str) -> int | None:
    """The first integer in a qualified module name (its place in the model's list of layers), None if none."""
    return next((int(part) for part in name.split(".") if part.isdigit()), None)


def _has(module: torch.nn.Module, path: str) -> bool:
    try:
        _get(module, path)
    except AttributeError:
        return False
    return True


def _get(module: torch.nn.Module, path: str):
    for part in path.split("."):
        module = getattr(module, part)
    return module


def _set(module: torch.nn.Module, path: str, value) -> None:
    *parents, last = path.split(".")
    for part in parents:
        module = getattr(module, part)
    setattr(module, last, value)
