"""What the backends on external kernel libraries share: FlashAttention-3 (`fa3.py`), FlashAttention-2 (`fa2.py`)
and FlashInfer (`flashinfer.py`). Each imports its library only when asked (`unavailable_reason` names the missing
package) and builds the library's arguments in a pure function (`fa3_arguments`, `fa2_arguments`,
`flashinfer_arguments`) that tests check without a GPU.

All three read the NHD pages of hf_paged/kv/cache.py in place ([num_blocks, block_size, H_kv, D] per layer and
K / V); the block tables, context lengths and cu_seqlens of `AttentionMetadata` are int32 already.
"""
from __future__ import annotations

import importlib
from types import ModuleType

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)


def import_first(*names: str) -> tuple[ModuleType | None, str | None]:
    """The first of `names` that imports, or (None, the last import error)."""
    error = None
    for name in names:
        try:
            return importlib.import_module(name), None
        except Exception as e:  # noqa: BLE001 - ImportError, or a broken build (OSError / RuntimeError at load)
            error = f"{name}: {type(e).__name__}: {e}"
    return None, error


def cuda_device_reason(device: torch.device, library: str, min_capability: tuple[int, int] = (8, 0),
                       max_major: int | None = None) -> str | None:
    """None when `device` is a CUDA device this library has kernels for."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"{library} runs on CUDA devices only (tensors are on {device.type})"
    if not torch.cuda.is_available():
        return f"{library} needs CUDA, and torch sees no CUDA device"
    capability = torch.cuda.get_device_capability(device)
    if capability < min_capability or (max_major is not None and capability[0] > max_major):
        return (f"{library} has no kernels for compute capability {capability[0]}.{capability[1]} "
                f"(needs >= {min_capability[0]}.{min_capability[1]}"
                + (f" and major <= {max_major})" if max_major is not None else ")"))
    return None


def common_unsupported_reason(library: str, query: torch.Tensor, key_cache: torch.Tensor,
                              head_dims: tuple[int, ...] | None = None, max_head_dim: int = 256) -> str | None:
    """dtype / head-size rules shared by the flash libraries."""
    if query.dtype not in HALF_DTYPES:
        return f"{library} takes float16 / bfloat16 queries, got {query.dtype}"
    if key_cache.dtype != query.dtype:
        return f"{library} is used here with the KV cache in the query dtype ({key_cache.dtype} cache, {query.dtype} query)"
    head_dim = query.shape[-1]
    if head_dims is not None and head_dim not in head_dims:
        return f"{library} is used for head_dim in {head_dims}, got {head_dim}"
    if head_dim > max_head_dim or head_dim % 8:
        return f"{library} needs head_dim a multiple of 8 and <= {max_head_dim}, got {head_dim}"
    if query.shape[1] % key_cache.shape[2]:
        return f"query heads ({query.shape[1]}) must be a multiple of KV heads ({key_cache.shape[2]})"
    if key_cache.stride(-1) != 1:
        return f"{library} needs the cache's head_dim contiguous"
    return None


def window_left(sliding_window: int | None) -> int:
    """hf_paged's window w keeps keys k > pos - w, i.e. pos - (w - 1) <= k <= pos: the libraries' left size w - 1."""
    return sliding_window - 1 if sliding_window else -1


def as_int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()
