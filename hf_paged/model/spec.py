"""What the engine needs to know about a transformers model, and whether it can serve it at all."""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from ..kv import KVCacheSpec

SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention"}


@dataclass(slots=True)
class ModelSpec:
    kv: KVCacheSpec
    max_model_len: int | None
    vocab_size: int
    accepts_logits_to_keep: bool
    configs: list  # every config object whose `_attn_implementation` the forward reads


def describe_model(model: torch.nn.Module) -> ModelSpec:
    """Refuse what the config already shows cannot be paged (encoder-decoder, layers other than full or sliding
    attention), and read the KV shapes. Whether the model's attention really goes through transformers'
    AttentionInterface, with those shapes and nothing the paged function ignores, is decided by what it does:
    `probe.check_paged_matches_model` runs it once. Raises ValueError naming the model type and the reason."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "generation_config"):
        raise ValueError(f"{type(model).__name__} is not a transformers generative model")
    model_type = getattr(config, "model_type", type(model).__name__)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"model type {model_type!r} is encoder-decoder; hf_paged serves decoder-only models")
    text = config.get_text_config(decoder=True)
    layer_types = getattr(text, "layer_types", None) or []
    odd = sorted(set(layer_types) - SUPPORTED_LAYER_TYPES)
    if odd:
        raise ValueError(f"model type {model_type!r} has layers of type {odd}; hf_paged supports only "
                         f"full and sliding-window attention layers (no linear attention / state-space layers)")
    num_heads = getattr(text, "num_attention_heads", None)
    num_layers = getattr(text, "num_hidden_layers", None)
    hidden = getattr(text, "hidden_size", None)
    if not num_heads or not num_layers or not hidden:
        raise ValueError(f"model type {model_type!r} config lacks attention heads / layers / hidden size")
    num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
    head_dim = getattr(text, "head_dim", None) or hidden // num_heads
    param = next(model.parameters())
    configs = [config] + ([text] if text is not config else [])
    forward_params = inspect.signature(model.forward).parameters
    return ModelSpec(
        kv=KVCacheSpec(num_layers, num_kv_heads, head_dim, param.dtype, param.device),
        max_model_len=getattr(text, "max_position_embeddings", None),
        vocab_size=text.vocab_size,
        accepts_logits_to_keep="logits_to_keep" in forward_params,
        configs=configs,
    )
