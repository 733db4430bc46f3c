"""What produced a model's K/V, as a value that changes whenever that does: the engine keys its prefix cache by it.

Caught: parameters and buffers changed in place through the tensor (optimizer steps, `load_state_dict`, `copy_`
under `no_grad`: the version counter), given new storage (a cast, a move, `.data = ...`: the address), replaced,
added or removed through the module API (`module.weight = ...`, `register_buffer`, a submodule swapped in, PEFT
injecting adapters: torch's registration hooks), PEFT adapters switched, disabled, merged or unmerged (the adapter
layers' own state), a tensor put straight into a module's `_parameters` / `_buffers` (accelerate does), train / eval
mode, and writes through `.data` to the adapter layers' own tensors (PEFT's `hotswap_adapter` copies a new adapter in
that way) that change the first or last 32 entries of any of them (in memory order; compared by value, so copying in
equal values keeps the cache). Not caught: other writes through `.data` (they bypass the version counter: to the
base model's weights, or to an adapter tensor's middle only), in-place changes of inference tensors (no version
counter), tensors added to those dicts directly, changes to code; `LLM.reset_prefix_cache()` covers those.

Cost per call: the model's tensors are listed once per change of any module's registrations (hooks count them), so
a call reads each tensor's version and address and the adapter layers' state: ~10 microseconds for a tiny model.
A model with adapters adds one `torch.cat` of the adapter tensors' ends per device (on a GPU, a copy to the host):
on one CPU thread ~15 us for LoRA r4 on 4 projections of the tiny llama, ~40 us for r16 on q/v of a 0.5B-shaped
qwen2 (96 tensors), ~125 us for r16 on all 7 of its linears (336 tensors). A model without adapters pays nothing.
"""
from __future__ import annotations

import itertools
import weakref

import torch
from torch.nn.modules import module as torch_module

from ..config import logger

# attributes of PEFT's adapter layers that decide what they compute (read only where a module has them)
ADAPTER_STATE = ("_disable_adapters", "_active_adapter", "merged_adapters", "scaling", "active_adapters")
SAMPLED = 32  # entries at each end of each adapter tensor whose values are compared


def _ends(t: torch.Tensor) -> list[torch.Tensor]:
    """Contiguous views of the first and last SAMPLED entries of `t` in memory order (one view where it is short,
    none for a meta or empty tensor). Contiguous: torch.cat copies them at ~0.1 us each, strided views cost ~1 us."""
    if t.device.type == "meta" or t.numel() == 0:
        return []
    t = t.detach()
    if not t.is_contiguous():  # a permuted dense tensor (a transposed weight) is contiguous in stride order
        t = t.permute(sorted(range(t.dim()), key=lambda d: -t.stride(d)))
        if not t.is_contiguous():
            t = t[(0,) * (t.dim() - 1)]  # anything else: one line of it
    flat = t.view(-1) if t.is_contiguous() else t
    return [flat] if flat.numel() <= 2 * SAMPLED else [flat[:SAMPLED], flat[-SAMPLED:]]


class _AdapterSample:
    """The values of the first and last entries of the adapter layers' own tensors (PEFT's `adapter_layer_names`:
    lora_A / lora_B / lora_embedding_A / lora_embedding_B / DoRA's magnitudes, IA3's vectors...), read with one
    `torch.cat` per device of views made once per storage: writes through `.data` (PEFT's `hotswap_adapter`) leave
    version counters and addresses as they were, so the values themselves are compared."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors, self.addresses, self.views = tensors, None, {}

    def read(self) -> tuple:
        addresses = [t.data_ptr() for t in self.tensors]
        if addresses != self.addresses:  # new storage (`.data = ...`, a cast, a move): the old views read the old
            self.views = {}
            for t in self.tensors:
                for view in _ends(t):
                    self.views.setdefault(view.device, []).append(view)
            self.addresses = addresses
        # bytes: equal exactly when the values are (NaN included)
        return tuple(torch.cat(views).cpu().view(torch.uint8).numpy().tobytes() for views in self.views.values())


class _Registrations:
    """Counts registrations of parameters, buffers and submodules on the modules of the models listed so far (torch's
    global hooks, installed on first use, removed by `uninstall`; registrations on other modules, e.g. the ModuleList
    a forward slices off its layers, are not counted)."""

    count = 0
    handles: list = []
    # id -> weak reference of the listed models' modules (not a WeakSet: a module class may define __eq__ without
    # __hash__, and the hooks see every module of the process)
    watched: dict[int, weakref.ref] = {}

    @classmethod
    def watch(cls, module: torch.nn.Module) -> None:
        key = id(module)
        ref = cls.watched.get(key)
        if ref is None or ref() is not module:
            cls.watched[key] = weakref.ref(module, lambda dead, key=key: cls._forget(key, dead))

    @classmethod
    def _forget(cls, key: int, dead: weakref.ref) -> None:
        if cls.watched.get(key) is dead:
            del cls.watched[key]

    @classmethod
    def install(cls) -> None:
        if cls.handles:
            return
        cls.handles = [register(cls._bump) for register in (
            torch_module.register_module_parameter_registration_hook,
            torch_module.register_module_buffer_registration_hook,
            torch_module.register_module_module_registration_hook)]

    @classmethod
    def _bump(cls, module, name, value):
        ref = cls.watched.get(id(module))
        if ref is not None and ref() is module:
            cls.count += 1  # returns None: the registered object is kept as given

    @classmethod
    def uninstall(cls) -> None:
        for handle in cls.handles:
            handle.remove()
        cls.handles = []
        cls.count += 1  # whatever was listed while they were off may be stale


_listed: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _layout(model: torch.nn.Module) -> tuple:
    """(registration count, the model's tensors, its adapter layers, their identity, where each is registered, the
    adapter tensors' sample or None), listed again after any registration on any module."""
    found = _listed.get(model)
    if found is not None and found[0] == _Registrations.count and all(
            where.get(name) is t for (where, name), t in zip(found[4], found[1])):  # also edits of the private dicts
        return found
    tensors, adapters, slots, adapter_tensors = [], [], [], {}
    for module in model.modules():
        _Registrations.watch(module)
        for where in (module._parameters, module._buffers):
            for name, t in where.items():
                if t is not None:
                    tensors.append(t)
                    slots.append((where, name))
        state = module.__dict__
        if "_disable_adapters" in state or "_active_adapter" in state or "merged_adapters" in state:
            adapters.append(weakref.ref(module))  # weak: the model itself may be one (the cache must not keep it)
            for name in getattr(module, "adapter_layer_names", ()):
                held = getattr(module, name, None)
                if isinstance(held, torch.nn.Module):
                    for t in (*held.parameters(), *held.buffers()):
                        adapter_tensors[id(t)] = t
    identity = _serials(found, tensors)
    if found is None and any(t.is_inference() for t in tensors):
        logger.warning("hf_paged: some of this model's weights are inference tensors (made under "
                       "torch.inference_mode()): in-place changes to them are invisible to the prefix cache; call "
                       "LLM.reset_prefix_cache() after changing them")
    sample = _AdapterSample(list(adapter_tensors.values())) if adapter_tensors else None
    found = (_Registrations.count, tensors, adapters, identity, slots, sample)
    _listed[model] = found
    return found


def _serials(found: tuple | None, tensors: list[torch.Tensor]) -> tuple[int, ...]:
    """Which tensors: a number per tensor object, kept from the previous listing where the same object is listed
    again (an unrelated registration lists an equal identity), new for any other (never equal to a replaced tensor's,
    though a new tensor may reuse a freed one's id and storage: the previous listing holds the old ones until this one
    is made, so their ids cannot be reused meanwhile). Plain numbers, no weak references: `torch.utils.swap_tensors`
    (`model.to(...)` with `torch.__future__.set_swap_module_params_on_conversion(True)`) refuses weakly referenced
    tensors."""
    before = {id(t): (t, serial) for t, serial in zip(found[1], found[3])} if found is not None else {}
    serials = []
    for t in tensors:
        kept = before.get(id(t))
        serials.append(kept[1] if kept is not None and kept[0] is t else next(_SERIAL))
    return tuple(serials)


_SERIAL = itertools.count()


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor: no version counter (it cannot be changed outside inference mode)
        return -1


def weights_fingerprint(model: torch.nn.Module) -> tuple:
    """A value equal between two calls exactly when nothing above changed in between (compare with ==)."""
    _Registrations.install()
    count, tensors, adapters, identity, _, sample = _layout(model)
    try:
        versions = [(t._version, t.data_ptr()) for t in tensors]
    except RuntimeError:
        versions = [(_version(t), t.data_ptr()) for t in tensors]
    states = [(name, repr(state[name])) for state in (ref().__dict__ for ref in adapters if ref() is not None)
              for name in ADAPTER_STATE if name in state]
    return model.training, identity, versions, states, (sample.read() if sample is not None else ())


_BASES: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def adapter_bases(model: torch.nn.Module) -> frozenset:
    """ids of the modules that adapter layers wrap (PEFT's `base_layer`): PEFT writes their weights through `.data`,
    also in the middle of a forward (a merged layer whose adapters are disabled unmerges when it is called), so no
    copy of those weights can be trusted during a forward (`packed_linear`). Listed again after any registration."""
    layout = _layout(model)
    cached = _BASES.get(model)
    if cached is not None and cached[0] is layout:
        return cached[1]
    bases = frozenset(id(base) for ref in layout[2] if (layer := ref()) is not None
                      and isinstance(base := layer.__dict__.get("_modules", {}).get("base_layer"), torch.nn.Module))
    _BASES[model] = (layout, bases)
    return bases


def uninstall() -> None:
    """Remove the registration hooks (hf_paged.disable())."""
    _Registrations.uninstall()
