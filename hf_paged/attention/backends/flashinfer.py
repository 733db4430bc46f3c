"""The `flashinfer` backend: `BatchDecodeWithPagedKVCacheWrapper` for decode-only steps,
`BatchPrefillWithPagedKVCacheWrapper` for steps with prefills (its causal mask is bottom-right aligned, so chunked
prefills attend to their cached prefix). Both read the NHD pages in place through FlashInfer's CSR page list, built
from the metadata:

    qo_indptr              int32 [B + 1]  = cu_seqlens_q
    paged_kv_indptr        int32 [B + 1]  cumulative pages per sequence, ceil(context_len / page_size)
    paged_kv_indices       int32 [sum]    each sequence's used block-table entries, concatenated
    paged_kv_last_page_len int32 [B]      tokens in each sequence's last page (1..page_size)

Any page size. `plan` runs once per step and wrapper configuration (window, soft-cap, scale, dtypes: Gemma-2
alternates two); every layer then calls `run`. Package: `flashinfer-python` (module `flashinfer`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..metadata import AttentionMetadata
from .base import AttentionBackend, StepCache
from .flash_common import as_int32, common_unsupported_reason, cuda_device_reason, import_first, window_left

LIBRARY = "FlashInfer"
HEAD_DIMS = (64, 128, 256)
WORKSPACE_BYTES = 128 * 1024 * 1024


def _library():
    module, error = import_first("flashinfer")
    if module is None:
        return None, f"{LIBRARY} is not installed ({error}); pip install flashinfer-python"
    return module, None


def page_list(metadata: AttentionMetadata) -> dict:
    """FlashInfer's CSR description of the pages. The indptrs and last-page lengths live on the host (plan reads
    them there: one device sync per step); the page indices stay on the device."""
    block_size = metadata.block_size
    context_lens = metadata.context_lens.to("cpu", torch.int64)
    pages = (context_lens + block_size - 1) // block_size
    kv_indptr = torch.zeros(len(pages) + 1, dtype=torch.int64)
    torch.cumsum(pages, 0, out=kv_indptr[1:])
    total = int(kv_indptr[-1])
    device = metadata.block_tables.device
    rows = torch.repeat_interleave(torch.arange(len(pages), device=device), pages.to(device), output_size=total)
    cols = torch.arange(total, device=device) - kv_indptr.to(device)[rows]
    indices = metadata.block_tables[rows, cols]
    return dict(qo_indptr=metadata.cu_seqlens_q.to("cpu", torch.int32),
                paged_kv_indptr=kv_indptr.to(torch.int32),
                paged_kv_indices=as_int32(indices),
                paged_kv_last_page_len=(context_lens - (pages - 1) * block_size).to(torch.int32))


def flashinfer_arguments(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         metadata: AttentionMetadata, scale: float, sliding_window: int | None,
                         softcap: float | None, pages: dict | None = None) -> dict:
    """{"decode": which wrapper, "use_tensor_cores": decode wrapper option, "plan": (args, kwargs) of plan,
    "run": (args, kwargs) of run} for one layer of one step. `pages`: `page_list(metadata)`, passed by a caller
    that keeps it for the step's other layers."""
    pages = pages or page_list(metadata)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, page_size = key_cache.shape[2], key_cache.shape[1]
    decode = metadata.max_query_len == 1
    common = dict(window_left=window_left(sliding_window), logits_soft_cap=float(softcap or 0.0),
                  q_data_type=query.dtype, kv_data_type=key_cache.dtype, sm_scale=float(scale))
    if decode:
        args = (pages["paged_kv_indptr"], pages["paged_kv_indices"], pages["paged_kv_last_page_len"], num_heads,
                num_kv_heads, head_dim, page_size)
        kwargs = dict(pos_encoding_mode="NONE", **common)
    else:
        args = (pages["qo_indptr"], pages["paged_kv_indptr"], pages["paged_kv_indices"],
                pages["paged_kv_last_page_len"], num_heads, num_kv_heads, head_dim, page_size)
        kwargs = dict(causal=True, pos_encoding_mode="NONE", **common)
    return {"decode": decode, "use_tensor_cores": num_heads // num_kv_heads > 4, "plan": (args, kwargs),
            "run": ((query.contiguous(), (key_cache, value_cache)), {})}


@dataclass(slots=True)
class PlannedWrapper:
    """A FlashInfer wrapper and the step metadata it was last planned for (None: not yet)."""

    wrapper: Any
    planned_for: AttentionMetadata | None = None


class FlashInferBackend(AttentionBackend):
    """Per-object state: `pages` (the step's CSR page list, built by its first layer), `workspace` (one buffer,
    shared by the wrappers: only used during run, and runs are ordered on the stream) and `wrappers` (one per
    (decode, tensor cores, plan configuration), kept across steps and planned once per step)."""

    name = "flashinfer"

    def __init__(self):
        self.library, self.missing = _library()
        self.pages = StepCache()
        self.workspace: torch.Tensor | None = None
        self.wrappers: dict[tuple, PlannedWrapper] = {}

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        _, reason = _library()
        return reason or cuda_device_reason(device, LIBRARY, min_capability=(8, 0))

    def layout_reason(self, query, key_cache, metadata, sliding_window, softcap) -> str | None:
        return common_unsupported_reason(LIBRARY, query, key_cache, head_dims=HEAD_DIMS)

    def _wrapper(self, device: torch.device, decode: bool, use_tensor_cores: bool, plan_key: tuple) -> PlannedWrapper:
        key = (decode, use_tensor_cores, plan_key)
        if key not in self.wrappers:
            if self.workspace is None:
                self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            if decode:
                wrapper = self.library.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                                          use_tensor_cores=use_tensor_cores)
            else:
                wrapper = self.library.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
            self.wrappers[key] = PlannedWrapper(wrapper)
        return self.wrappers[key]

    def forward(self, query, key_cache, value_cache, metadata: AttentionMetadata, scale, sliding_window, softcap,
                key=None, value=None, kv_scales=(1.0, 1.0), extras=None) -> torch.Tensor:
        self.check_extras(extras)
        if self.library is None:
            raise RuntimeError(self.missing)
        pages = self.pages.get(metadata, "pages", lambda: page_list(metadata))
        arguments = flashinfer_arguments(query, key_cache, value_cache, metadata, scale, sliding_window, softcap,
                                         pages)
        plan_args, plan_kwargs = arguments["plan"]
        plan_key = (plan_args[-4:], tuple(sorted((k, str(v)) for k, v in plan_kwargs.items())))  # heads, dims, page
        entry = self._wrapper(query.device, arguments["decode"], arguments["use_tensor_cores"], plan_key)
        if entry.planned_for is not metadata:  # first layer of the step with this configuration
            entry.wrapper.plan(*plan_args, **plan_kwargs)
            entry.planned_for = metadata
        run_args, run_kwargs = arguments["run"]
        return entry.wrapper.run(*run_args, **run_kwargs)
