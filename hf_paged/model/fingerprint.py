"""What produced a model's K/V, as a value that changes whenever that does: the engine keys its prefix cache by it.

Caught: parameters and buffers changed in place through the tensor (optimizer steps, `load_state_dict`, `copy_`
under `no_grad`: the version counter), replaced, moved, cast or resized (identity, storage, dtype, device, shape),
PEFT adapters switched, disabled, merged or unmerged (the adapter layers' own state), train / eval mode. Not caught:
writes through `.data` (they bypass the version counter) and changes to code; `LLM.reset_prefix_cache()` covers
those.
"""
from __future__ import annotations

import weakref

import torch

# attributes of PEFT's adapter layers that decide what they compute (read only where a module has them)
ADAPTER_STATE = ("_disable_adapters", "_active_adapter", "merged_adapters", "scaling", "active_adapters")


def _tensor_key(t: torch.Tensor) -> tuple:
    # the id and a weak reference: equal while the tensor lives, never equal to those of a freed tensor (whose id and
    # storage a new tensor may reuse), and no replaced weights are kept alive
    try:
        version = t._version
    except RuntimeError:  # an inference tensor: no version counter (it cannot be changed outside inference mode)
        version = -1
    return id(t), weakref.ref(t), version, t.data_ptr()  # ids first: live references are compared only when equal


def weights_fingerprint(model: torch.nn.Module) -> list:
    """A value equal between two calls exactly when nothing above changed in between (compare with ==). A cast, a
    move or `.data = ...` gives a tensor new storage (its address changes); resizing bumps its version. About 0.35 ms
    for a 22-layer Llama on CPU, once per engine step with prefix caching on."""
    parts: list = [model.training]
    add = parts.append
    for module in model.modules():
        for tensor in module._parameters.values():
            if tensor is not None:
                add(_tensor_key(tensor))
        for tensor in module._buffers.values():
            if tensor is not None:
                add(_tensor_key(tensor))
        state = module.__dict__
        if "_disable_adapters" in state or "_active_adapter" in state or "merged_adapters" in state:
            for name in ADAPTER_STATE:
                if name in state:
                    add((name, repr(state[name])))
    return parts
