"""A Mamba (Mamba-1) mixer's selective scan in fewer passes over memory than transformers' torch reference code:
drop-in replacements for its `mamba_scan_forward` (Mamba, Falcon-Mamba, Jamba: the same function in each modeling
file), made from the function they replace (`original`), which they call for anything they do not cover.

- decode (one token from a stored state, on the engine's `StateView`): transformers' recurrent form writes state-sized
  tensors for dt B, dt B x, the decayed state and their sum, then copies the state back (cloned before and after);
  here `mamba_scan_f32` (cpu/mamba_scan.c) updates the view's state in place and sums the output in the same pass.
- prefill (a fresh sequence's tokens): transformers' Python loop over the tokens (a few tensor operations each)
  becomes one native call, each channel's state (state size floats) kept in registers.
`decode_scan` and `prefill_scan` are separate substitutes, each timed against the module's own forward by
`state_fast`. dt's bias and softplus and silu(z) are computed by torch as transformers computes them; exp(dt A) by
the kernel (a polynomial within 2 ulp of expf: transformers writes it for every token, channel and state index).
Anything else runs transformers' own code: no native build, a model not in fp32, other shapes, every token's state
asked for, a cache other than the engine's view, and a multi-token call after a stored state (transformers'
full-sequence form starts it from zeros; the engine runs such pieces token by token for this family,
`state_continuation`).

Invariant: the state updated in place is the `StateView`'s own (a copy read from the slots, or the slots' storage
for a contiguous range of single-token rows, which the view writes back anyway).
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .. import native
from .state_layers import StateView, on_views

SOURCE = Path(__file__).with_name("cpu") / "mamba_scan.c"
# every rounding as written; no traps assumed, so that the exponential's float -> int steps vectorize
FLAGS = (*native.EXACT_FLAGS, "-fno-trapping-math")


class NativeScan:
    """`mamba_scan_f32` of cpu/mamba_scan.c (fp32, contiguous CPU tensors; callers check)."""

    def __init__(self, path: Path):
        library = ctypes.CDLL(str(path))
        self.scan = library.mamba_scan_f32
        self.scan.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 4
        self.scan.restype = None


@functools.lru_cache(maxsize=1)
def native_scan() -> NativeScan | None:
    """The native scan, built on first use (None without a compiler, or with HF_PAGED_MAMBA_KERNEL=0)."""
    return native.load(SOURCE, "HF_PAGED_MAMBA_KERNEL", NativeScan, FLAGS)[0]


# transformers' `mamba_scan_forward`, its decode step / its prefill native on a `StateView` (see the module doc)
decode_scan = on_views(lambda *args, prefill: _native(*args, prefill=prefill), prefill=False)
prefill_scan = on_views(lambda *args, prefill: _native(*args, prefill=prefill), prefill=True)


def _native(module, hidden_states, time_step, B, C, gate, cache: StateView, prefill: bool) -> torch.Tensor | None:
    """The scan from the view's state (updated in place; a new one for a fresh sequence), as transformers'
    `mamba_scan_forward` computes it; None where the native scan does not apply (see the module doc)."""
    steps = native_scan()
    batch, channels, length = hidden_states.shape
    state = cache.get_recurrent_state(module.layer_idx, state_idx=0)
    if steps is None or (prefill and (state is not None or cache.get_recurrent_states_to_keep(module.layer_idx))):
        return None
    if not prefill and (state is None or length != 1):
        return None
    size = module.ssm_state_size
    A = -torch.exp(module.A_log.float())
    tensors = (hidden_states, time_step, B, C, gate, A)
    if (any(t.dtype != torch.float32 for t in tensors) or A.shape != (channels, size)
            or (state is not None and (state.shape != (batch, channels, size) or state.dtype != torch.float32))):
        return None
    bias = module.dt_proj.bias
    step = time_step if bias is None else time_step + bias.float().to(time_step.dtype)[..., None]
    step = torch.nn.functional.softplus(step).contiguous()  # [B, D, T]
    gates = torch.nn.functional.silu(gate).contiguous()
    x, B, C = hidden_states.contiguous(), B.contiguous(), C.contiguous()
    D = module.D.float().contiguous() if module.D is not None else None
    fresh = state is None
    state = torch.empty((batch, channels, size)) if fresh else state
    A = A.contiguous()
    if not all(t.device.type == "cpu" and t.is_contiguous() for t in (state, x, step, A, B, C, gates)):
        return None
    out = torch.empty_like(x)
    steps.scan(state.data_ptr(), int(fresh), x.data_ptr(), step.data_ptr(), A.data_ptr(), B.data_ptr(),
               C.data_ptr(), None if D is None else D.data_ptr(), gates.data_ptr(), out.data_ptr(), batch, channels,
               length, size)
    cache.update_recurrent_state(state, module.layer_idx)
    return out
