"""fp32 products through oneDNN's GEMM, a measured candidate of `small_linear` for every row count.

torch's fp32 `F.linear` on a CPU runs MKL's sgemm (torch routes it to oneDNN only where
`torch.set_float32_matmul_precision` allows reduced precision). MKL picks its code by CPU vendor: on the AMD EPYC
(Zen 5, AVX-512) of issue 27 one thread reaches ~100 GFLOP/s, its AVX2 rate, where oneDNN's fp32 GEMM
(`torch.ops.mkldnn._linear_pointwise`, what torch's own CPU freezing passes call) reaches 200-240 GFLOP/s on the same
products: 4,096 x 512 by 512 x 1,376 and 64 rows alike. On an Intel Xeon MKL is at the core's limit. So nothing is
assumed: it is one more candidate of `linear_choice`'s trials, timed in the model's own forwards against F.linear
(which it must beat by more than 5 %), per weight shape, row bucket and thread count.

Invariants:
- The same fp32 sums as F.linear's in another order, rounded like any other kernel choice: oneDNN's fp32 math mode is
  strict unless torch's float32 matmul precision allows less, and then F.linear runs oneDNN itself.
- Offered only where torch was built with oneDNN (`available`); each call checks that oneDNN is still enabled
  (`torch.backends.mkldnn.flags(enabled=False)` gets F.linear). The caller (`small_linear._measured_linear`) hands it
  only inputs `small_linear._kernel_takes` (fp32 CPU, contiguous rows, contiguous weight and bias, no gradient, no
  autocast). It reads the live weight and bias on every call: no copy, nothing to go stale.
- `HF_PAGED_ONEDNN_LINEARS=0`: not offered (choices already made in this process stay).
"""
from __future__ import annotations

import functools
import os

import torch

NAME = "onednn"
SWITCH = "HF_PAGED_ONEDNN_LINEARS"


def available() -> bool:
    """torch has oneDNN and the switch does not turn it off."""
    return os.environ.get(SWITCH, "1").strip() != "0" and _built()


@functools.lru_cache(maxsize=1)
def _built() -> bool:
    try:
        return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):  # pragma: no cover - a torch build without the op
        return False


def product(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """rows [m, k] @ weight [n, k]^T (+ bias [n]) -> [m, n] through oneDNN, or F.linear while oneDNN is disabled."""
    if not torch._C._get_mkldnn_enabled():
        return torch.nn.functional.linear(rows, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")


def many_row_products() -> dict:
    """The candidates of a product of more rows than the few-row kernels take (a prefill step's), in tie-break
    order."""
    products = {NAME: product} if available() else {}
    products.update(f_linear=torch.nn.functional.linear)
    return products
