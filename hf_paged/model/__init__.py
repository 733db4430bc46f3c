"""How the engine drives a transformers model: what it is (`describe_model` / `ModelSpec`) and the "paged"
attention function that reads and writes the KV pages during one packed forward pass; plus "paged_cache", the sdpa
attention that reads a `PagedCache`'s pages in place in transformers' own loop."""
from . import cache_attention, expert_products, fp32_attention, paged_forward, switches
from .cache_attention import CACHE_ATTENTION_NAME
from .expert_products import ExpertProducts
from .forward_lock import forward_lock
from .fused_layers import FusedLayers
from .fused_norms import FusedNorms
from .fused_rotary import FusedRotary
from .paged_forward import PagedForwardContext, attention_implementation, paged_attention_active, position_takers
from .probe import check_paged_matches_model
from .small_linear import SmallBatchLinears
from .spec import ModelSpec, describe_model
from .step_choice import StepChoice
from .switches import HfPagedDisabled, require_enabled


def register() -> None:
    """Register "paged" (the engine's), "paged_cache" (HF's loop on a PagedCache) and the start-up check's float32
    reference attentions with transformers; wrap its mixture experts' grouped product (expert_products)."""
    paged_forward.register()
    cache_attention.register()
    fp32_attention.register()
    expert_products.register()


def unregister() -> None:
    paged_forward.unregister()
    cache_attention.unregister()
    fp32_attention.unregister()
    expert_products.unregister()


__all__ = ["CACHE_ATTENTION_NAME", "check_paged_matches_model", "ExpertProducts", "FusedLayers", "FusedNorms",
           "FusedRotary", "SmallBatchLinears", "ModelSpec", "describe_model",
           "HfPagedDisabled", "PagedForwardContext", "attention_implementation", "forward_lock",
           "paged_attention_active", "position_takers", "register", "require_enabled", "switches", "unregister"]
