"""The KV tensors: per layer, K and V shaped [num_blocks, block_size, kv_heads, head_size].

A layer's K and V are stored with one head size, the larger of the two (a model whose V heads are smaller or larger
than its K heads, e.g. mimo_v2_flash, stores the smaller zero-padded: attention over zero-padded heads is exact, see
model/kv_shapes.py). Layers whose page shapes differ (mimo_v2_flash's sliding layers have twice the K/V heads of
its full ones) view the same storage with their own shapes: a block id holds, per layer tensor, the largest page any
layer needs, and a smaller layer's page is its first part (`KVCache._pages`: views strided by the largest page; of
the attention backends only the torch one reads such strided pages, the others give way to it)."""
from __future__ import annotations

import hashlib
import logging
import math
import struct
from dataclasses import dataclass

import torch

from .groups import KVGroup, group_size

logger = logging.getLogger("hf_paged")


@dataclass(slots=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    # the layers that keep K/V (None: every layer); the others (state layers of a hybrid stack) get no pages
    attention_layers: tuple[int, ...] | None = None
    # how the attention layers share block tables (kv/groups.py); None: one group of them all, full attention
    groups: tuple[KVGroup, ...] | None = None
    # layer -> (K/V heads, size of K, size of V) as the layer produces them; a layer not named here: (num_kv_heads,
    # head_dim, head_dim)
    layer_shapes: dict[int, tuple[int, int, int]] | None = None
    # the stored "layers" are the attention calls of a forward in their order, not the modules' layer indices (a
    # block shared by several layers: zamba; several calls per layer: diffllama; model/kv_shapes.number_calls)
    by_call: bool = False

    @property
    def stored_layers(self) -> tuple[int, ...]:
        return tuple(range(self.num_layers)) if self.attention_layers is None else self.attention_layers

    @property
    def kv_groups(self) -> tuple[KVGroup, ...]:
        if self.groups is not None:
            return self.groups
        return (KVGroup(self.stored_layers),) if self.stored_layers else ()

    @property
    def num_tensors(self) -> int:
        """Layer tensors of the storage: every stored layer's own with one group, a group's worth with several."""
        return group_size(self.kv_groups)

    def positions(self) -> dict[int, tuple[int, int]]:
        """layer -> (its group, its tensor in the storage)."""
        return {layer: (g, i) for g, group in enumerate(self.kv_groups) for i, layer in enumerate(group.layers)}

    def kv_shape(self, layer: int) -> tuple[int, int, int]:
        """(heads, size of K, size of V) as layer `layer` produces them."""
        shapes = self.layer_shapes or {}
        return shapes.get(layer, (self.num_kv_heads, self.head_dim, self.head_dim))

    def page_shape(self, layer: int) -> tuple[int, int]:
        """(heads, head size) of layer `layer`'s stored K and V: the larger of its K and V sizes."""
        heads, k_size, v_size = self.kv_shape(layer)
        return heads, max(k_size, v_size)

    @property
    def uniform(self) -> bool:
        """Whether every stored layer keeps pages of one shape (then each layer's K / V is a contiguous tensor)."""
        return len({self.page_shape(layer) for layer in self.stored_layers}) <= 1

    def page_elements(self, block_size: int) -> int:
        """Elements of one layer's K (or V) page in a block id: the largest any stored layer needs."""
        shapes = [self.page_shape(layer) for layer in self.stored_layers] or [(self.num_kv_heads, self.head_dim)]
        return block_size * max(heads * size for heads, size in shapes)

    def bytes_per_block(self, block_size: int) -> int:
        """Bytes of one block id (K and V of `num_tensors` layers)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_tensors * self.page_elements(block_size) * itemsize

    def blocks_for_layer_blocks(self, num_blocks: int) -> int:
        """Block ids holding the memory of `num_blocks` blocks of every stored layer (what `num_blocks` has always
        meant to users: with several groups an id holds fewer layers, so there are more ids in that memory)."""
        if self.num_tensors in (0, len(self.stored_layers)):
            return num_blocks
        return num_blocks * len(self.stored_layers) // self.num_tensors


class KVCache:
    """One allocation, viewed as `key_caches[layer]` / `value_caches[layer]` (NHD page layout, the
    one FlashAttention and FlashInfer read; None for a layer that keeps no K/V). With several KV groups, layers of
    different groups share a tensor (a block id belongs to one group at a time: see kv/groups.py). Allocated with torch.empty: pages
    the engine never hands out are never touched, so they cost no resident memory on CPU."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, block_size: int):
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._allocate()
        self.released = False  # `release` gave the memory back
        # fp8 caches: per-layer (k_scale, v_scale), fixed once by `set_scales` before the first K/V is stored (the
        # engine calibrates them at start, model/kv_calibration.py); unquantized caches: always (1.0, 1.0)
        self.quantized = self.storage.element_size() == 1
        self.kv_scales: list[tuple[float, float] | None] = [None if self.quantized else (1.0, 1.0)] * spec.num_layers
        self._fingerprint: tuple[tuple, str] | None = None
        logger.info("hf_paged KV cache: %d blocks x %d tokens, %.1f MiB on %s", num_blocks, self.block_size,
                    self.num_bytes / 2**20, spec.device)

    def _allocate(self) -> None:
        """The storage and every layer's view of it (contents undefined)."""
        spec, num_blocks, block_size = self.spec, self.num_blocks, self.block_size
        if spec.uniform:  # [tensors, K | V, blocks, block_size, heads, head size]
            first = spec.stored_layers[0] if spec.stored_layers else None
            heads, size = spec.page_shape(first) if first is not None else (spec.num_kv_heads, spec.head_dim)
            shape: tuple[int, ...] = (spec.num_tensors, 2, num_blocks, block_size, heads, size)
        else:  # [tensors, K | V, blocks, elements of the largest page]: each layer views it with its own shape
            shape = (spec.num_tensors, 2, num_blocks, spec.page_elements(block_size))
        self.storage = torch.empty(shape, dtype=spec.dtype, device=spec.device)
        self.key_caches: list[torch.Tensor | None] = [None] * spec.num_layers
        self.value_caches: list[torch.Tensor | None] = [None] * spec.num_layers
        self.layer_group: list[int] = [-1] * spec.num_layers  # layer -> its KV group (-1: keeps no K/V)
        for layer, (group, i) in spec.positions().items():
            self.key_caches[layer], self.value_caches[layer] = (self._pages(self.storage[i, kind], layer)
                                                                for kind in (0, 1))
            self.layer_group[layer] = group

    def release(self) -> None:
        """Give the memory back (the tensors become empty; every layer's view None): `restore` takes it again, with
        undefined contents. Whoever releases must hold no K/V it will read again (an idle engine, no prefix cache)."""
        self.storage = self.storage.new_empty(0)
        self.key_caches = [None] * self.spec.num_layers
        self.value_caches = [None] * self.spec.num_layers
        self.released = True

    def restore(self) -> None:
        """Allocate the memory `release` gave back (same shapes, undefined contents)."""
        if self.released:
            self._allocate()
            self.released = False

    def _pages(self, tensor: torch.Tensor, layer: int) -> torch.Tensor:
        """`tensor` (one K or V of the storage) as layer `layer`'s pages [blocks, block_size, heads, head size]."""
        if tensor.dim() == 4:
            return tensor
        heads, size = self.spec.page_shape(layer)
        return tensor.as_strided((self.num_blocks, self.block_size, heads, size),
                                 (tensor.stride(0), heads * size, size, 1), tensor.storage_offset())

    def set_scales(self, scales: list[tuple[float, float]]) -> None:
        """Fix an fp8 cache's per-layer (k_scale, v_scale): stored = value / scale, saturated to the fp8 range.
        K/V already stored were quantized with the old scales: whoever changes them after serving started must
        drop those (their prefix-cache keys hold `scales_fingerprint()`) and any CUDA graph that baked them in."""
        if not self.quantized:
            raise ValueError(f"a {self.spec.dtype} KV cache is not scaled")
        pairs = [tuple(float(s) for s in pair) for pair in scales]
        if len(pairs) != self.spec.num_layers or any(len(p) != 2 for p in pairs):
            raise ValueError(f"need one (k_scale, v_scale) pair per layer ({self.spec.num_layers}), got {scales!r}")
        if not all(math.isfinite(s) and s > 0 for p in pairs for s in p):
            raise ValueError(f"fp8 KV scales must be finite and positive, got {pairs!r}")
        self.kv_scales = pairs

    def scales_for(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[float, float]:
        """A layer's (k_scale, v_scale) for storing and reading `key` / `value` (what it stores does not change
        them; the calibration forward overrides this to see every layer's K/V). (1.0, 1.0) for unquantized caches."""
        scales = self.kv_scales[layer]
        if scales is None:
            raise RuntimeError("this fp8 KV cache has no scales yet: KVCache.set_scales must fix them before the "
                               "first K/V is stored")
        return scales

    def scales_fingerprint(self) -> str:
        """A short digest of every layer's scales, part of what produced the cached K/V (for prefix-cache keys): the
        same scales give the same string in every process, any change gives another. "" for unquantized caches."""
        if not self.quantized:
            return ""
        current = tuple(self.kv_scales)
        if self._fingerprint is None or self._fingerprint[0] != current:
            data = b"".join(struct.pack("<dd", *pair) if pair is not None else b"unset" for pair in current)
            self._fingerprint = (current, hashlib.sha256(data).hexdigest()[:16])
        return self._fingerprint[1]

    @property
    def num_bytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()


NO_KV_BLOCKS = 4096  # the pool of a model without attention layers (its blocks hold nothing)


def choose_num_blocks(spec: KVCacheSpec, block_size: int, num_blocks: int | None, byte_budget: int) -> int:
    """Block ids: the memory of `num_blocks` blocks of every layer when given, else as many as fit in `byte_budget`."""
    if num_blocks is not None:
        return spec.blocks_for_layer_blocks(num_blocks)
    if not spec.stored_layers:  # state layers only: blocks are bookkeeping (token counts), they hold no memory
        return NO_KV_BLOCKS
    count = byte_budget // spec.bytes_per_block(block_size)
    if count < 1:
        raise ValueError(f"kv_cache_memory of {byte_budget} bytes holds no block of "
                         f"{spec.bytes_per_block(block_size)} bytes")
    return int(count)
