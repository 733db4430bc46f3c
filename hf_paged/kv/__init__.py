"""Paged KV memory: block pool, block tables, KV tensors. Knows nothing about models or transformers."""
from .block_pool import NULL_BLOCK, Block, BlockPool, FreeBlockQueue
from .cache import KVCache, KVCacheSpec, choose_num_blocks
from .manager import KVCacheManager
from .tables import blocks_needed, held, released_prefix
from .paged_store import PagedKV, PagedStore

__all__ = ["NULL_BLOCK", "Block", "BlockPool", "FreeBlockQueue", "KVCache", "KVCacheSpec", "KVCacheManager", "PagedKV",
           "blocks_needed", "choose_num_blocks", "held", "PagedStore", "released_prefix"]
