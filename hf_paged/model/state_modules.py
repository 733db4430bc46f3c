"""Which modules hold the state layers' states (`find_state_modules`), and the cache the model's own forward keeps
its states on (`own_cache`).

A layer may hold several states, told apart by the `state_idx` of transformers' cache calls (inkling: four short
convolutions per layer, two of them inside its attention module, each keeping conv state `conv_idx` of its layer).
Each state of a layer is used by exactly one module, and one module may use several states of its layer (a Gated
DeltaNet's conv and recurrent state): the engine runs every such module on its own (`state_layers.state_forward`),
and what it stores lands under (layer, kind, state index) in `kv.StateSlots`.

Both come from the model's own forward on a cache of transformers: its `DynamicCache`, or, for a model whose forward
rejects it and insists on a cache class of its own (minimax: `MiniMaxCache`, whose `get_linear_cache` /
`set_linear_cache` hold each lightning-attention layer's recurrent K^T V state), the `Cache` subclass defined in the
model's own modeling module. Which of them the model runs on is found once and kept on the model.
"""
from __future__ import annotations

import inspect
import sys
import threading

import torch

from .forward_lock import forward_lock
from .state_layers import STATE_CALLS, UnsupportedState, cache_keyword

_MODULES = "_hf_paged_state_modules"  # kept on the model: {module name: layer}
_CACHE_CLASS = "_hf_paged_cache_class"  # kept on the model: the Cache subclass of its own it runs on (None: none)


def own_cache(model: torch.nn.Module):
    """A new, empty cache of the kind the model's forward keeps its states on: transformers' `DynamicCache`, or the
    model's own cache class (`own_cache_class`)."""
    cls = own_cache_class(model)
    if cls is None:
        from transformers.cache_utils import DynamicCache

        return DynamicCache(config=model.config)
    return _new(cls, model)


def own_cache_class(model: torch.nn.Module) -> type | None:
    """The cache class of its own that the model's forward insists on for its state layers (minimax: MiniMaxCache),
    or None (transformers' DynamicCache serves it, or it has no state layers)."""
    find_state_modules(model)
    return model.__dict__.get(_CACHE_CLASS)


@torch.inference_mode()
def find_state_modules(model: torch.nn.Module) -> dict[str, int]:
    """{qualified name of a module that reads and writes state of a layer: that layer}, in module order, from one
    3-token forward on transformers' own cache (or, when the model rejects it, on the model's own cache class): a
    state call (`STATE_CALLS`) names the innermost running module whose `layer_idx` is the layer the call is for.
    {} for models whose cache has no state layer. Kept on the model.

    Invariants of the answer: every state (layer, state index) that a call named is used by one module, and no
    module listed runs inside another (each runs on its own, per group of sequences). Raises UnsupportedState when
    a layer's calls come from no such module, when two modules use one state, or when one runs inside another; the
    forward's own error when it runs on none of the caches."""
    known = model.__dict__.get(_MODULES)
    if known is not None:
        return known
    from transformers.cache_utils import DynamicCache, LinearAttentionCacheLayerMixin

    model_type = getattr(model.config, "model_type", type(model).__name__)
    cache, chosen = DynamicCache(config=model.config), None
    if not any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in cache.layers):
        model.__dict__[_MODULES] = {}
        return {}
    try:
        found, strays = _recorded(model, cache)
    except Exception:
        for cls in _own_cache_classes(model):  # a model that insists on a cache class of its own
            try:
                found, strays = _recorded(model, _new(cls, model))
            except Exception:  # noqa: BLE001 - not this one: the error on transformers' cache is the one to report
                continue
            chosen = cls
            break
        else:
            raise
    if strays:
        raise UnsupportedState(f"model type {model_type!r}: state calls for layers {sorted(set(strays))} come from "
                               f"no module of that layer")
    result = _checked(model, found, model_type)
    model.__dict__[_CACHE_CLASS] = chosen
    model.__dict__[_MODULES] = result
    return result


def _checked(model: torch.nn.Module, found: dict[str, tuple], model_type: str) -> dict[str, int]:
    """{module name: layer} in module order from `found` ({module name: (layer, the state indices it named)}), after
    the invariants of `find_state_modules` hold."""
    users: dict[tuple, list[str]] = {}
    for name, (layer, indices) in found.items():
        for index in indices:
            users.setdefault((layer, index), []).append(name)
    shared = {f"layer {layer} state {index}": sorted(names) for (layer, index), names in sorted(users.items())
              if len(names) > 1}
    if shared:
        raise UnsupportedState(f"model type {model_type!r}: several modules use one state of a layer: {shared}")
    nested = sorted((inner, outer) for inner in found for outer in found if inner.startswith(outer + "."))
    if nested:
        raise UnsupportedState(f"model type {model_type!r}: state module {nested[0][0]!r} runs inside state module "
                               f"{nested[0][1]!r}; hf_paged runs each state module on its own")
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return {name: found[name][0] for name in sorted(found, key=order.__getitem__)}


def _own_cache_classes(model: torch.nn.Module) -> list[type]:
    """The `Cache` subclasses defined in the modules that define the model's class and its bases (transformers'
    modeling module of the family: minimax's MiniMaxCache), nearest first."""
    from transformers.cache_utils import Cache

    found: list[type] = []
    for base in type(model).__mro__:
        module = sys.modules.get(base.__module__)
        for value in vars(module).values() if module is not None else ():
            if (isinstance(value, type) and issubclass(value, Cache) and value.__module__ == base.__module__
                    and value not in found):
                found.append(value)
    return found


def _new(cls: type, model: torch.nn.Module):
    """An instance of the cache class `cls`, given the model's config where it takes one."""
    return cls(config=model.config) if "config" in inspect.signature(cls).parameters else cls()


def _state_of(method, args: tuple, kwargs: dict) -> tuple[int | None, int | None]:
    """(the layer a state call is for: its `layer_idx` argument, the state index it names: its `state_idx` argument,
    0 for a call that takes none: minimax's linear cache); None for what the call does not name (has_previous_state
    without a state index asks about the layer, and names none of its states)."""
    try:
        bound = inspect.signature(method).bind(*args, **kwargs)
    except TypeError:
        return None, None
    bound.apply_defaults()
    return bound.arguments.get("layer_idx"), bound.arguments.get("state_idx", 0)


def _recorded(model: torch.nn.Module, cache) -> tuple[dict[str, tuple], list[int]]:
    """({name of a module that made state calls: (their layer, the state indices they named)}, layers whose calls
    came from no module of that layer) in one 3-token forward of the model on `cache`."""
    thread, stack, found, strays = threading.get_ident(), [], {}, []
    names = {module: name for name, module in model.named_modules()}

    def record(method):
        def call(*args, **kwargs):
            layer, index = _state_of(method, args, kwargs)
            if layer is not None and threading.get_ident() == thread:
                owner = next((m for m in reversed(stack) if getattr(m, "layer_idx", None) == layer), None)
                if owner is None:
                    strays.append(layer)
                else:
                    _, indices = found.setdefault(names[owner], (layer, set()))
                    if index is not None:
                        indices.add(index)
            return method(*args, **kwargs)
        return call

    for name in STATE_CALLS:
        if hasattr(cache, name):
            setattr(cache, name, record(getattr(cache, name)))

    def enter(module, *_) -> None:
        if threading.get_ident() == thread:
            stack.append(module)

    def leave(module, *_) -> None:
        if threading.get_ident() == thread and stack:
            stack.pop()

    hooks = []
    for module in names:
        if isinstance(getattr(module, "layer_idx", None), int):
            hooks.append(module.register_forward_pre_hook(enter))
            hooks.append(module.register_forward_hook(leave, always_call=True))
    device = next(model.parameters()).device
    try:
        with forward_lock(model):
            model(input_ids=torch.tensor([[1, 2, 3]], device=device), use_cache=True,
                  **{cache_keyword(model.forward): cache})
    finally:
        for hook in hooks:
            hook.remove()
    return found, strays
