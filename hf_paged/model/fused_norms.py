"""RMSNorm layers of the Llama and the Gemma families in one native pass (`cpu/rms_norm.c`) during the engine's CPU
forwards.

transformers' LlamaRMSNorm (and every class whose forward is the same code: Mistral, Qwen2, Qwen3 and their q / k
norms, ...) runs six tensor operations, GemmaRMSNorm (Gemma 2's and 3's are the same code: the row normalized in
fp32, scaled by 1 + weight, then cast once; four norms a layer, and q / k norms in Gemma 3) ten; in a decode step
they work on [rows, hidden] tensors of a few dozen rows, where each operation's dispatch costs more than its
arithmetic, and with two threads each is below ATen's grain for a second thread. The native pass reads each row
twice (squares, then output) and computes the same formula with the same roundings; only the order of the squares'
sum differs from torch's mean (the kernel's header), as any other kernel choice does.

Which modules: those of a class whose `forward` has exactly the code of transformers' LlamaRMSNorm.forward
(bytecode, constants, names), a 1-d `weight` and a float `variance_epsilon`, or GemmaRMSNorm's `forward` and `_norm`
and a float `eps` (`norm_kind`), that carry no forward of their own (a hook, a wrapper). A class whose forward was
swapped for a hub kernel (transformers' `kernelize`) has other code and keeps it. Each call re-checks its input: CPU,
fp32 or bf16 with a weight of the same dtype, no autograd; anything else (and every thread but the one running the
engine's forward: `switches.THIS_THREAD.fused`) gets the class's forward. Before a width, dtype and formula is used,
the kernel must give that forward's output bit for bit on random rows (`matching_lanes`: which of two sum orders
ATen's build follows) and be faster on 64 rows (`verified_lanes`). `HF_PAGED_FUSED_NORMS=0`: never built nor used;
`=force`: used wherever it matches, untimed (tests).

On a 2-vCPU AMX Xeon, one thread, width 512: 64 rows 37 -> 15 us, 7,034 rows (a prefill) 4.6 -> 1.3 ms (fp32);
bf16 77 -> 26 us and 7.1 -> 1.8 ms. The benchmark's 64 requests (17 norms, fresh prompts, one engine taking turns with
and without): 5.05-5.11 s against 5.15-5.19 s, 1.6-1.9 %.
"""
from __future__ import annotations

import ctypes
import functools
import os
import time
import types
from contextlib import contextmanager
from pathlib import Path

import torch

from .. import native
from .switches import THIS_THREAD

SOURCE = Path(__file__).with_name("cpu") / "rms_norm.c"
DTYPES = (torch.float32, torch.bfloat16)
LLAMA, GEMMA = "llama", "gemma"  # the two formulas (module doc)
_status: dict[str, str] = {}


class RmsNormKernel:
    """`rms_norm_f32` / `rms_norm_bf16` and Gemma's `gemma_rms_norm_f32` / `gemma_rms_norm_bf16` of cpu/rms_norm.c."""

    def __init__(self, path: Path):
        library = ctypes.CDLL(str(path))
        ptr, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        self.fns = {(LLAMA, torch.float32): library.rms_norm_f32, (LLAMA, torch.bfloat16): library.rms_norm_bf16,
                    (GEMMA, torch.float32): library.gemma_rms_norm_f32,
                    (GEMMA, torch.bfloat16): library.gemma_rms_norm_bf16}
        for fn in self.fns.values():
            fn.argtypes = [ptr, i64, ptr, ptr, i64, i64, f32, ctypes.c_int]
            fn.restype = None

    @torch.compiler.disable  # native code through raw pointers: never traced
    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor, eps: float, lanes: int,
                 kind: str = "llama") -> torch.Tensor:
        """hidden [..., n] (last dim contiguous) and weight [n] contiguous, both fp32 or both bf16 -> [..., n];
        `lanes`: the width of the vectors whose sum order the squares follow (16 or 8); `kind`: whose formula
        (LLAMA, or GEMMA: the row scaled by 1 + weight before its one cast)."""
        n = hidden.shape[-1]
        rows = hidden.reshape(-1, n)  # a view where the leading dims allow it, else a copy (rows contiguous)
        out = torch.empty(hidden.shape, dtype=hidden.dtype)
        self.fns[kind, hidden.dtype](rows.data_ptr(), rows.stride(0), weight.data_ptr(), out.data_ptr(),
                                     rows.shape[0], n, eps, lanes)
        return out


@functools.lru_cache(maxsize=1)
def load_rms_norm() -> RmsNormKernel | None:
    kernel, _status["reason"] = native.load(SOURCE, "HF_PAGED_FUSED_NORMS", RmsNormKernel, native.EXACT_FLAGS)
    return kernel


def fused_norms_status() -> str:
    """Why the fused RMSNorm is or is not in use."""
    load_rms_norm()
    return _status.get("reason", "not tried")


def _reference_class(kind: str):
    if kind == GEMMA:
        from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

        return GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm


def _class_kind(cls) -> str | None:
    """LLAMA where the class's forward has LlamaRMSNorm.forward's code; GEMMA where its forward and `_norm` have
    GemmaRMSNorm's (Gemma 2's and 3's are the same code); else None. Read from the class's code objects on every call
    (a forward patched into the class later is seen), decided once per pair of them."""
    norm = getattr(cls, "_norm", None)
    return _code_kind(getattr(getattr(cls, "forward", None), "__code__", None), getattr(norm, "__code__", None))


@functools.lru_cache(maxsize=None)
def _code_kind(forward, norm) -> str | None:
    if forward is None:
        return None
    if _same_code(forward, _reference_class(LLAMA).forward.__code__):
        return LLAMA
    gemma = _reference_class(GEMMA)
    if _same_code(forward, gemma.forward.__code__) and norm is not None and _same_code(norm, gemma._norm.__code__):
        return GEMMA
    return None


def norm_kind(module: torch.nn.Module) -> str | None:
    """Which formula `module` computes (`_class_kind`), where it also holds a 1-d `weight` parameter and a float
    epsilon (`variance_epsilon`, Gemma's `eps`) and no `_norm` of its own; None: neither."""
    kind = _class_kind(type(module))
    weight = getattr(module, "weight", None)
    eps = getattr(module, "eps" if kind == GEMMA else "variance_epsilon", None)
    return kind if (kind is not None and isinstance(weight, torch.nn.Parameter) and type(weight.data) is torch.Tensor
                    and weight.dim() == 1 and isinstance(eps, (float, int)) and "_norm" not in vars(module)) else None


def _same_code(a, b) -> bool:
    return (a.co_code, a.co_consts, a.co_names, a.co_varnames) == (b.co_code, b.co_consts, b.co_names, b.co_varnames)


def is_llama_rms_norm(module: torch.nn.Module) -> bool:
    """Whether `module` computes transformers' LlamaRMSNorm: its class's forward has that very code, and it holds a
    1-d `weight` parameter and a float `variance_epsilon`."""
    return norm_kind(module) == LLAMA


MAX_HIDDEN = 32768  # ATen's grain: a single longer row may be summed by several threads in another order
LANES = (8, 16)  # the vector widths whose sum order the kernel can follow (ATen's Vectorized<float>: AVX2, AVX-512)


@functools.lru_cache(maxsize=None)
def matching_lanes(n: int, dtype: torch.dtype, kind: str = LLAMA) -> int | None:
    """The vector width for which the kernel gives transformers' LlamaRMSNorm (`kind` GEMMA: GemmaRMSNorm) output bit
    for bit on random rows of width `n` (1 and 37 rows, scales from 1e-3 to 1e3, both widths tried); None: neither
    (or no kernel)."""
    kernel = load_rms_norm()
    if kernel is None or n > MAX_HIDDEN:
        return None
    generator = torch.Generator().manual_seed(n)
    norm = _reference_class(kind)(n, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(n, generator=generator))
    norm = norm.to(dtype)
    rows = [(torch.randn(m, n, generator=generator) * torch.logspace(-3, 3, m).unsqueeze(1)).to(dtype)
            for m in (1, 37)]
    with torch.inference_mode():
        expected = [norm(x) for x in rows]
        return next((width for width in LANES
                     if all(torch.equal(kernel(x, norm.weight, 1e-6, width, kind), e) for x, e in zip(rows, expected))),
                    None)


@functools.lru_cache(maxsize=None)
def verified_lanes(n: int, dtype: torch.dtype, threads: int, kind: str = LLAMA) -> int | None:
    """`matching_lanes`, if the kernel is also faster than transformers' forward on 64 rows here (best of 5 timed
    calls each, taking turns; not timed with HF_PAGED_FUSED_NORMS=force); None otherwise. Once per process per
    (n, dtype, torch threads)."""
    lanes = matching_lanes(n, dtype, kind)
    if lanes is None or os.environ.get("HF_PAGED_FUSED_NORMS", "1").strip().lower() == "force":
        return lanes
    kernel, norm = load_rms_norm(), _reference_class(kind)(n, eps=1e-6).to(dtype)
    x = torch.randn(64, n, generator=torch.Generator().manual_seed(n)).to(dtype)
    ours, theirs = [], []
    with torch.inference_mode():
        for _ in range(5):
            ours.append(_seconds(lambda: kernel(x, norm.weight, 1e-6, lanes, kind)))
            theirs.append(_seconds(lambda: norm(x)))
    return lanes if min(ours) < min(theirs) else None


def _seconds(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def fused_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """The swapped-in forward: the native pass where it applies (see the module docstring), else the class's."""
    weight = self.weight
    if (id(self) not in THIS_THREAD.fused or hidden_states.device.type != "cpu" or hidden_states.dtype not in DTYPES
            or weight.dtype != hidden_states.dtype or weight.device.type != "cpu" or not weight.is_contiguous()
            or hidden_states.dim() == 0 or weight.shape[0] != hidden_states.shape[-1] or hidden_states.stride(-1) != 1
            or (torch.is_grad_enabled() and (hidden_states.requires_grad or weight.requires_grad))):
        return type(self).forward(self, hidden_states)
    kind = _class_kind(type(self))
    lanes = verified_lanes(weight.shape[0], weight.dtype, torch.get_num_threads(), kind) if kind else None
    if lanes is None:
        return type(self).forward(self, hidden_states)
    eps = self.eps if kind == GEMMA else self.variance_epsilon
    return load_rms_norm()(hidden_states, weight, float(eps), lanes, kind)


class FusedNorms:
    """The model's Llama-family RMSNorm modules on the CPU, found once; `active()` is a context for one forward."""

    def __init__(self, model: torch.nn.Module):
        threads = torch.get_num_threads()
        self.modules = [m for m in model.modules() if (kind := norm_kind(m)) and m.weight.device.type == "cpu"
                        and m.weight.dtype in DTYPES  # checked now (built, verified, timed), not mid-step
                        and verified_lanes(m.weight.shape[0], m.weight.dtype, threads, kind) is not None]
        self.forwards = [types.MethodType(fused_rms_norm_forward, m) for m in self.modules]
        self.ids = frozenset(id(m) for m in self.modules)

    def active(self):
        """Swap the forwards in for one forward pass of this thread (`swapped_forwards`)."""
        return swapped_forwards(self.modules, self.forwards, self.ids)


@contextmanager
def swapped_forwards(modules: list, forwards: list, ids: frozenset):
    """`forwards[i]` as `modules[i]`'s forward, on for this thread only (`THIS_THREAD.fused`), for one forward pass;
    the class's forwards again after it, even on error. A module that carries a forward of its own keeps it."""
    if not modules:
        yield
        return
    on = THIS_THREAD.fused
    added = ids - on
    on |= added
    swapped = [(m, f) for m, f in zip(modules, forwards) if "forward" not in vars(m)]
    for module, forward in swapped:
        vars(module)["forward"] = forward
    try:
        yield
    finally:
        for module, _ in swapped:
            vars(module).pop("forward", None)
        on -= added
