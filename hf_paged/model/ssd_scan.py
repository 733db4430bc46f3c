"""A Mamba-2 mixer's selective scan (state space duality) in fewer passes over memory than transformers' torch
reference code: a drop-in replacement for its `mamba2_scan_forward` (Mamba-2, Nemotron-H, Falcon-H1, Bamba,
Granite-4 hybrids, Zamba2: the same function in each modeling file), made from the function it replaces
(`original`), which it calls for anything it does not cover.

- decode (one token from a stored state, on the engine's `StateView`): transformers' recurrent form writes about a
  dozen state-sized tensors per layer and step (exp(dt A) broadcast to the state's shape, dt B x, the decayed state,
  their sum, clones before and after); here `ssd_scan_f32` (cpu/ssd_scan.c) updates the view's state in place and
  sums the output in the same pass.
- prefill (several tokens, fresh or continuing a stored state; `decode_scan` and `prefill_scan` are separate
  substitutes, each timed against transformers' own by `state_fast`): transformers' chunked form (blocks of chunk
  size tokens, products within and across blocks) becomes the same scan token by token, a head's state kept in the
  core's cache.
dt's bias, softplus (and for a prefill the clamp to the module's `time_step_limit`) and exp(dt A) are computed by
torch on [batch, tokens, heads], as transformers computes them (its broadcasts repeat each value over the head dim
and state). A bf16 model's inputs are widened to fp32: its prefill then computes what transformers' chunked form
computes (in fp32, an fp32 output), its decode rounds to bf16 where transformers' recurrent form does (dt B, dt B x,
the state read for the output, the output; the state itself stays fp32). Anything else (no native build, fp16 or a
state not in fp32, other shapes, every token's state asked for, a cache other than the engine's view) runs
transformers' own code.

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

SOURCE = Path(__file__).with_name("cpu") / "ssd_scan.c"


class NativeScan:
    """`ssd_scan_f32` of cpu/ssd_scan.c (fp32, contiguous CPU tensors; callers check)."""

    def __init__(self, path: Path):
        library = ctypes.CDLL(str(path))
        self.scan = library.ssd_scan_f32
        self.scan.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 7
        self.scan.restype = None


@functools.lru_cache(maxsize=1)
def native_scan() -> NativeScan | None:
    """The native scan, built on first use (None without a compiler, or with HF_PAGED_SSD_KERNEL=0)."""
    return native.load(SOURCE, "HF_PAGED_SSD_KERNEL", NativeScan, native.EXACT_FLAGS)[0]


def _ready(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


# transformers' `mamba2_scan_forward`, its decode step / its prefill native on a `StateView` (see the module doc)
decode_scan = on_views(lambda *args, prefill: _native(*args, prefill=prefill), prefill=False)
prefill_scan = on_views(lambda *args, prefill: _native(*args, prefill=prefill), prefill=True)


def _native(module, hidden_states, B, C, dt, cache: StateView, prefill: bool) -> torch.Tensor | None:
    """The scan from the view's state (updated in place; a new one for a fresh sequence), as transformers'
    `mamba2_scan_forward` computes it; None where the native scan does not apply (see the module doc)."""
    steps = native_scan()
    batch, length = hidden_states.shape[:2]
    state = cache.get_recurrent_state(module.layer_idx, state_idx=0)
    recurrent = state is not None and length == 1  # transformers' recurrent form, else its chunked one
    if steps is None or recurrent == prefill or (prefill and cache.get_recurrent_states_to_keep(module.layer_idx)):
        return None
    heads, head_dim, groups, size = module.num_heads, module.head_dim, module.n_groups, module.ssm_state_size
    shape, dtype = (batch, heads, head_dim, size), hidden_states.dtype
    half = dtype == torch.bfloat16 and not prefill  # transformers' recurrent form rounds to bf16 on the way
    if (heads % groups or dtype not in (torch.float32, torch.bfloat16) or {B.dtype, C.dtype, dt.dtype} != {dtype}
            or (state is not None and (state.shape != shape or state.dtype != torch.float32))
            or (half and module.D is not None and module.D.dtype != dtype)):
        return None
    step = torch.nn.functional.softplus(dt + module.dt_bias.to(dt.dtype))  # [B, T, H], in the model's dtype
    if prefill:
        limit = getattr(module, "time_step_limit", None)
        if limit is None:
            return None
        step = torch.clamp(step, min=limit[0], max=limit[1])
    decay = torch.exp(step.float() * -torch.exp(module.A_log.float()))
    x = hidden_states.reshape(batch, length, heads, head_dim).float().contiguous()
    B, C = (t.reshape(batch, length, groups, size).float().contiguous() for t in (B, C))
    step = step.float().contiguous()
    D = module.D.float().contiguous() if module.D is not None else None
    fresh = state is None
    state = torch.empty(shape) if fresh else state
    if not _ready(state, x, step, decay, B, C, *([] if D is None else [D])):
        return None
    out = torch.empty_like(x)
    steps.scan(state.data_ptr(), int(fresh), x.data_ptr(), step.data_ptr(), decay.data_ptr(), B.data_ptr(),
               C.data_ptr(), None if D is None else D.data_ptr(), out.data_ptr(), batch, length, heads, head_dim,
               groups, size, int(half))
    cache.update_recurrent_state(state, module.layer_idx)
    # (the chunked form returns fp32 whatever the model's dtype, the recurrent one the model's)
    return out.view(batch, length, -1).to(torch.float32 if prefill else dtype)
