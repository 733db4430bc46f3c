"""The KV tensors: per layer, K and V shaped [num_blocks, block_size, num_kv_heads, head_dim]."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger("hf_paged")


@dataclass(slots=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    def bytes_per_block(self, block_size: int) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * itemsize


class KVCache:
    """One allocation, viewed as `key_caches[layer]` / `value_caches[layer]` (NHD page layout, the
    one FlashAttention and FlashInfer read). Allocated with torch.empty: pages the engine never hands
    out are never touched, so they cost no resident memory on CPU."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, block_size: int):
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (spec.num_layers, 2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.storage = torch.empty(shape, dtype=spec.dtype, device=spec.device)
        self.key_caches = [self.storage[i, 0] for i in range(spec.num_layers)]
        self.value_caches = [self.storage[i, 1] for i in range(spec.num_layers)]
        # fp8 caches: per-layer (k_scale, v_scale), fixed from each layer's first K/V (see `scales_for`)
        self.quantized = self.storage.element_size() == 1
        self.kv_scales: list[tuple[float, float] | None] = [None if self.quantized else (1.0, 1.0)] * spec.num_layers
        logger.info("hf_paged KV cache: %d blocks x %d tokens, %.1f MiB on %s", num_blocks, block_size,
                    self.storage.numel() * self.storage.element_size() / 2**20, spec.device)

    def scales_for(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[float, float]:
        """A layer's fp8 scales: its first K/V's absolute maximum mapped to half the fp8 range (2x headroom;
        values beyond it saturate). Always (1.0, 1.0) for unquantized caches."""
        scales = self.kv_scales[layer]
        if scales is None:
            scales = tuple(max(float(t.abs().max()) / 224.0, 1e-6) for t in (key, value))
            self.kv_scales[layer] = scales
        return scales

    @property
    def num_bytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()


def choose_num_blocks(spec: KVCacheSpec, block_size: int, num_blocks: int | None, byte_budget: int) -> int:
    """`num_blocks` when given, else as many blocks as fit in `byte_budget`."""
    if num_blocks is not None:
        return num_blocks
    count = byte_budget // spec.bytes_per_block(block_size)
    if count < 1:
        raise ValueError(f"kv_cache_memory of {byte_budget} bytes holds no block of "
                         f"{spec.bytes_per_block(block_size)} bytes")
    return int(count)
