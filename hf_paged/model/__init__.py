"""How the engine drives a transformers model: what it is (`describe_model` / `ModelSpec`) and the "paged"
attention function that reads and writes the KV pages during one packed forward pass."""
from .paged_forward import (PagedForwardContext, forward_lock, paged_attention_active, position_takers, register,
                            unregister)
from .probe import check_paged_matches_model
from .small_linear import SmallBatchLinears
from .spec import ModelSpec, describe_model

__all__ = ["check_paged_matches_model", "SmallBatchLinears", "ModelSpec", "describe_model", "PagedForwardContext", "forward_lock", "paged_attention_active", "position_takers", "register", "unregister"]
