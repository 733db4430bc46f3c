"""The last decoder layer of a Llama-family causal LM computes, after its attention, only the rows the LM head reads.

In a prefill step the head reads one row a finished prompt (the engine's `logits_to_keep`), while every row's K/V
is needed. A Llama-coded decoder layer's work after its attention (the residual adds, the second norm, the MLP) is
row by row, and in the model's last layer it feeds nothing but the final norm and the head, so for the rows the head
does not read it is never used. `forward_read_rows` runs the last layer's input norm and attention module on every
row (the attention stores every row's K/V, as always) and the rest only on the rows read; the other rows of its output
hold the layer's input (finite values no one reads). On the benchmark's 8-layer model that is ~9 % of a prefill
step's products.

Invariants:
- Only where the model's own code guarantees that nothing else reads those rows: the model's class forward is
  transformers' Llama causal-LM code (but for its docstring: Mistral's, Qwen2's, Qwen3's, ... are the same), its
  `.model`'s forward one of the known base-model sources (`KNOWN_BASES`, transformers 5.25's: the layers' output goes
  only through `self.norm` into `last_hidden_state`); the layer is the last one that forward runs
  (`layers[num_hidden_layers - 1]`) with Llama's decoder-layer code, its MLP Llama's MLP code, its post-attention norm
  and the final norm RMSNorm-coded; and only while no hook, compiled call or tracing would see fewer rows or another
  output: `layer_code.plain_calls` of the layer, the base model, the final norm, the post-attention norm and every
  module of the MLP (`watched`). The input norm and the attention module are called as the class forward calls them.
- Only when the step's `PagedForwardContext.rows_read` is set (the runner sets it exactly when it passes those rows
  as `logits_to_keep`) and is fewer rows than the step has; no grad, no autocast, no `cache`, not training.
- The rows computed are computed by the class code's own calls, so the read rows hold what they would; which rows
  were read is never changed. `HF_PAGED_READ_ROWS=0` turns it off.
"""
from __future__ import annotations

import functools
import inspect
import os

import torch

from . import layer_code
from .fused_norms import is_llama_rms_norm

# source hashes (layer_code.source_hash) of transformers 5.25's base-model forwards whose decoder layers' output goes
# only through `self.norm` into `last_hidden_state`
KNOWN_BASES = {"139ef35b1e72fbfb": "Llama, Olmo2", "f4a474ad64c136c5": "Mistral, Phi3",
               "210c1be21732efdd": "Qwen2, Qwen3, SmolLM3"}
SWITCH = "HF_PAGED_READ_ROWS"


def mode() -> str:
    return "off" if os.environ.get(SWITCH, "").strip() == "0" else "on"


@functools.lru_cache(maxsize=None)
def _base_known(forward) -> bool:
    try:
        return layer_code.source_hash(inspect.unwrap(forward)) in KNOWN_BASES
    except (OSError, TypeError):
        return False


def last_layer(model: torch.nn.Module) -> tuple | None:
    """(last decoder layer, base model, final norm, the layer's MLP, its post-attention norm) where the module
    docstring's code checks hold; else None."""
    base = getattr(model, "model", None)
    if layer_code.references() is None or not isinstance(base, torch.nn.Module):
        return None
    if not (layer_code.code_is(type(model), "LlamaForCausalLM", docstring=False)
            and _base_known(getattr(type(base), "forward", None))):
        return None
    layers, count = getattr(base, "layers", None), getattr(getattr(base, "config", None), "num_hidden_layers", None)
    norm = getattr(base, "norm", None)
    if not (isinstance(layers, torch.nn.ModuleList) and isinstance(count, int) and 0 < count <= len(layers)
            and isinstance(norm, torch.nn.Module) and is_llama_rms_norm(norm)):
        return None
    layer = layers[count - 1]
    if not layer_code.code_is(type(layer), "LlamaDecoderLayer"):
        return None
    mlp, norm2 = getattr(layer, "mlp", None), getattr(layer, "post_attention_layernorm", None)
    if not (isinstance(mlp, torch.nn.Module) and layer_code.code_is(type(mlp), "LlamaMLP")
            and isinstance(norm2, torch.nn.Module) and is_llama_rms_norm(norm2)):
        return None
    return layer, base, norm, mlp, norm2


def watched(found: tuple) -> list:
    """Every module whose hooks (or compiled call) would see what skipping rows changes."""
    layer, base, norm, mlp, norm2 = found
    return [layer, base, norm, norm2, *mlp.modules()]


def unchanged(found: tuple) -> bool:
    """The layer still holds the MLP and norm found, and the base model the layer and the final norm; the MLP's
    projections are plain `nn.Linear`s of plain tensors (a quantized or adapted projection might compute a row from
    other rows, e.g. with one activation scale for the whole step)."""
    layer, base, norm, mlp, norm2 = found
    count = base.config.num_hidden_layers
    return (layer.mlp is mlp and layer.post_attention_layernorm is norm2 and base.norm is norm
            and len(base.layers) >= count and base.layers[count - 1] is layer
            and all(type(m) is torch.nn.Linear and type(m.weight.data) is torch.Tensor
                    for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)))


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


def forward_read_rows(layer: torch.nn.Module, rows_read: torch.Tensor, hidden_states, attention_mask, position_ids,
                      use_cache, position_embeddings, kwargs) -> torch.Tensor:
    """Llama's decoder-layer code with every row through the input norm and the attention module and only
    `rows_read` (of the packed [1, T, hidden] step) after them; the input's rows elsewhere (with no row read: the
    input itself)."""
    h = layer.input_layernorm(hidden_states)
    h, _ = layer.self_attn(hidden_states=h, attention_mask=attention_mask, position_ids=position_ids, cache=None,
                           use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
    if not rows_read.numel():  # a step of prompt chunks only: their K/V stored, nothing read
        return hidden_states
    width = hidden_states.shape[-1]
    flat = hidden_states.reshape(-1, width)  # a view of the (contiguous) step; a copy of any other layout
    residual = flat.index_select(0, rows_read)[None] + h.reshape(-1, width).index_select(0, rows_read)[None]
    out = residual + layer.mlp(layer.post_attention_layernorm(residual))
    return flat.index_copy(0, rows_read, out[0]).view(hidden_states.shape)
