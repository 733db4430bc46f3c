"""What hf_paged switches on a model for one forward is switched for the running thread only.

An engine's forward needs the model's attention implementation to read "paged" (or another of hf_paged's), some
modules' forwards replaced (`paged_forward.ModulePatches`) and few-row linear forwards (`small_linear`). The model is
a shared object: another thread may run its own plain forward of it, `save_pretrained` it or copy it meanwhile. So:

- no config is ever written: `config._attn_implementation` (a property of transformers' `PreTrainedConfig`) is wrapped
  once by `hf_paged.enable()` (integrations/patch.py, through `set_installer`) to answer first from this thread's
  table {id(config): (config, name)}, which `switched_attention` fills for the duration of one forward;
- instance-level forwards that hf_paged puts on modules run their replacement only in the thread that put them
  there (`ThreadForward`; the small linears check `THIS_THREAD.linears`), and the module's own forward elsewhere.

After `hf_paged.disable()` (no installer) every switch raises `HfPagedDisabled`, which says how to re-enable.
"""
from __future__ import annotations

import copy
import threading
from contextlib import contextmanager

DISABLED_MESSAGE = ("hf_paged is disabled (hf_paged.disable() was called), so its engine cannot run a forward; "
                    "call hf_paged.enable() to re-enable it")


class HfPagedDisabled(RuntimeError):
    """An engine (or anything else that runs hf_paged's attention) was used after `hf_paged.disable()`."""

    def __init__(self, message: str = DISABLED_MESSAGE):
        super().__init__(message)


class _ThisThread(threading.local):
    def __init__(self):
        self.attention: dict = {}  # id(config) -> (config, attention implementation name) while switched
        self.linears: set = set()  # ids of linear modules whose few-row forward is on
        self.experts = False  # whether a mixture's grouped products take their measured path (expert_products)
        self.fused: set = set()  # ids of modules whose fused forward is on (fused_norms, fused_rotary)
        self.fused_layers: dict = {}  # id(decoder layer) -> (parts, projections) while its fused forward is on
        self.greedy = None  # the greedy_head.GreedyStep of the forward this thread runs, while one asks for picks
        self.no_copies: frozenset = frozenset()  # ids of modules whose weights may change mid-forward (no copies)


THIS_THREAD = _ThisThread()
_installer = None  # set by `hf_paged.enable()`: makes a config class's getter consult THIS_THREAD; None: disabled
_generation = 0  # counts set_installer calls: a forward that overlapped a disable() is refused
_ready: set = set()  # config classes whose `_attn_implementation` getter consults THIS_THREAD
_LOCK = threading.Lock()


def set_installer(installer) -> None:
    """`installer(config_class)` makes that class's `_attn_implementation` getter one of `thread_local_getter`'s (it
    is called once per class, before the first switch of one of its configs); None: hf_paged is disabled."""
    global _installer, _generation
    with _LOCK:
        _installer = installer
        _generation += 1
        _ready.clear()


def is_enabled() -> bool:
    return _installer is not None


def require_enabled() -> None:
    if _installer is None:
        raise HfPagedDisabled()


def thread_local_getter(original):
    """A `_attn_implementation` getter: this thread's switch for the config if any, else `original(config)`."""
    def _attn_implementation(self):
        switched = THIS_THREAD.attention
        if switched:
            entry = switched.get(id(self))
            if entry is not None and entry[0] is self:
                return entry[1]
        return original(self)

    _attn_implementation.hf_paged_original = original
    _attn_implementation.__doc__ = original.__doc__
    return _attn_implementation


def is_thread_local(getter) -> bool:
    return hasattr(getter, "hf_paged_original")


def _make_ready(config_class: type) -> None:
    if config_class in _ready:
        return
    with _LOCK:
        if _installer is None:
            raise HfPagedDisabled()
        _installer(config_class)
        _ready.add(config_class)


@contextmanager
def switched_attention(configs: list, name: str):
    """Inside, in this thread only, each config's `_attn_implementation` reads `name`; other threads (and copies,
    saves) see the config exactly as it is: nothing is written to it. Raises HfPagedDisabled when disabled, also
    on leaving when `hf_paged.disable()` ran meanwhile (that forward may have met transformers' own attention)."""
    generation = _generation
    require_enabled()
    for config in configs:
        _make_ready(type(config))
    table = THIS_THREAD.attention
    saved = [(config, table.get(id(config))) for config in configs]
    for config in configs:
        table[id(config)] = (config, name)
    try:
        yield
        if generation != _generation:
            raise HfPagedDisabled()
    finally:
        for config, before in reversed(saved):
            if before is None:
                table.pop(id(config), None)
            else:
                table[id(config)] = before


class ThreadForward:
    """An instance-level forward put on `module` for one forward: in the thread that put it there it runs
    `replacement`; in any other thread the module's own forward (`previous`, the instance forward it had, else its
    class's). A deep copy (a model copied in the middle of that forward) always runs the copy's own forward."""

    __slots__ = ("module", "replacement", "previous", "thread")

    def __init__(self, module, replacement, previous=None):
        self.module, self.replacement, self.previous = module, replacement, previous
        self.thread = threading.get_ident()

    def __call__(self, *args, **kwargs):
        if self.replacement is not None and threading.get_ident() == self.thread:
            return self.replacement(*args, **kwargs)
        own = self.previous if self.previous is not None else type(self.module).forward.__get__(self.module)
        return own(*args, **kwargs)

    def __deepcopy__(self, memo):
        return ThreadForward(copy.deepcopy(self.module, memo), None, copy.deepcopy(self.previous, memo))


def drop_thread_forwards(model) -> int:
    """Put back the module's own forward where a copied model carries a `ThreadForward`; returns how many."""
    dropped = 0
    for module in model.modules():
        forward = vars(module).get("forward")
        if isinstance(forward, ThreadForward):
            del module.forward
            if forward.previous is not None:
                module.forward = forward.previous
            dropped += 1
    return dropped
