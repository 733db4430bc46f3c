"""x @ (a transposed copy of W): the fp32 few-row product that needs a copy of its weight (`small_linear`'s candidate
"wt_copy").

F.linear multiplies rows x by W^T as a transposed operand, which MKL repacks on every call; for the few rows of a
decode step that is a second pass over a weight the step meets cold. With W^T kept contiguous ([in, out]) the same
product is MKL's plain one. Measured in `small_linear`'s trials like its other candidates, so it is used only where it
wins on the machine, for the weight's shape, row bucket and thread count.

Invariants:
- The copy is `packed_linear.copy_for(module, weight, TRANSPOSED)`: made from the weight as it is now, used only while
  the weight matches it (storage, version counter, sampled entries before each forward), inside the copies' memory
  budget; `HF_PAGED_PACKED_LINEARS=0` turns it off (then the candidate is not offered, and a choice of it already made
  runs F.linear).
- A trial call that names it for a module that cannot have a copy (memory budget; an adapter's base layer, whose
  weight PEFT may rewrite mid-forward: `packed_linear`) runs F.linear and records the candidate as unavailable for
  the trial (infinitely slow: dropped), so trials always end.
- Copies are made only by calls that run this product (trials and choices): once a row bucket's choice is made, the
  copies of that weight shape are dropped unless some bucket of the shape chose them.
- The sums are F.linear's in another order (like the kernel's): rounding, never different terms.
"""
from __future__ import annotations

import torch

from . import packed_linear
from .linear_choice import TABLE

NAME = "wt_copy"


def MARKER(*_args):  # noqa: N802 - a constant for identity checks  # pragma: no cover - never called
    """The table's entry for this product: the call itself needs its module's copy (`product`)."""
    raise AssertionError("the transposed copy's marker is not a product")


def copy_of(module: torch.nn.Module, weight: torch.Tensor) -> packed_linear.PackedCopy | None:
    """`module`'s transposed copy of `weight` (made now if needed), or None: switched off, over the budget, or a
    weight it does not take."""
    if packed_linear.mode() == "off":
        return None
    return packed_linear.copy_for(module, weight, packed_linear.TRANSPOSED)


def multiply(rows: torch.Tensor, copy: packed_linear.PackedCopy, bias: torch.Tensor | None) -> torch.Tensor:
    """rows [m, k] @ copy [k, n] (+ bias) -> [m, n]."""
    return torch.mm(rows, copy.packed) if bias is None else torch.addmm(bias, rows, copy.packed)


def product(module: torch.nn.Module, rows: torch.Tensor, weight: torch.Tensor,
            bias: torch.Tensor | None) -> torch.Tensor:
    """The chosen product for one call; F.linear where the copy cannot be had."""
    copy = packed_linear.current_copy(module, weight, packed_linear.TRANSPOSED)  # the usual case: one lookup
    if copy is None:
        copy = copy_of(module, weight)
    if copy is None:
        return torch.nn.functional.linear(rows, weight, bias)
    return multiply(rows, copy, bias)


def drop_unchosen(shape: tuple) -> int:
    """Forget the transposed copies of weights of `shape` unless some row bucket's choice for fp32 weights of that
    shape is this product; returns how many were dropped."""
    shape = tuple(shape)
    if any(tuple(key[0]) == shape and key[1] is torch.float32 and chosen is MARKER
           for key, chosen in list(TABLE.fast.items())):
        return 0
    modules = [m for m, copy in packed_linear.copies_of(packed_linear.TRANSPOSED) if tuple(copy.shape) == shape]
    return packed_linear.forget(modules, (packed_linear.TRANSPOSED,))
