"""Which module holds each state layer's state (`find_state_modules`), and the cache the model's own forward keeps
its states on (`own_cache`).

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

_MODULES = "_hf_paged_state_modules"  # kept on the model: {layer: module name}
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
def find_state_modules(model: torch.nn.Module) -> dict[int, str]:
    """{layer index: qualified name of the module that reads and writes that layer's state}, from one 3-token forward
    on transformers' own cache (or, when the model rejects it, on the model's own cache class): a state call
    (`STATE_CALLS`) names the innermost running module whose `layer_idx` is the layer the call is for. {} for models
    whose cache has no state layer. Kept on the model. Raises UnsupportedState when a state layer's calls come from no
    such module, or from several; the forward's own error when it runs on none of the caches."""
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
    several = {layer: sorted(n) for layer, n in found.items() if len(n) > 1}
    if several:
        raise UnsupportedState(f"model type {model_type!r}: several modules use the state of one layer: {several}")
    result = {layer: next(iter(n)) for layer, n in sorted(found.items())}
    model.__dict__[_CACHE_CLASS] = chosen
    model.__dict__[_MODULES] = result
    return result


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


def _layer_of(method, args: tuple, kwargs: dict) -> int | None:
    """The layer a state call is for (its `layer_idx` argument), None when it names none."""
    try:
        return inspect.signature(method).bind(*args, **kwargs).arguments.get("layer_idx")
    except TypeError:
        return None


def _recorded(model: torch.nn.Module, cache) -> tuple[dict[int, set], list[int]]:
    """({layer: names of the modules that made its state calls}, layers whose calls came from no module of that
    layer) in one 3-token forward of the model on `cache`."""
    thread, stack, found, strays = threading.get_ident(), [], {}, []
    names = {module: name for name, module in model.named_modules()}

    def record(method):
        def call(*args, **kwargs):
            layer = _layer_of(method, args, kwargs)
            if layer is not None and threading.get_ident() == thread:
                owner = next((m for m in reversed(stack) if getattr(m, "layer_idx", None) == layer), None)
                if owner is None:
                    strays.append(layer)
                else:
                    found.setdefault(layer, set()).add(names[owner])
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
