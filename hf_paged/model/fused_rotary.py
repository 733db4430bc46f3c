"""Rotary position embeddings of the Llama family in one native pass (`cpu/rotary.c`) during the engine's CPU forwards.

transformers' apply_rotary_pos_emb (Llama's, and every model's copy with the same code: Mistral, Qwen2, Qwen3, ...)
runs six tensor operations for each of q and k in every attention layer. transformers (through the `kernels`
package it depends on) gives each attention module of those models a private wrapper of that function, which
`kernels.kernelize` may give another forward; the engine gives it the native pass for one forward, the way
`fused_norms` swaps RMSNorm forwards: only in the thread running the engine's forward (`switches.THIS_THREAD.fused`),
only where the wrapped function has exactly Llama's code (bytecode, constants, names; and `rotate_half` too) and the
wrapper carries no forward of its own. Each call re-checks its inputs (CPU, q / k [B, H, T, D] and cos / sin
[B or 1, T, D] of one dtype, fp32 or bf16, last dims contiguous, `unsqueeze_dim` 1, no autograd); anything else goes
to the function itself. The pass rounds every product and sum as torch does, so its output is transformers' bit for
bit; before a (dtype, head dim) is used it is checked on random values and timed against the function on a decode
step's shape (`verified`). `HF_PAGED_FUSED_ROTARY=0`: never built nor used; `=force`: used wherever it matches,
untimed (tests).
"""
from __future__ import annotations

import ctypes
import functools
import os
import types
from pathlib import Path

import torch

from .. import native
from .fused_norms import _same_code, _seconds, swapped_forwards
from .switches import THIS_THREAD

SOURCE = Path(__file__).with_name("cpu") / "rotary.c"
DTYPES = (torch.float32, torch.bfloat16)
_status: dict[str, str] = {}


class RotaryKernel:
    """`rotary_f32` / `rotary_bf16` of cpu/rotary.c."""

    def __init__(self, path: Path):
        library = ctypes.CDLL(str(path))
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self.fns = {torch.float32: library.rotary_f32, torch.bfloat16: library.rotary_bf16}
        for fn in self.fns.values():
            fn.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64, i64, ptr, i64, i64, i64, i64, i64, i64, i64]
            fn.restype = None

    @torch.compiler.disable  # native code through raw pointers: never traced
    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, H, T, D], cos / sin [B or 1, T, D] with equal strides, one dtype, last dims contiguous -> [B, H, T, D]
        laid out as x is (`empty_like`)."""
        batch, heads, tokens, dim = x.shape
        out = torch.empty_like(x)
        self.fns[x.dtype](x.data_ptr(), x.stride(0), x.stride(1), x.stride(2), cos.data_ptr(), sin.data_ptr(),
                          0 if cos.shape[0] == 1 else cos.stride(0), cos.stride(1), out.data_ptr(), out.stride(0),
                          out.stride(1), out.stride(2), batch, heads, tokens, dim)
        return out


@functools.lru_cache(maxsize=1)
def load_rotary() -> RotaryKernel | None:
    kernel, _status["reason"] = native.load(SOURCE, "HF_PAGED_FUSED_ROTARY", RotaryKernel, native.EXACT_FLAGS)
    return kernel


def fused_rotary_status() -> str:
    """Why the fused rotary embedding is or is not in use."""
    load_rotary()
    return _status.get("reason", "not tried")


def wrapped_function(wrapper) -> types.FunctionType | None:
    """The function a `kernels` function wrapper calls when nothing replaced it (its class's closure), or None."""
    forward = getattr(type(wrapper), "forward", None)
    code = getattr(forward, "__code__", None)
    if code is None or "func" not in code.co_freevars or forward.__closure__ is None:
        return None
    function = forward.__closure__[code.co_freevars.index("func")].cell_contents
    return function if isinstance(function, types.FunctionType) else None


@functools.lru_cache(maxsize=1)
def _reference():
    from transformers.models.llama import modeling_llama

    return wrapped_function(modeling_llama.apply_rotary_pos_emb) or modeling_llama.apply_rotary_pos_emb


def is_llama_rotary(wrapper) -> bool:
    """Whether `wrapper` (an attention module's private `apply_rotary_pos_emb`) runs Llama's code, rotate_half too."""
    function, reference = wrapped_function(wrapper), _reference()
    if function is None or not isinstance(reference, types.FunctionType):
        return False
    rotate, reference_rotate = (f.__globals__.get("rotate_half") for f in (function, reference))
    return (_same_code(function.__code__, reference.__code__) and isinstance(rotate, types.FunctionType)
            and isinstance(reference_rotate, types.FunctionType)
            and _same_code(rotate.__code__, reference_rotate.__code__))


def _takes(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    return (q.device.type == "cpu" and q.dim() == 4 and q.dtype in DTYPES and q.stride(-1) == 1
            and q.shape[-1] % 2 == 0 and cos.dim() == 3 and cos.dtype == q.dtype == sin.dtype
            and cos.shape == sin.shape and cos.stride() == sin.stride() and cos.device.type == "cpu"
            and cos.stride(-1) == 1 and cos.shape[0] in (1, q.shape[0])
            and tuple(cos.shape[1:]) == (q.shape[2], q.shape[3]))


@functools.lru_cache(maxsize=None)
def verified(dtype: torch.dtype, dim: int, threads: int) -> bool:
    """Whether the pass gives Llama's function bit for bit on random q, k, cos, sin of head dim `dim` (a prefill's
    shape and a decode's), and is faster on a decode step's shape (64 sequences, 8 / 2 heads; best of 5 calls each,
    taking turns; untimed with HF_PAGED_FUSED_ROTARY=force). Once per process per (dtype, dim, torch threads)."""
    kernel, reference = load_rotary(), _reference()
    if kernel is None or not isinstance(reference, types.FunctionType):
        return False
    generator = torch.Generator().manual_seed(dim)

    def case(tokens: int, batch: int):
        q = torch.randn(batch, tokens, 8, dim, generator=generator).to(dtype).transpose(1, 2)  # as the models make it
        k = torch.randn(batch, tokens, 2, dim, generator=generator).to(dtype).transpose(1, 2)
        angles = torch.rand(1, tokens, dim, generator=generator) * 100
        return q, k, angles.cos().to(dtype), angles.sin().to(dtype)

    with torch.inference_mode():
        for q, k, cos, sin in (case(37, 1), case(1, 5)):
            if not all(torch.equal(kernel(x, cos, sin), want) for x, want in zip((q, k), reference(q, k, cos, sin))):
                return False
        if os.environ.get("HF_PAGED_FUSED_ROTARY", "1").strip().lower() == "force":
            return True
        q, k, cos, sin = case(1, 64)
        cos, sin = cos.expand(64, -1, -1), sin.expand(64, -1, -1)
        ours, theirs = [], []
        for _ in range(5):
            ours.append(_seconds(lambda: (kernel(q, cos, sin), kernel(k, cos, sin))))
            theirs.append(_seconds(lambda: reference(q, k, cos, sin)))
    return min(ours) < min(theirs)


def fused_rotary_forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         unsqueeze_dim: int = 1):
    """The swapped-in forward of an attention module's rotary wrapper: the native pass where it applies, else the
    wrapped function."""
    if (id(self) not in THIS_THREAD.fused or unsqueeze_dim != 1 or not _takes(q, cos, sin) or not _takes(k, cos, sin)
            or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or cos.requires_grad))
            or not verified(q.dtype, q.shape[-1], torch.get_num_threads())):
        return wrapped_function(self)(q, k, cos, sin, unsqueeze_dim)
    kernel = load_rotary()
    return kernel(q, cos, sin), kernel(k, cos, sin)


class FusedRotary:
    """The private rotary wrappers of the model's attention modules that run Llama's code, found once; `active()` is
    a context for one forward."""

    def __init__(self, model: torch.nn.Module):
        wrappers = []
        if load_rotary() is not None:
            for module in model.modules():
                functions = vars(module).get("_kernel_funcs")
                wrapper = next((w for w in functions.values() if is_llama_rotary(w)), None) \
                    if isinstance(functions, dict) else None
                if wrapper is None:
                    continue
                # checked now where the module says its head dim and dtype (not mid-step); others on first call
                dim = getattr(module, "head_dim", None)
                weight = next(module.parameters(), None)
                if isinstance(dim, int) and weight is not None and weight.dtype in DTYPES \
                        and not verified(weight.dtype, dim, torch.get_num_threads()):
                    continue
                wrappers.append(wrapper)
        self.modules = wrappers
        self.forwards = [types.MethodType(fused_rotary_forward, w) for w in wrappers]
        self.ids = frozenset(id(w) for w in wrappers)

    def active(self):
        """Swap the forwards in for one forward pass of this thread (`fused_norms.swapped_forwards`)."""
        return swapped_forwards(self.modules, self.forwards, self.ids)
