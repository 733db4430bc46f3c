"""Linear layers for decode-sized CPU steps: a native kernel (`cpu/small_gemm.c`), else y = (W x^T)^T.

A decode step multiplies a handful of rows by every weight matrix of the model. MKL's sgemm does such skinny
products far below what the CPU can do: on a 2-vCPU EPYC it multiplies the LM head [32000, 512] by one row in
7.5 ms while merely reading that weight takes 2.7 ms. So:

- With a C compiler, fp32 products of 1 to KERNEL_MAX_ROWS (128) rows run `small_gemm_f32` (built on first use,
  like the CPU attention kernel: hf_paged/native.py). Up to 4 rows it takes dot products straight from the rows;
  from 5 rows on it broadcasts each weight element against 16 or 32 rows at once. Measured on that EPYC, kernel
  vs the best MKL layout, LM head [32000, 512]: 1 row 3.3 vs 7.5 ms, 16 rows 5.0 vs 9.9 ms, 64 rows 13-14 vs
  22 ms, 128 rows 31 vs 43 ms; [1376, 512]: 1 row 0.04 vs 0.08 ms, 16 rows 0.12-0.14 vs 0.20 ms, 64 rows 0.5 vs
  0.6-0.8 ms; from about 256 rows on MKL is as fast or faster. Since weights are prefetched a tile ahead and x is
  packed by in-register transposes (2026-12-04), the LM head takes 1.9 ms at 1 row, 3.0 ms at 16, 11.0 ms at 64.
- Without a compiler (or with `HF_PAGED_SMALL_GEMM=0`), up to MAX_ROWS (64) rows: W @ x^T, which MKL streams
  1.3-1.6x faster than F.linear's x @ W^T for few rows (LM head on the EPYC at 64 rows: 21 vs 28 ms).

Every output is the same sum as F.linear's in another order of floating-point additions (like any other kernel
choice). `SmallBatchLinears.active()` swaps the `forward` of each plain `torch.nn.Linear` of the model
(exact type: subclasses such as quantized layers keep theirs) for one forward pass and restores them after, even
on error; they run only in the thread that swapped them in (`switches.THIS_THREAD.linears`): a plain forward of
the model in another thread meanwhile gets F.linear, as without hf_paged. Only fp32 CPU weights take it; each call
re-checks dtype, device and layout (a model cast or moved after the engine was built gets F.linear).
`HF_PAGED_SMALL_LINEARS=0` turns all of it off; `small_linear_status()` says which product is in use.
"""
from __future__ import annotations

import ctypes
import functools
import os
import types
from contextlib import contextmanager
from pathlib import Path

import torch

from .. import native
from .switches import THIS_THREAD

MAX_ROWS = 64  # W @ x^T: above this the usual layout is as fast or faster
KERNEL_MAX_ROWS = 128  # the native kernel: beyond this MKL catches up
CHUNK = 4096  # output rows per product: keeps each piece of a large (LM head) weight streaming through the cache
SOURCE = Path(__file__).with_name("cpu") / "small_gemm.c"
_status: dict[str, str] = {}


class SmallGemm:
    """`small_gemm_f32` of cpu/small_gemm.c: y = x w^T (+ bias) for fp32 CPU tensors."""

    def __init__(self, path: Path):
        fn = ctypes.CDLL(str(path)).small_gemm_f32
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64]
        fn.restype = None
        self.fn = fn

    def __call__(self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """rows [m, k] fp32 (each row contiguous), weight [n, k] fp32 contiguous, bias [n] fp32 contiguous or None
        -> [m, n]. The caller checks all of that (`_kernel_takes`): the kernel reads raw pointers."""
        m, k = rows.shape
        n = weight.shape[0]
        out = rows.new_empty(m, n)
        scratch = rows.new_empty(k * -(-m // 16) * 16) if m > 4 else out  # per call: no state shared by threads
        self.fn(rows.data_ptr(), rows.stride(0), weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
                out.data_ptr(), scratch.data_ptr(), m, n, k)
        return out


@functools.lru_cache(maxsize=1)
def load_small_gemm() -> SmallGemm | None:
    kernel, _status["reason"] = native.load(SOURCE, "HF_PAGED_SMALL_GEMM", SmallGemm)
    return kernel


def small_linear_status() -> str:
    """Which product few-row fp32 CPU linears use: the native kernel, or why not."""
    if os.environ.get("HF_PAGED_SMALL_LINEARS", "1") == "0":
        return "off (HF_PAGED_SMALL_LINEARS=0)"
    load_small_gemm()
    return "native kernel" if _status.get("reason") == "loaded" else f"W @ x^T ({_status.get('reason')})"


def _kernel_takes(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Checked on every call, as the kernel reads raw pointers and records no autograd graph: a model cast or moved
    after the engine was built (`model.half()`, `.to(...)`), a call that needs gradients (a user's own forward on the
    same model in another thread while an engine step runs) or runs under CPU autocast all take F.linear."""
    return (rows.dtype == weight.dtype == torch.float32 and rows.device.type == weight.device.type == "cpu"
            and weight.is_contiguous() and weight.dim() == 2 and rows.shape[1] == weight.shape[1]
            and (bias is None or (bias.dtype == torch.float32 and bias.device.type == "cpu" and bias.is_contiguous()
                                  and bias.shape == weight.shape[:1]))
            and not (torch.is_grad_enabled() and (rows.requires_grad or weight.requires_grad
                                                  or (bias is not None and bias.requires_grad)))
            and not torch.is_autocast_enabled("cpu"))


def _rows(x: torch.Tensor, limit: int) -> torch.Tensor | None:
    """x as [rows, in_features] when it has 1..limit rows and something to multiply, else None (F.linear)."""
    if x.dim() == 0 or x.shape[-1] == 0 or x.numel() == 0:
        return None
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.shape[0] <= limit else None


# Both forwards are plain functions bound to their module (types.MethodType), not closures over it: a copy of the
# model taken while they are swapped in (copy.deepcopy binds a method to the copied module) computes with its own
# weights, and `drop_leftover_forwards` can recognize them. The parameters are read on every call: one replaced after
# the engine was built is used as it is now. Outside the thread that swapped them in they are nn.Linear's forward.
def _kernel_linear(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's name
    weight, bias = self.weight, self.bias
    if id(self) not in THIS_THREAD.linears:
        return torch.nn.functional.linear(input, weight, bias)
    kernel = load_small_gemm()
    rows = _rows(input, KERNEL_MAX_ROWS)
    if kernel is None or rows is None or not _kernel_takes(rows, weight, bias):
        return torch.nn.functional.linear(input, weight, bias)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return kernel(rows, weight, bias).view(*input.shape[:-1], weight.shape[0])


def _small_batch_linear(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
    weight, bias = self.weight, self.bias
    rows = _rows(input, MAX_ROWS)
    if rows is None or weight.dim() != 2 or id(self) not in THIS_THREAD.linears:
        return torch.nn.functional.linear(input, weight, bias)
    columns = rows.t()
    if weight.shape[0] > CHUNK:  # each piece lands transposed in place: one pass over the output
        out = rows.new_empty(rows.shape[0], weight.shape[0])
        for i in range(0, weight.shape[0], CHUNK):
            out[:, i:i + CHUNK] = torch.mm(weight[i:i + CHUNK], columns).t()
    else:
        out = torch.mm(weight, columns).t().contiguous()
    if bias is not None:
        out += bias
    return out.view(*input.shape[:-1], weight.shape[0])


OUR_FORWARDS = (_kernel_linear, _small_batch_linear)


def drop_leftover_forwards(model: torch.nn.Module) -> int:
    """Remove our swapped-in linear forwards from a model that nobody is running (a copy taken in the middle of an
    engine's forward carries them); returns how many. Called when a model gets its forward lock."""
    dropped = 0
    for module in model.modules():
        forward = vars(module).get("forward")
        if isinstance(forward, types.MethodType) and forward.__func__ in OUR_FORWARDS:
            del module.forward
            dropped += 1
    return dropped


class SmallBatchLinears:
    """The model's plain fp32 CPU linear layers, found once; `active()` is a context for one forward."""

    def __init__(self, model: torch.nn.Module):
        enabled = os.environ.get("HF_PAGED_SMALL_LINEARS", "1") != "0"
        self.modules = [m for m in model.modules() if enabled and type(m) is torch.nn.Linear
                        and type(m.weight.data) is torch.Tensor  # not a tp_plan DTensor shard
                        and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32]
        kernel = load_small_gemm() if self.modules else None
        function = _small_batch_linear if kernel is None else _kernel_linear
        self.forwards = [types.MethodType(function, m) for m in self.modules]
        self.ids = frozenset(id(m) for m in self.modules)

    @contextmanager
    def active(self):
        """Swap the forwards in for one forward pass. Each call then picks its product by its own row count: in a
        prefill step the layers see thousands of rows (F.linear) while the LM head sees only the sampled ones."""
        if not self.modules:
            yield
            return
        # a module that carries a forward of its own (accelerate's offloading hooks, a user's wrapper) keeps it
        # set in the instance dict directly: what nn.Module.__setattr__ does for a plain function, at a fifth of the
        # cost (57 linears each way: 100 -> 20 us a step)
        on = THIS_THREAD.linears
        added = self.ids - on  # this thread's switch: another thread calling these forwards gets F.linear
        on |= added
        swapped = [(m, f) for m, f in zip(self.modules, self.forwards) if "forward" not in vars(m)]
        for module, forward in swapped:
            vars(module)["forward"] = forward
        try:
            yield
        finally:
            for module, _ in swapped:
                vars(module).pop("forward", None)  # the class's forward again
            on -= added
