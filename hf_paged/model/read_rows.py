"""The last decoder layer of a Llama-coded causal LM computes, after its attention, only the rows the LM head reads.

In a prefill step the head reads one row a finished prompt (the engine's `logits_to_keep`), while every row's K/V
is needed. A decoder layer's work after its attention (o_proj, the residual adds, the second norm, the MLP) is row by
row, and in the model's last layer it feeds nothing but the final norm and the head, so for the rows the head does
not read it is never used. `forward_read_rows` computes the last layer's norm, q / k / v, rotary embedding and
attention for every row (the attention stores every row's K/V, as always) and the rest only for the rows read; the
other rows of its output hold the layer's input (finite values no one reads). On the benchmark's 8-layer model that
is ~10 % of a prefill step's products.

Invariants:
- Only where the model's own code guarantees that nothing else reads those rows: the model's class is Llama's causal
  LM and its `.model` Llama's base model (their forwards' code, transformers' known source: `layer_code`), the layer
  is the last one that forward runs (`layers[num_hidden_layers - 1]`) and Llama-coded (`layer_code.llama_parts`), the
  final norm RMSNorm-coded; and only while no hook, compiled call or tracing would see what the rows' skip changes:
  `layer_code.plain_calls` of the layer, its parts, the base model and the final norm (`watched`).
- Only when the step's `PagedForwardContext.rows_read` is set (the runner sets it exactly when it passes those rows
  as `logits_to_keep`) and is fewer rows than the step has; and only in the conditions `fused_layers` runs its own
  forwards in (no grad, no autocast, no `cache`, not training).
- The rows computed are computed as the class forward computes them (the same module forwards, called directly), so
  the read rows hold what they would; which rows were read is never changed. `HF_PAGED_READ_ROWS=0` turns it off.
"""
from __future__ import annotations

import os

import torch

from . import layer_code
from .fused_norms import is_llama_rms_norm


SWITCH = "HF_PAGED_READ_ROWS"


def mode() -> str:
    return "off" if os.environ.get(SWITCH, "").strip() == "0" else "on"


def last_layer(model: torch.nn.Module) -> tuple | None:
    """(layer, its `llama_parts`, the base model, the final norm) of a Llama-coded causal LM's last decoder layer
    whose projections are `nn.Linear`s; else None."""
    references = layer_code.references()
    base = getattr(model, "model", None)
    if references is None or not isinstance(base, torch.nn.Module):
        return None
    if not (layer_code.code_is(type(model), "LlamaForCausalLM") and layer_code.code_is(type(base), "LlamaModel")):
        return None
    layers, count = getattr(base, "layers", None), getattr(getattr(base, "config", None), "num_hidden_layers", None)
    norm = getattr(base, "norm", None)
    if not (isinstance(layers, torch.nn.ModuleList) and isinstance(count, int) and 0 < count <= len(layers)
            and isinstance(norm, torch.nn.Module) and is_llama_rms_norm(norm)):
        return None
    layer = layers[count - 1]
    parts = layer_code.llama_parts(layer)
    if parts is None or not all(type(m) is torch.nn.Linear for m in projections(parts)):
        return None
    return layer, parts, base, norm


def projections(parts: tuple) -> list[torch.nn.Module]:
    attention, mlp = parts[0], parts[1]
    return [attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj, mlp.gate_proj, mlp.up_proj,
            mlp.down_proj]


def watched(found: tuple) -> list:
    """Everything whose hooks (or compiled call) would see what skipping rows changes, or that is called directly."""
    layer, parts, base, norm = found
    return [layer, base, norm, *parts, parts[1].act_fn, *projections(parts)]


def unchanged(found: tuple) -> bool:
    """The layer still holds the parts found, the base model the layer and the norm."""
    layer, (attention, mlp, norm1, norm2, rotary), base, norm = found
    count = base.config.num_hidden_layers
    return (layer.self_attn is attention and layer.mlp is mlp and layer.input_layernorm is norm1
            and layer.post_attention_layernorm is norm2 and base.norm is norm and len(base.layers) >= count
            and base.layers[count - 1] is layer and layer_code.rotary_call(attention) is rotary
            and all(type(m) is torch.nn.Linear for m in projections(found[1])))


def takes(layer: torch.nn.Module, hidden_states: torch.Tensor, cache, kwargs: dict) -> torch.Tensor | None:
    """The rows the head reads when this call may compute only them (module docstring), else None."""
    context = kwargs.get("paged_context")
    rows_read = getattr(context, "rows_read", None)
    if rows_read is None or hidden_states.dim() != 3 or hidden_states.shape[0] != 1:
        return None
    if (rows_read.numel() >= hidden_states.shape[1] or cache is not None or "past_key_values" in kwargs
            or layer.training or torch.is_grad_enabled() or torch.is_autocast_enabled(hidden_states.device.type)):
        return None
    return rows_read


def attend(attention: torch.nn.Module, rotary, query, key, value, attention_mask, position_ids, use_cache,
           position_embeddings, kwargs) -> torch.Tensor:
    """Llama attention code's part between the projections and o_proj: q / k / v [B, T, heads * D] -> [B, T, H, D]."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import eager_attention_forward

    hidden_shape = (*query.shape[:-1], -1, attention.head_dim)
    query, key, value = (t.view(hidden_shape).transpose(1, 2) for t in (query, key, value))
    cos, sin = position_embeddings
    query, key = layer_code.call(rotary, query, key, cos, sin)
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(attention.config._attn_implementation, eager_attention_forward)
    out, _ = interface(attention, query, key, value, attention_mask, dropout=0.0, scaling=attention.scaling,
                       position_ids=position_ids, use_cache=use_cache, **kwargs)
    return out


def forward_read_rows(parts: tuple, rows_read: torch.Tensor, hidden_states, attention_mask, position_ids,
                      use_cache, position_embeddings, kwargs) -> torch.Tensor:
    """The last layer's output at `rows_read` (of the packed [1, T, hidden] step), the input elsewhere (with no row
    read: the input itself)."""
    attention, mlp, norm1, norm2, rotary = parts
    width = hidden_states.shape[-1]
    h = layer_code.call(norm1, hidden_states)
    q, k, v = (layer_code.call(p, h) for p in (attention.q_proj, attention.k_proj, attention.v_proj))
    out = attend(attention, rotary, q, k, v, attention_mask, position_ids, use_cache, position_embeddings, kwargs)
    if not rows_read.numel():  # a step of prompt chunks only: their K/V stored, nothing read
        return hidden_states
    flat = hidden_states.view(-1, width)
    read = out.reshape(flat.shape[0], -1).index_select(0, rows_read)[None]
    residual = flat.index_select(0, rows_read)[None] + layer_code.call(attention.o_proj, read)
    h = layer_code.call(mlp, layer_code.call(norm2, residual))
    return flat.index_copy(0, rows_read, (residual + h)[0]).view(hidden_states.shape)
