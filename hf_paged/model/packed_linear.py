"""bf16 CPU linears on oneDNN's pre-packed weights, where this machine runs them faster in the model's own steps;
the copies of weights other products keep (fp32 transposed copies, an LM head's screens), checked alike.

torch's bf16 `F.linear` on a CPU runs oneDNN, which reorders the weight into its blocked (AMX / AVX-512) layout on
every call: for the few rows of a decode step that reorder is a second pass over the weight. A copy packed once
(`torch.ops.mkldnn._reorder_linear_weight`) and multiplied by `_linear_pointwise` skips it: on an AMX Xeon, 1.3-2x
per product at 1-64 rows. Whether it wins is measured like the fp32 products of `small_linear`: the first calls of
each (weight shape, dtype, row bucket, torch threads) run both in turn inside the model's forwards, timed
(`linear_choice.Trial`; F.linear kept unless the packed product is more than 5 % faster), so a CPU where it loses
keeps F.linear.

Invariants:
- Used only where `small_linear` swaps forwards (the engine's forward, in the thread that swapped them in), for a
  plain `torch.nn.Linear` whose weight is a bf16, contiguous, 2-D CPU `Parameter` (`weight_packable`), on inputs
  needing no gradient, without autocast, with a contiguous bias; anything else gets F.linear. The sums are
  F.linear's bf16 products with fp32 accumulation in another order (bf16 rounding flips, like any other kernel
  choice; fp32 models never take this path).
- A packed copy is used only while it matches its weight: on every call the weight's storage (the very storage
  object, held by a weak reference), address, shape, strides, dtype and version counter must equal those it was
  packed from (an optimizer step, `load_state_dict`, `copy_`, a cast, `.data = ...` all repack), and before each
  forward `PackedLinears.verify` compares sample entries of every packed weight (a few short runs spread over it)
  with their values when packed: writes that bypass the version counter (through `.data`, as PEFT merges LoRA into
  base weights; through a flat buffer the parameters view, as `vector_to_parameters` leaves them; through a numpy or
  DLPack alias) and change any of them drop every copy of the model. Not caught: such a write that changes none of
  the sampled entries; `LLM.reset_prefix_cache()` drops the copies as well. Inference tensors (no version counter)
  are never packed.
- fp32 linears may hold a transposed copy (`copy_for(..., TRANSPOSED)`, `transposed_copy`), kept in its own store.
- No copy is made or used in a forward for a module an adapter layer wraps (`fingerprint.adapter_bases`, put in
  `THIS_THREAD.no_copies`): PEFT writes those weights through `.data`, also mid-forward (a merged layer with its
  adapters disabled unmerges when called), after the checks above ran.
- Memory: a copy is a second copy of its weight (oneDNN pads small ones: counted as packed). All copies in the
  process together (`fused_layers`' too) stay under BUDGET_SHARE of the memory available when the first was made,
  the transposed ones under TRANSPOSED_SHARE of that; beyond that, F.linear. `HF_PAGED_PACKED_LINEARS=0`: none.
- A copy lives as long as its module (`_COPIES` holds modules weakly) and is shared by every engine of the model
  (`model.generate(...)` builds an engine per call: no repacking per call). It holds no view of its weight, so a
  weight given new storage (`model.to("cuda")`) is freed; the copy itself goes at the next forward's check, with
  `reset_prefix_cache()`, or with its module.
"""
from __future__ import annotations

import functools
import os
import threading
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .. import trials
from ..config import logger
from . import int8_head
from .linear_choice import BUCKET_OF, TABLE, Key
from .switches import THIS_THREAD

PIECES, PIECE = 8, 4  # sample runs per packed weight and entries per run
BUDGET_SHARE = 0.25  # of MemAvailable when the first copy is made: the most all copies may take
TRANSPOSED_SHARE = 0.5  # of that budget: the most fp32 transposed copies may take (the rest stays for the LM head's
# screens and bf16 packed copies, which a decode step's earlier layers would otherwise have used up)
SWITCH = "HF_PAGED_PACKED_LINEARS"
BATCH_HINT = 64  # rows oneDNN lays the packed copy out for (1..64-row products measured no slower than with none)
DTYPES = (torch.bfloat16,)
TRANSPOSED = "transposed"  # copy_for's kind for an fp32 weight's transposed copy (small_linear's "wt_copy" product)


def mode() -> str:
    """`HF_PAGED_PACKED_LINEARS`: "off" (0), "force" (packed wherever it may run), else "auto" (measured)."""
    value = os.environ.get(SWITCH, "auto").strip().lower()
    return {"0": "off", "force": "force"}.get(value, "auto")


def supported() -> bool:
    """oneDNN with bf16 support in this torch build, and not switched off."""
    return mode() != "off" and _onednn_bf16()


@functools.lru_cache(maxsize=1)
def _onednn_bf16() -> bool:
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class PackedCopy:
    """One weight's packed copy and what it was packed from. It holds no view of the weight, only a weak reference to
    its storage (torch's `StorageWeakRef`: the data is freed with the last tensor, but no other storage can take the
    same identity while the copy lives), so a weight given new storage (`model.to("cuda")`, `.data = ...`) is freed
    and a new one is never mistaken for it, even at the same address."""
    __slots__ = ("storage", "address", "version", "shape", "stride", "dtype", "nbytes", "packed", "starts", "values",
                 "row_norm_max", "__weakref__")

    def __init__(self, weight: torch.Tensor, cast: torch.dtype | None = None, made: torch.Tensor | None = None):
        """`cast`: pack `weight` cast to this dtype (an fp32 LM head's bf16 screen, `greedy_head`); the copy then also
        knows the largest Euclidean norm of the weight's rows (`row_norm_max`, in float64 from the weight itself).
        `cast=torch.int8`: `packed` is the head's int8 copy instead (`int8_head.Int8Head`, for the int8 screen),
        `row_norm_max` the same. `cast=TRANSPOSED`: `packed` is the fp32 weight transposed, contiguous ([in, out]),
        or `made`, a copy the caller made (`fused_layers`: a view into joined weights)."""
        with torch.no_grad():
            if made is not None or cast is TRANSPOSED:
                self.packed = made if made is not None else weight.detach().t().contiguous()
                self.row_norm_max = None
            elif cast is torch.int8:
                self.packed = int8_head.quantize(weight.detach())
                self.row_norm_max = self.packed.w_norm_max
            else:
                source = weight.detach() if cast is None else weight.detach().to(cast)
                self.packed = torch.ops.mkldnn._reorder_linear_weight(source, BATCH_HINT)
                del source
                self.row_norm_max = None if cast is None else _row_norm_max(weight.detach())
        self.storage = StorageWeakRef(weight.untyped_storage())
        self.address, self.version, self.shape = weight.data_ptr(), _version(weight), weight.shape
        self.stride, self.dtype = weight.stride(), weight.dtype
        self.nbytes = _packed_bytes(self.packed, weight)
        numel = weight.numel()
        step = max((numel - PIECE) // (PIECES - 1), 1)
        self.starts = sorted({min(i * step, max(numel - PIECE, 0)) for i in range(PIECES)})  # the sampled runs
        self.values = _bits(torch.cat(self.sample_views(weight))).clone()

    def sample_views(self, weight: torch.Tensor) -> list[torch.Tensor]:
        """Views of the sampled runs of `weight` (the one this copy was packed from)."""
        flat = weight.detach().view(-1)
        return [flat[s:s + PIECE] for s in self.starts]

    def same_storage(self, weight: torch.Tensor) -> bool:
        """`weight` is a view of the very storage this copy was packed from, at the same place, with the same shape,
        strides and dtype (its values may have changed)."""
        return (weight.untyped_storage()._cdata == self.storage.cdata and weight.data_ptr() == self.address
                and weight.shape == self.shape and weight.stride() == self.stride and weight.dtype is self.dtype)

    def matches(self, weight: torch.Tensor) -> bool:
        """`same_storage` and the same version: the weight is what this copy was packed from (then also still
        `weight_packable`, which is checked only when packing)."""
        return self.same_storage(weight) and _version(weight) == self.version


def _row_norm_max(weight: torch.Tensor, rows: int = 4096) -> float:
    """max_j ||weight[j]||_2 in float64 (a few thousand rows at a time: no float64 copy of a whole LM head)."""
    return max(float(weight[i:i + rows].double().norm(dim=1).max()) for i in range(0, weight.shape[0], rows))


def _packed_bytes(packed: torch.Tensor, weight: torch.Tensor) -> int:
    """The memory the packed copy takes: oneDNN pads small weights (a [1, 4096] bf16 weight's copy takes 256 KiB)."""
    if isinstance(packed, int8_head.Int8Head):
        return packed.nbytes
    if packed.dtype is torch.float32:  # a transposed copy: a plain tensor (or a view into joined ones)
        return packed.numel() * packed.element_size()
    try:
        return int(torch.ops.mkldnn._nbytes(packed))
    except (AttributeError, RuntimeError):
        return weight.numel() * weight.element_size()


def _bits(values: torch.Tensor) -> torch.Tensor:
    """Values as 16-bit patterns (bf16 / fp16: one per value, fp32: two): compared bit for bit (a NaN equals
    itself)."""
    return values.view(torch.int16)


def _version(weight: torch.Tensor) -> int:
    """The version counter (-1 for an inference tensor, which has none: such weights are never packed)."""
    return -1 if weight.is_inference() else weight._version


_COPIES: "weakref.WeakKeyDictionary[torch.nn.Module, PackedCopy]" = weakref.WeakKeyDictionary()
_INT8: "weakref.WeakKeyDictionary[torch.nn.Module, PackedCopy]" = weakref.WeakKeyDictionary()  # int8 head copies
_TRANSPOSED: "weakref.WeakKeyDictionary[torch.nn.Module, PackedCopy]" = weakref.WeakKeyDictionary()  # fp32 W^T


def _store(cast: torch.dtype | None) -> "weakref.WeakKeyDictionary[torch.nn.Module, PackedCopy]":
    """Where a module's copy of this kind lives: an fp32 head may hold a bf16, an int8 and a transposed copy at once
    (trials run them in turn); any other module holds one copy of each kind it takes."""
    return _INT8 if cast is torch.int8 else _TRANSPOSED if cast is TRANSPOSED else _COPIES


STORES = (_COPIES, _INT8, _TRANSPOSED)
EXTRA_STORES: list = []  # other modules' weak dicts of objects with `nbytes` (fused_layers): in the same budget


def _all_copies() -> list:
    return [c for store in (*STORES, *EXTRA_STORES) for c in list(store.values())]


_LOCK = threading.Lock()
_budget: list[int] = []  # bytes, fixed when the first copy is made


def _budget_bytes() -> int:
    if not _budget:
        from ..config import available_host_memory

        _budget.append(int(available_host_memory() * BUDGET_SHARE))
    return _budget[0]


def current_copy(module: torch.nn.Module, weight: torch.Tensor, cast=None) -> PackedCopy | None:
    """`module`'s copy of this kind if it matches `weight` as it is now, else None (makes nothing)."""
    if id(module) in THIS_THREAD.no_copies:
        return None
    copy = _store(cast).get(module)
    return copy if copy is not None and copy.matches(weight) else None


def copy_for(module: torch.nn.Module, weight: torch.Tensor, cast: torch.dtype | None = None) -> PackedCopy | None:
    """`module`'s packed copy of `weight` as it is now (packed again if it changed), or None: over the budget, or a
    weight the packed product does not take (`weight_packable`). `cast`: a copy in that dtype of an fp32 weight
    (`PackedCopy`); a module has one copy of each kind (`_store`)."""
    if id(module) in THIS_THREAD.no_copies:  # an adapter's base layer: its weight may change mid-forward
        return None
    store = _store(cast)
    copy = store.get(module)
    if copy is not None and copy.matches(weight):
        return copy
    if not weight_packable(weight, cast):
        return None
    with _LOCK:
        if copy is not None:
            store.pop(module, None)  # another thread (`forget`, another engine) may have dropped it meanwhile
        taken = sum(c.nbytes for c in _all_copies())
        if taken + weight.numel() * weight.element_size() > _budget_bytes():  # at least the weight's own size
            return None
        if cast is TRANSPOSED and (sum(c.nbytes for c in _TRANSPOSED.values()) + weight.numel() * 4
                                   > _budget_bytes() * TRANSPOSED_SHARE):
            return None
        try:
            copy = PackedCopy(weight, cast)
        except (RuntimeError, MemoryError) as error:  # oneDNN refused it or no memory for it: F.linear, as without
            _warn_once(f"hf_paged: no packed copy of a {tuple(weight.shape)} {weight.dtype} weight ({error}); "
                       f"its linear runs F.linear")
            return None
        if taken + copy.nbytes > _budget_bytes():  # padded beyond the budget: not kept
            return None
        store[module] = copy
        return copy


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def copies_of(cast) -> list[tuple[torch.nn.Module, PackedCopy]]:
    """(module, copy) for every live copy of this kind (`copy_for`'s `cast`)."""
    return list(_store(cast).items())


def forget(modules, casts: tuple = (None, torch.int8, TRANSPOSED)) -> int:
    """Drop the packed copies of `modules` (repacked on their next use); returns how many there were. `casts`: only
    the copies of these kinds (`copy_for`'s `cast`; None, the default kind, covers bf16 screens too)."""
    stores = {id(s): s for s in map(_store, casts)}.values()
    with _LOCK:
        dropped = [m for m in modules for store in stores if store.pop(m, None) is not None]
    return len(dropped)


def weight_packable(weight: torch.Tensor, cast: torch.dtype | None = None) -> bool:
    """A weight the packed product takes (checked when packing; a copy is used only while its weight `matches` it):
    a bf16, CPU, 2-D, contiguous `Parameter` held as such (not one recomputed on every call, as pruning or a
    parametrization makes it: that would repack on every call) and not an inference tensor (made under
    `torch.inference_mode()`: no version counter, so an in-place edit would go unseen unless it hit a sample).
    With `cast` (a bf16 screen of an fp32 weight, an int8 one of an fp32 or bf16 weight, TRANSPOSED: an fp32 one's
    transposed copy): such a weight, otherwise the same."""
    if cast is TRANSPOSED:
        dtype_ok = weight.dtype is torch.float32
    elif cast is None:
        dtype_ok = weight.dtype in DTYPES
    elif cast is torch.int8:
        dtype_ok = weight.dtype is torch.float32 or weight.dtype in DTYPES
    else:
        dtype_ok = weight.dtype is torch.float32 and cast in DTYPES
    return (isinstance(weight, torch.nn.Parameter) and dtype_ok and weight.is_cpu
            and weight.dim() == 2 and weight.is_contiguous() and type(weight.data) is torch.Tensor
            and not weight.is_inference())


def inputs_ok(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """What is checked on every call besides the copy (like `small_linear._kernel_takes`): rows of the weight's dtype
    on the CPU, a matching bias, no gradient wanted, no autocast."""
    return (rows.dtype is weight.dtype and rows.is_cpu
            and (bias is None or (bias.dtype is weight.dtype and bias.is_cpu and bias.shape == weight.shape[:1]
                                  and bias.is_contiguous()))  # oneDNN reads the bias as contiguous
            and not (torch.is_grad_enabled() and (rows.requires_grad or weight.requires_grad
                                                  or (bias is not None and bias.requires_grad)))
            and not torch.is_autocast_enabled("cpu"))


def _packed_product(rows: torch.Tensor, copy: PackedCopy, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(rows, copy.packed, bias, "none", [], "")


PACKED = "packed"  # the TABLE's product for the packed path: a marker, the call itself needs the module's copy
COPYING = frozenset({PACKED})  # its trial packs a few modules' weights only (trials.COPY_HOLDERS)


def _marker(*_args):  # pragma: no cover - never called: `_packed_linear` recognizes it
    raise AssertionError("the packed product's marker is not a product")


def _packed_linear(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's name
    """The measured choice between the packed product and F.linear for this shape, row bucket and thread count."""
    return _packed_or_plain(self, input, measured=True)


def _forced_packed_linear(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
    """HF_PAGED_PACKED_LINEARS=force: the packed product wherever it may run (memory budget and inputs allowing)."""
    return _packed_or_plain(self, input, measured=False)


def forward_for(mode_name: str):
    """The forward `small_linear.SmallBatchLinears` swaps in for a packable linear in `mode_name` ("auto"/"force")."""
    return _forced_packed_linear if mode_name == "force" else _packed_linear


def _packed_or_plain(self: torch.nn.Linear, input: torch.Tensor, measured: bool) -> torch.Tensor:  # noqa: A002
    weight, bias = self.weight, self.bias
    f_linear = torch.nn.functional.linear
    if id(self) not in THIS_THREAD.linears:
        return f_linear(input, weight, bias)
    shape = input.shape
    m = input.numel() // shape[-1] if shape and shape[-1] else 0
    if not 0 < m < len(BUCKET_OF) or shape[-1] != weight.shape[-1]:
        return f_linear(input, weight, bias)
    key = (weight.shape, weight.dtype, BUCKET_OF[m], torch.get_num_threads(), False)
    product = TABLE.fast.get(key) if measured else _marker
    if product is f_linear:
        return f_linear(input, weight, bias)
    rows = input.reshape(m, shape[-1])
    if not inputs_ok(rows, weight, bias):
        return f_linear(input, weight, bias)
    rows = rows if rows.is_contiguous() else rows.contiguous()
    if product is None:
        return _measured(self, key, rows, input)
    copy = copy_for(self, weight)
    if copy is None:  # over the memory budget, or a weight it does not take
        return f_linear(input, weight, bias)
    out = _packed_product(rows, copy, bias)
    return out if len(shape) == 2 else out.view(*shape[:-1], weight.shape[0])


def _measured(module: torch.nn.Module, key: tuple, rows: torch.Tensor, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
    """A call of `key` while it has no choice: packed (on a few modules' copies: trials.COPY_HOLDERS) or F.linear as
    its trial names, timed; a choice of F.linear drops the module's copy (a bucket choosing packed packs again)."""
    f_linear, bias = torch.nn.functional.linear, module.bias
    key = Key(tuple(key[0]), *key[1:])
    name, product = TABLE.pick(key, {PACKED: _marker, "f_linear": f_linear}, holder=id(module), copying=COPYING)
    copy = copy_for(module, module.weight) if product is _marker else None
    if name == trials.SKIP or (product is _marker and copy is None):
        return f_linear(input, module.weight, bias)
    if product is f_linear:
        run = lambda: f_linear(input, module.weight, bias)  # noqa: E731
    else:
        run = lambda: _packed_product(rows, copy, bias).view(*input.shape[:-1], module.weight.shape[0])  # noqa: E731
    out, decided = TABLE.timed(key, name, run)
    if decided and TABLE.fast.get(key) is f_linear:
        forget([module], (None,))  # its packed copy only (a bf16 LM head's int8 screen copy is greedy_head's)
    return out


class PackedLinears:
    """A model's bf16 linears that may take packed copies: `verify()` before each forward they may run in."""

    def __init__(self, modules: list[torch.nn.Module]):
        self.modules = modules
        self._seen: list = []  # weak references to the copies the joined sample below was built from
        self._views: list[torch.Tensor] = []  # views of those copies' weights (this engine's, between forwards)
        self._mixed = False  # whether those weights have more than one dtype
        self._values: torch.Tensor | None = None

    def verify(self) -> bool:
        """True when every packed copy's sample still holds its packed values; else drops all of this model's
        copies (they are packed again on use) and returns False. A copy whose weight now has other storage is
        dropped alone (it would be packed again on its next call anyway)."""
        live = [(m, c) for m in self.modules for store in STORES if (c := store.get(m)) is not None]
        moved = [m for m, c in live if not c.same_storage(m.weight)]
        if moved:
            forget(moved)
            live = [(m, c) for m, c in live if c.same_storage(m.weight)]
        if not live:
            self._seen, self._views, self._values = [], [], None
            return True
        if len(live) != len(self._seen) or any(ref() is not c for ref, (_, c) in zip(self._seen, live)):
            self._seen = [weakref.ref(c) for _, c in live]
            self._views = [v for m, c in live for v in c.sample_views(m.weight)]
            self._mixed = len({c.dtype for _, c in live}) > 1
            self._values = torch.cat([c.values for _, c in live])
        if not self._mixed:  # one dtype (the usual case): one cat, one view
            sampled = _bits(torch.cat(self._views))
        else:  # bf16 linears beside an fp32 head's screen (greedy_head): the bits of each view, then one cat
            sampled = torch.cat([_bits(v) for v in self._views])
        if torch.equal(sampled, self._values):
            return True
        self.forget()
        return False

    def forget(self) -> int:
        self._seen, self._views, self._values = [], [], None
        return forget(self.modules)
