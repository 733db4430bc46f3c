"""fp32 CPU linear layers on whichever product measured fastest on this machine for the weight's shape and the call's
row count: a native kernel (`cpu/small_gemm.c`), y = (W x^T)^T, x @ (a transposed copy of W), oneDNN's GEMM or
F.linear.

BLAS handles the skinny products of a decode step unevenly, and a CPU vendor's BLAS can lose 2x to another library on
another vendor's CPU. Candidates for fp32 products of 1 to KERNEL_MAX_ROWS (128) rows:

- the native kernel `small_gemm_f32` (with a C compiler; built on first use: hf_paged/native.py): dot products from
  the rows up to 8 rows, from 9 on each weight element against 16 or 32 rows at once. `HF_PAGED_SMALL_GEMM=0`: none;
- W @ x^T, which MKL streams faster than x @ W^T for few rows on some machines and slower on others;
- x @ (a transposed copy of W): MKL's plain product, no transposed operand to repack on every call. The copy is a
  second copy of the weight, made and checked like the bf16 packed copies (`packed_linear`: memory budget,
  `HF_PAGED_PACKED_LINEARS=0` turns it off), made only while its candidate is measured or chosen, and dropped once no
  row bucket of its shape chose it;
- oneDNN's fp32 GEMM (`onednn_linear`: on a Zen 5 EPYC 2x MKL's from 16 rows on); F.linear itself.
Calls of more rows (a prefill step's) choose between oneDNN's GEMM and F.linear, in buckets of powers of two.

Nothing about speed is assumed: by default (`HF_PAGED_SMALL_LINEARS` unset, `1` or `auto`) the first calls of each
(weight shape, dtype, row bucket, torch thread count) run the candidates in turn inside the model's own forwards,
timing each call, and the fastest is kept for the process, F.linear unless a fast path beats it by more than 5 %
(`linear_choice`: invariants, cost, the optional disk cache). `HF_PAGED_SMALL_LINEARS=0`
turns all of it off (F.linear, as without hf_paged); `=kernel` forces the kernel (W @ x^T up to MAX_ROWS where it
did not load) and `=w_xt` forces W @ x^T up to MAX_ROWS (64): for tests and comparisons. `small_linear_status()` says
which products are in play and what was chosen per shape; `small_linear_choices()` gives the same as data.

Every output is the same sum as F.linear's in another order of floating-point additions (like any other kernel
choice). `SmallBatchLinears.active()` swaps the `forward` of each plain `torch.nn.Linear` of the model
(exact type: subclasses such as quantized layers keep theirs) for one forward pass and restores them after, even
on error; they run only in the thread that swapped them in (`switches.THIS_THREAD.linears`): a plain forward of
the model in another thread meanwhile gets F.linear, as without hf_paged. Only fp32 CPU weights take these products
(bf16 ones take `packed_linear`'s, chosen the same way); each call re-checks dtype, device and layout (a model cast
or moved after the engine was built gets F.linear).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import types
from contextlib import contextmanager
from pathlib import Path

import torch

from .. import native, trials
from . import (fingerprint, fused_layers, fused_norms, fused_rotary, greedy_head, onednn_linear, packed_linear,
               transposed_copy)
from .linear_choice import BUCKET_OF, TABLE, Key, many_bucket, summary
from .switches import THIS_THREAD

logger = logging.getLogger("hf_paged")
MAX_ROWS = 64  # W @ x^T when forced (HF_PAGED_SMALL_LINEARS=w_xt, or =kernel without the kernel)
KERNEL_MAX_ROWS = 128  # the native kernel: beyond this MKL catches up
CHUNK = 4096  # output rows per product: keeps each piece of a large (LM head) weight streaming through the cache
COPYING = frozenset({transposed_copy.NAME})  # candidates that copy the module's weight (trials.COPY_HOLDERS)
SOURCE = Path(__file__).with_name("cpu") / "small_gemm.c"
_status: dict[str, str] = {}


class SmallGemm:
    """`small_gemm_f32` of cpu/small_gemm.c: y = x w^T (+ bias) for fp32 CPU tensors."""
    def __init__(self, path: Path):
        self.fn = fn = ctypes.CDLL(str(path)).small_gemm_f32
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes, fn.restype = [ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64], None

    @torch.compiler.disable  # native code through raw pointers: never traced by dynamo (a compiled model)
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


MODES = {"0": "off", "1": "auto", "auto": "auto", "": "auto", "kernel": "kernel", "w_xt": "w_xt"}
_warned_modes: set[str] = set()


def mode() -> str:
    """`HF_PAGED_SMALL_LINEARS`: "off" (0), "kernel" or "w_xt" (forced), else "auto" (measured; an unknown value
    is warned about once and taken as auto)."""
    value = os.environ.get("HF_PAGED_SMALL_LINEARS", "1").strip().lower()
    if value not in MODES and value not in _warned_modes:
        _warned_modes.add(value)
        logger.warning("hf_paged: HF_PAGED_SMALL_LINEARS=%r is none of 0, 1, auto, kernel, w_xt: measuring (auto)",
                       value)
    return MODES.get(value, "auto")


def small_linear_status() -> str:
    """Which products few-row fp32 CPU linears use (the native kernel, or why not) and, measured, what was chosen
    per weight shape and row bucket so far in this process."""
    chosen = mode()
    if chosen == "off":
        return "off (HF_PAGED_SMALL_LINEARS=0)"
    loaded = load_small_gemm() is not None
    reason = _status.get("reason")
    if chosen == "kernel":
        return ("native kernel" if loaded else f"W @ x^T ({reason})") + " (forced: HF_PAGED_SMALL_LINEARS=kernel)"
    if chosen == "w_xt":
        return "W @ x^T (forced: HF_PAGED_SMALL_LINEARS=w_xt)"
    copies = (", x @ (a transposed copy of W)" if packed_linear.mode() != "off" else "") + \
        (", oneDNN's GEMM" if onednn_linear.available() else "")
    head = (f"native kernel, W @ x^T{copies} or F.linear" if loaded else f"W @ x^T{copies} or F.linear") + \
        ", the fastest measured per weight shape and row count" + ("" if loaded else f" (no native kernel: {reason})") \
        + ("; bf16: oneDNN's packed copy or F.linear, measured alike" if packed_linear.supported() else "") \
        + f"; greedy steps' LM head: {greedy_head.status()}"
    report = summary(TABLE.report())
    return f"{head}; chosen: {report}" if report else f"{head}; nothing measured yet"


def small_linear_choices() -> list[dict]:
    """Every measured choice so far: shape, dtype, rows (bucket), threads, path, each candidate's best us, source."""
    return TABLE.report()


def _kernel_takes(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Checked on every call, as the kernel reads raw pointers and records no autograd graph: a model cast or moved
    after the engine was built (`model.half()`, `.to(...)`), a call that needs gradients (a user's own forward on the
    same model in another thread while an engine step runs) or runs under CPU autocast all take F.linear."""
    return (rows.dtype == weight.dtype == torch.float32 and rows.is_cpu and weight.is_cpu
            and weight.is_contiguous() and weight.dim() == 2 and rows.shape[1] == weight.shape[1]
            and (bias is None or (bias.dtype == torch.float32 and bias.is_cpu and bias.is_contiguous()
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


def _w_xt(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """(W @ rows^T)^T (+ bias) as a contiguous [m, n]; an LM-head-sized weight in CHUNK-row pieces."""
    columns = rows.t()
    if weight.shape[0] > CHUNK:  # each piece lands transposed in place: one pass over the output
        out = rows.new_empty(rows.shape[0], weight.shape[0])
        for i in range(0, weight.shape[0], CHUNK):
            out[:, i:i + CHUNK] = torch.mm(weight[i:i + CHUNK], columns).t()
    else:
        out = torch.mm(weight, columns).t().contiguous()
    if bias is not None:
        out += bias
    return out


@functools.lru_cache(maxsize=1)
def _identity() -> str:
    """What besides the CPU decides the products' speed: for the on-disk choices' file name."""
    return f"torch {torch.__version__} small_gemm {hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]}"


def candidates(kernel: SmallGemm | None) -> dict:
    """The products a measured call chooses from, in tie-break order: name -> f(rows, weight, bias) -> [m, n]
    (the transposed copy's: a marker)."""
    products = {"kernel": kernel} if kernel is not None else {}
    products.update(w_xt=_w_xt)
    if packed_linear.mode() != "off":
        products[transposed_copy.NAME] = transposed_copy.MARKER
    if onednn_linear.available():
        products[onednn_linear.NAME] = onednn_linear.product
    products.update(f_linear=torch.nn.functional.linear)
    return products


def _measured(module: torch.nn.Linear, key: tuple, products: dict, rows: torch.Tensor,
              weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A call of `key` while it has no choice: the candidate its trial names, timed (linear_choice.Trial; the
    transposed copy, made before the timing, on a few modules only: trials.COPY_HOLDERS, the others' SKIP runs
    F.linear untimed); a module that cannot have one records it as unavailable (infinitely slow: dropped). Once a
    choice is made, copies no bucket of this shape chose are dropped."""
    key = Key(tuple(key[0]), *key[1:])
    name, product = TABLE.pick(key, products, identity=_identity(), holder=id(module), copying=COPYING)
    if name == trials.SKIP or product is transposed_copy.MARKER:
        copy = None if name == trials.SKIP else transposed_copy.copy_of(module, weight)
        if copy is None:
            if name not in (None, trials.SKIP) and TABLE.record(key, name, float("inf"), identity=_identity()):
                transposed_copy.drop_unchosen(key.shape)
            return torch.nn.functional.linear(rows, weight, bias)
        run = lambda: transposed_copy.multiply(rows, copy, bias)  # noqa: E731
    else:
        run = lambda: product(rows, weight, bias)  # noqa: E731
    out, decided = TABLE.timed(key, name, run, identity=_identity())
    if decided:
        transposed_copy.drop_unchosen(key.shape)
    return out


# The forwards are plain functions bound to their module (types.MethodType), not closures over it: a copy of the
# model taken while they are swapped in (copy.deepcopy binds a method to the copied module) computes with its own
# weights, and `drop_leftover_forwards` can recognize them. The parameters are read on every call: one replaced after
# the engine was built is used as it is now. Outside the thread that swapped them in they are nn.Linear's forward.
def _measured_linear(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's name
    """The default: the product measured fastest for this weight's shape, this call's row bucket and thread count
    (`linear_choice`). Cheapest checks first: a call whose choice is F.linear costs a dict lookup more than F.linear;
    any other product runs only on inputs `_kernel_takes` (so all candidates see inputs the kernel could take)."""
    weight, bias = self.weight, self.bias
    if id(self) not in THIS_THREAD.linears:
        return torch.nn.functional.linear(input, weight, bias)
    shape = input.shape
    m = input.numel() // shape[-1] if shape and shape[-1] else 0
    if m <= 0:
        return torch.nn.functional.linear(input, weight, bias)
    # a plain tuple: equal to (and hashed like) the linear_choice.Key it was stored under, cheaper to build
    if m <= KERNEL_MAX_ROWS:
        kernel = load_small_gemm()
        key = (weight.shape, weight.dtype, BUCKET_OF[m], torch.get_num_threads(), kernel is not None)
    else:  # a prefill step's many rows: oneDNN or F.linear
        kernel, key = None, (weight.shape, weight.dtype, many_bucket(m), torch.get_num_threads(), False)
    product = TABLE.fast.get(key)
    if product is torch.nn.functional.linear:
        return torch.nn.functional.linear(input, weight, bias)
    rows = input.reshape(m, shape[-1])
    if not _kernel_takes(rows, weight, bias):
        return torch.nn.functional.linear(input, weight, bias)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if product is None:
        products = candidates(kernel) if m <= KERNEL_MAX_ROWS else onednn_linear.many_row_products()
        out = _measured(self, key, products, rows, weight, bias)
    elif product is transposed_copy.MARKER:
        out = transposed_copy.product(self, rows, weight, bias)
    else:
        out = product(rows, weight, bias)
    return out if len(shape) == 2 else out.view(*shape[:-1], weight.shape[0])


def _kernel_linear(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's name
    """Forced (HF_PAGED_SMALL_LINEARS=kernel): the native kernel up to KERNEL_MAX_ROWS rows."""
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
    """Forced (HF_PAGED_SMALL_LINEARS=w_xt, or =kernel where it did not load): W @ x^T up to MAX_ROWS rows."""
    weight, bias = self.weight, self.bias
    rows = _rows(input, MAX_ROWS)
    if rows is None or weight.dim() != 2 or id(self) not in THIS_THREAD.linears:
        return torch.nn.functional.linear(input, weight, bias)
    return _w_xt(rows, weight, bias).view(*input.shape[:-1], weight.shape[0])


OUR_FORWARDS = (_measured_linear, _kernel_linear, _small_batch_linear, packed_linear._packed_linear,
                packed_linear._forced_packed_linear, greedy_head.greedy_head_forward,
                fused_norms.fused_rms_norm_forward, fused_rotary.fused_rotary_forward,
                fused_layers.fused_layer_forward)


def drop_leftover_forwards(model: torch.nn.Module) -> int:
    """Remove our swapped-in forwards (linears, norms, the rotary wrappers in attention modules' `_kernel_funcs`) from
    a model that nobody is running (a copy taken in the middle of an engine's forward carries them); returns how
    many. Called when a model gets its forward lock."""
    dropped = 0
    for module in model.modules():
        wrappers = vars(module).get("_kernel_funcs")
        for holder in [module, *(wrappers.values() if isinstance(wrappers, dict) else ())]:
            forward = vars(holder).get("forward")
            if isinstance(forward, types.MethodType) and forward.__func__ in OUR_FORWARDS:
                del vars(holder)["forward"]
                dropped += 1
    return dropped


class SmallBatchLinears:
    """The model's plain fp32 CPU linear layers, found once; `active()` is a context for one forward."""

    def __init__(self, model: torch.nn.Module):
        self.mode = mode()  # read once: HF_PAGED_SMALL_LINEARS as it was when the engine was built
        plain_linears = [m for m in model.modules() if self.mode != "off" and type(m) is torch.nn.Linear
                         and type(m.weight.data) is torch.Tensor  # not a tp_plan DTensor shard
                         and m.weight.device.type == "cpu"]
        fp32 = [m for m in plain_linears if m.weight.dtype == torch.float32]
        packable = [m for m in plain_linears if m.weight.dtype in packed_linear.DTYPES] \
            if packed_linear.supported() else []
        kernel = load_small_gemm() if fp32 and self.mode != "w_xt" else None  # built now, not mid-step
        if self.mode == "auto":
            function = _measured_linear
        elif self.mode == "kernel" and kernel is not None:
            function = _kernel_linear
        else:
            function = _small_batch_linear
        self.modules = fp32 + packable
        self.forwards = [types.MethodType(function, m) for m in fp32] + \
            [types.MethodType(packed_linear.forward_for(packed_linear.mode()), m) for m in packable]
        self.ids = frozenset(id(m) for m in self.modules)
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.head = head if any(m is head for m in self.modules) else None
        # an fp32 or bf16 head without bias may screen the logits of greedy steps (greedy_head); its copies are checked
        # with the bf16 linears' packed copies
        self.greedy_head = self.head if (self.head is not None and self.head.weight.dtype in greedy_head.DTYPES
                                         and self.head.bias is None and greedy_head.available()) else None
        # the head's usual forward, for a greedy step's fallback
        self.head_function = function if self.head is None or self.head.weight.dtype == torch.float32 else \
            packed_linear.forward_for(packed_linear.mode())
        fp32_head = [self.greedy_head] if self.greedy_head is not None and self.greedy_head not in packable else []
        # fp32 linears measured here may take transposed copies (transposed_copy): checked with the others
        copying = fp32 if self.mode == "auto" and packed_linear.mode() != "off" else []
        self.packed = packed_linear.PackedLinears(packable + [m for m in fp32_head if m not in copying] + copying)
        self.plain_steps: set = set()  # (rows, head rows, threads) of steps whose every product is F.linear
        self.model = model  # for the adapter layers' base layers, listed before each forward (no weight copies)

    def plain(self, rows: int, head_rows: int) -> bool:
        """Whether a forward of `rows` tokens whose LM head sees `head_rows` of them would run F.linear in every
        linear layer (so the forwards need not be swapped in): measured mode, and every layer's choice for its row
        bucket is made and is F.linear (a layer whose choice is not made yet keeps the swap: its first calls measure).
        Assumes each non-head layer sees all `rows` (a layer that sees fewer, e.g. an expert of a mixture, may take
        F.linear where its own bucket chose another product: the same sum in another order, never a wrong one)."""
        if self.mode != "auto" or not self.modules:
            return not self.modules
        threads = torch.get_num_threads()
        key = (rows, head_rows, threads)
        if key in self.plain_steps:
            return True
        kernel = load_small_gemm() is not None
        fast = TABLE.fast
        for module in self.modules:
            m = head_rows if module is self.head else rows
            weight = module.weight
            fp32 = weight.dtype == torch.float32  # the packed (bf16) products' keys say kernel=False
            if 0 < m <= KERNEL_MAX_ROWS:
                choice = (weight.shape, weight.dtype, BUCKET_OF[m], threads, kernel and fp32)
            elif m > KERNEL_MAX_ROWS and fp32:  # bf16 linears of many rows take F.linear (oneDNN's own)
                choice = (weight.shape, weight.dtype, many_bucket(m), threads, False)
            else:
                continue
            if fast.get(choice) is not torch.nn.functional.linear:
                return False
        self.plain_steps.add(key)
        return True

    def greedy_step(self, check: bool, head_rows: int) -> greedy_head.GreedyStep | None:
        """A request for the head's picks in the next forward (`active(..., greedy=)`), or None: no head that
        screens, or one measured to take its usual product at `head_rows` rows. `check`: that forward computes real
        logits for the runner to compare (greedy_head)."""
        if self.greedy_head is None or (not check and greedy_head.known_plain(self.greedy_head, head_rows)):
            return None
        return greedy_head.GreedyStep(self.greedy_head, self.head_function, check=check)

    @contextmanager
    def active(self, rows: int | None = None, head_rows: int | None = None,
               greedy: greedy_head.GreedyStep | None = None):
        """Swap the forwards in for one forward pass. Each call then picks its product by its own row count: in a
        prefill step the layers see thousands of rows (F.linear) while the LM head sees only the sampled ones. With
        the step's `rows` and `head_rows` given, a step whose products are all F.linear (`plain`) swaps nothing,
        unless `greedy` (from `greedy_step`) asks the head for picks: then the head's forward is greedy_head's, for
        this thread, until the forward ends."""
        if not self.modules or (greedy is None and rows is not None
                                and self.plain(rows, head_rows if head_rows is not None else rows)):
            yield
            return
        # a module that carries a forward of its own (accelerate's offloading hooks, a user's wrapper) keeps it
        # set in the instance dict directly: what nn.Module.__setattr__ does for a plain function, at a fifth of the
        # cost (57 linears each way: 100 -> 20 us a step)
        if self.packed.modules:
            self.packed.verify()  # packed copies whose weights changed through `.data` are dropped (packed_linear)
            THIS_THREAD.no_copies = fingerprint.adapter_bases(self.model)
        on = THIS_THREAD.linears
        added = self.ids - on  # this thread's switch: another thread calling these forwards gets F.linear
        on |= added
        swapped = [(m, f) for m, f in zip(self.modules, self.forwards) if "forward" not in vars(m)]
        if greedy is not None:
            swapped = [(m, types.MethodType(greedy_head.greedy_head_forward, m) if m is greedy.head else f)
                       for m, f in swapped]
            THIS_THREAD.greedy = greedy
        for module, forward in swapped:
            vars(module)["forward"] = forward
        try:
            yield
        finally:
            for module, _ in swapped:
                vars(module).pop("forward", None)  # the class's forward again
            on -= added
            THIS_THREAD.greedy = None
            THIS_THREAD.no_copies = frozenset()
