"""A mixture's expert products, in the engine's forwards, on whichever path measured fastest on this machine:
transformers' own grouped product, oneDNN's GEMM once per expert, or a native kernel.

transformers runs the experts of its mixture-of-experts models (gpt-oss, Qwen3-MoE, Mixtral, ...: the classes under
`use_experts_implementation`, whose default implementation is "grouped_mm") through `integrations.moe._grouped_mm`: rows
sorted by expert, one product per expert over its group of rows. On a CPU that is `torch._grouped_mm`, one `mm` per
expert: fp32 through MKL, which on an AMD EPYC (Zen 5, issue 27) runs its AVX2 code and, for a handful of rows per
expert, far below both the FMA rate and the memory bandwidth; bf16 through oneDNN. Candidates: transformers' product
("grouped_mm", the baseline); for fp32, oneDNN's GEMM once per expert ("onednn": 1.4x at 16 rows per expert, 2x at
hundreds, weights in cache); and "kernel": for weights stored input-major ([E, k, n], gpt-oss) `cpu/expert_gemm.c` (each
weight row loaded once per six rows of the group; fp32 2.4x at 16 rows, 2x at 256; bf16 weights widened in registers or,
with avx512_bf16, multiplied in pairs: in the benchmark's steps 2.7-5x at 8-16 rows per expert, on par at prefill
sizes); for weights stored output-major (a view of [E, n, k]: Mixtral, Qwen-MoE) fp32: the few-row linear kernel of
`small_linear` once per expert, bf16: dot products along k in `cpu/expert_gemm.c` (with avx512_bf16, pairs of bf16 in
one instruction; in the benchmark's decode steps 2-3x transformers' product at 8-16 rows per expert, a loss at prefill
sizes). Nothing is assumed: in an engine's forward each grouped product is a choice (`TABLE`, a `trials.Table`) among
them per weight shape, dtype and layout, row bucket and thread count, timed on the first calls of each key in the
model's own forwards.

Invariants:
- While hf_paged is enabled transformers' `_grouped_mm` is one wrapper (`register` / `unregister`, from
  `model.register()`), which runs transformers' own function unless the running thread is inside an engine's forward
  (`ExpertProducts.active`: `THIS_THREAD.experts`) and the call is one another path takes (`takes`: plain fp32 or
  bf16 CPU tensors, not a DTensor or a quantized subclass, no gradient wanted, no autocast; oneDNN's path: oneDNN
  enabled, `HF_PAGED_ONEDNN_LINEARS` not 0). A plain
  forward, a training step, another thread, a compiled graph (traced as transformers' own), anything after
  `disable()` computes exactly as without hf_paged.
- The same sums as transformers' product in another order (oneDNN's fp32 math is strict unless torch's float32
  matmul precision allows less; bf16: exact products summed in fp32, rounded to bf16 once, as oneDNN's bf16 GEMM):
  measuring never changes a result beyond rounding.
- Rows past the last offset (expert parallelism's sentinels, which torch's product leaves unwritten and transformers
  masks) come back as zeros; a group of no rows costs nothing.
- `HF_PAGED_EXPERT_PRODUCTS=0`: transformers' product always; `=onednn` / `=kernel`: that path wherever it takes
  the call (else oneDNN's for fp32, transformers' for bf16: tests, comparisons); unset / `auto`: measured.
  `HF_PAGED_EXPERT_GEMM=0`: no input-major kernel (`HF_PAGED_SMALL_GEMM=0`: no few-row kernel).
"""
from __future__ import annotations

import ctypes
import functools
import os
from contextlib import contextmanager
from pathlib import Path

import torch

from .. import native, trials
from . import onednn_linear
from .linear_choice import BUCKET_OF, many_bucket
from .small_linear import load_small_gemm
from .switches import THIS_THREAD

BASELINE = "grouped_mm"
SWITCH = "HF_PAGED_EXPERT_PRODUCTS"
KERNEL_SWITCH = "HF_PAGED_EXPERT_GEMM"  # =0: no native kernel (not built, not a candidate)
SOURCE = Path(__file__).with_name("cpu") / "expert_gemm.c"
TABLE = trials.Table(BASELINE)
_original: list = []  # transformers' `_grouped_mm` while the wrapper is installed
DTYPES = (torch.float32, torch.bfloat16)


def mode() -> str:
    """"off", "onednn" or "kernel" (forced), or "auto" (measured), from HF_PAGED_EXPERT_PRODUCTS."""
    value = os.environ.get(SWITCH, "auto").strip().lower()
    return {"0": "off", "onednn": "onednn", "kernel": "kernel"}.get(value, "auto")


class ExpertGemm:
    """cpu/expert_gemm.c: every expert's group of rows times its weight, stored input-major ([E, k, n]: `__call__`,
    fp32 or bf16) or, bf16, output-major ([E, n, k], handed over as its transposed view: `dot`)."""

    def __init__(self, path: Path):
        library = ctypes.CDLL(str(path))
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self.fns = {torch.float32: library.expert_gemm_f32, torch.bfloat16: library.expert_gemm_bf16}
        self.dot_fn = library.expert_dot_bf16
        try:  # built only where the CPU has avx512_bf16
            self.pairs_fn, self.gemm_pairs_fn = library.expert_dot_bf16_pairs, library.expert_gemm_bf16_pairs
        except AttributeError:
            self.pairs_fn = self.gemm_pairs_fn = None
        for fn in (*self.fns.values(), self.dot_fn, self.pairs_fn, self.gemm_pairs_fn):
            if fn is not None:
                fn.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64]
                fn.restype = None

    def __call__(self, input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:  # noqa: A002
        """input [S, k] and weight [E, k, n], both fp32 or both bf16, contiguous (n a multiple of 16:
        `native_product`) -> [S, n] in their dtype; bf16: products and sums in fp32, the result rounded once (with
        avx512_bf16, k even and n a multiple of 64: pairs of bf16 multiplied in one instruction)."""
        if weight.dtype is torch.bfloat16 and self.gemm_pairs_fn is not None and input.shape[1] % 2 == 0 \
                and weight.shape[2] % 64 == 0:
            return self._run(self.gemm_pairs_fn, input, weight, offs, widen=False)
        return self._run(self.fns[weight.dtype], input, weight, offs)

    def dot(self, input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:  # noqa: A002
        """input [S, k] bf16 contiguous, weight [E, k, n] bf16 the transposed view of a contiguous [E, n, k] (k a
        multiple of 16: `native_product`) -> [S, n] bf16: products and sums in fp32, the result rounded once."""
        if self.pairs_fn is not None and input.shape[1] % 32 == 0:  # avx512_bf16: pairs in one instruction
            return self._run(self.pairs_fn, input, weight, offs, widen=False)
        return self._run(self.dot_fn, input, weight, offs)

    @torch.compiler.disable  # native code through raw pointers: never traced by dynamo
    def _run(self, fn, input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,  # noqa: A002
             widen: bool = True) -> torch.Tensor:
        count, k = input.shape
        experts, n = weight.shape[0], weight.shape[2]
        ends = offs.to(torch.int64).clamp(0, count).cummax(0).values.contiguous()  # what the kernel may trust
        rows = input if input.dtype is torch.float32 or not widen else input.float()  # bf16 -> fp32: exact
        out = input.new_empty(count, n, dtype=torch.float32)
        fn(rows.data_ptr(), weight.data_ptr(), out.data_ptr(), ends.data_ptr(), experts, k, n,
           torch.get_num_threads())
        last = int(ends[-1]) if experts else 0
        if last < count:
            out[last:].zero_()
        return out if input.dtype is torch.float32 else out.to(input.dtype)


@functools.lru_cache(maxsize=1)
def load_expert_gemm() -> ExpertGemm | None:
    """The native kernel, built on first use (hf_paged/native.py), or None (no compiler, HF_PAGED_EXPERT_GEMM=0...)."""
    kernel, _ = native.load(SOURCE, KERNEL_SWITCH, ExpertGemm)
    return kernel


def native_product(input: torch.Tensor, weight: torch.Tensor):  # noqa: A002 - transformers' name
    """The native candidate for a call `takes` allows (contiguous rows), or None: an input-major weight [E, k, n]
    stored so (gpt-oss), n a multiple of 16: `expert_gemm` (fp32 or bf16); an output-major one (a view of [E, n, k]
    stored so: Mixtral, Qwen-MoE): bf16, k a multiple of 16, `expert_dot_bf16`; fp32, the few-row linear kernel
    (`small_linear`'s) once per expert."""
    if weight.is_contiguous() and weight.shape[2] % 16 == 0 and weight.shape[2] > 0:
        return load_expert_gemm()
    if not weight.transpose(1, 2).is_contiguous():
        return None
    if weight.dtype is torch.bfloat16:
        kernel = load_expert_gemm()
        return kernel.dot if kernel is not None and weight.shape[1] % 16 == 0 and weight.shape[1] > 0 else None
    if weight.dtype is torch.float32:
        small = load_small_gemm()
        return functools.partial(_per_expert_small, small) if small is not None else None
    return None


def _per_expert_small(small, input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:  # noqa
    return each_expert(lambda rows, transposed: small(rows, transposed, None), input, weight, offs)


def takes(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> bool:  # noqa: A002 - transformers' name
    """Whether another path may run `input` [S, k] x `weight` [E, k, n] grouped by `offs` [E] (cumulative ends):
    both fp32 or both bf16 (bf16: transformers' product is oneDNN's already; only the kernel is another path)."""
    return (_plain(input) and _plain(weight) and _plain(offs)
            and input.dtype is weight.dtype and weight.dtype in DTYPES and input.is_cpu and weight.is_cpu
            and input.dim() == 2 and weight.dim() == 3 and input.shape[1] == weight.shape[1]
            and offs.dim() == 1 and offs.shape[0] == weight.shape[0] and offs.is_cpu
            and not offs.dtype.is_floating_point
            and not (torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad))
            and not torch.is_autocast_enabled("cpu"))


def _plain(tensor: torch.Tensor) -> bool:
    """A tensor whose storage holds its values as they read (not a DTensor shard, not a quantized subclass)."""
    return type(tensor) in (torch.Tensor, torch.nn.Parameter) and type(tensor.data) is torch.Tensor


def each_expert(product, input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:  # noqa
    """[S, n]: each expert's group of rows times its weight, `product(rows, weight[e].t())` (rows x an [n, k] weight);
    rows past the last offset are zeros; offsets past the rows or going back are clamped."""
    out = input.new_empty(input.shape[0], weight.shape[2])
    start = 0
    for expert, end in enumerate(offs.tolist()):
        end = min(max(end, start), input.shape[0])
        if end > start:
            out[start:end] = product(input[start:end], weight[expert].t())
        start = end
    if start < input.shape[0]:
        out[start:].zero_()
    return out


def per_expert(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:  # noqa: A002
    """[S, n]: each expert's group of rows times its weight through oneDNN (`each_expert`)."""
    return each_expert(lambda rows, transposed: onednn_linear.product(rows, transposed, None), input, weight, offs)


def grouped(original, input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:  # noqa: A002
    """What transformers' `_grouped_mm` wrapper runs (module invariants)."""
    if torch.compiler.is_compiling() or not THIS_THREAD.experts or not takes(input, weight, offs):
        return original(input, weight, offs=offs)
    switch = mode()
    if switch == "off":
        return original(input, weight, offs=offs)
    rows = input if input.is_contiguous() else input.contiguous()
    kernel = native_product(rows, weight) if switch in ("auto", "kernel") else None
    onednn = (weight.dtype is torch.float32  # bf16: transformers' product is oneDNN's
              and onednn_linear.available() and torch._C._get_mkldnn_enabled())
    if switch == "kernel" and kernel is not None:
        return kernel(rows, weight, offs)
    if switch != "auto":  # oneDNN's forced, or the kernel's where it does not take the call
        return per_expert(rows, weight, offs) if onednn else original(input, weight, offs=offs)
    if kernel is None and not onednn:
        return original(input, weight, offs=offs)
    count = rows.shape[0]
    bucket = BUCKET_OF[count] if count < len(BUCKET_OF) else many_bucket(count)
    key = (tuple(weight.shape), "kn" if weight.stride(-1) == 1 else "nk", bucket, torch.get_num_threads(),
           kernel is not None, weight.dtype)
    products = {BASELINE: original, **({"onednn": per_expert} if onednn else {}),
                **({"kernel": kernel} if kernel is not None else {})}
    name = None if key in TABLE.choices else TABLE.next_call(key, products)
    path = name or TABLE.choices[key].path
    if path == BASELINE:
        run = functools.partial(original, input, weight, offs=offs)
    else:
        run = functools.partial(products[path], rows, weight, offs)
    out, _ = TABLE.timed(key, name, run)
    return out


class ExpertProducts:
    """A model's mixture experts (modules under transformers' `use_experts_implementation`), found once;
    `active()` is a context for one engine forward."""

    def __init__(self, model: torch.nn.Module):
        self.on = mode() != "off" and any(_is_experts(m) for m in model.modules())

    @contextmanager
    def active(self):
        if not self.on or THIS_THREAD.experts:
            yield
            return
        THIS_THREAD.experts = True
        try:
            yield
        finally:
            THIS_THREAD.experts = False


def _is_experts(module: torch.nn.Module) -> bool:
    return all(hasattr(module, name) for name in ("has_gate", "is_transposed", "has_bias"))


def register() -> bool:
    """Wrap transformers' `_grouped_mm` (idempotent); False where this transformers has none (nothing to do)."""
    if _original:
        return True
    try:
        from transformers.integrations import moe
    except ImportError:  # pragma: no cover - transformers without mixture integrations
        return False
    original = getattr(moe, "_grouped_mm", None)
    if original is None or not callable(original):
        return False

    @functools.wraps(original)
    def _grouped_mm(input, weight, offs=None, **more):  # noqa: A002 - transformers' names
        if offs is None or more:  # a call this wrapper was not written for: transformers' own
            return original(input, weight, offs=offs, **more)
        return grouped(original, input, weight, offs)

    _grouped_mm.hf_paged_original = original
    moe._grouped_mm = _grouped_mm
    _original.append(original)
    return True


def unregister() -> None:
    """Put transformers' own `_grouped_mm` back."""
    if not _original:
        return
    from transformers.integrations import moe

    moe._grouped_mm = _original.pop()


def expert_choices() -> list[dict]:
    """Every choice so far: weight shape and layout, row bucket, threads, path, each candidate's time in us."""
    return [{"weight": list(k[0]), "dtype": str(k[5]).replace("torch.", ""), "layout": k[1], "rows": k[2],
             "threads": k[3], "kernel": k[4], "path": c.path,
             "us": {n: round(s * 1e6, 1) for n, s in c.seconds.items()}} for k, c in list(TABLE.choices.items())]
