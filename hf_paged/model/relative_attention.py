"""Attention modules with a learned relative-position bias (inkling), on the engine's packed steps.

Such a module adds to each score a bias by backward distance that every query mixes from a learned bank: query q
gets [H, E] relative logits (its `r_proj` rows times the bank), and key k the entry q - k of them (none from E
positions back). transformers' forward expands that into a dense [B, H, Q, K] `position_bias` over the positions of
its own cache (or of the forward's rows when it has none), which a packed step cannot use: its rows are several
sequences, and a decode's keys are in the pages. Its paged forward here (a `ModulePatches` adapter, installed with
the "paged" implementation) computes what transformers' does up to the attention call, then hands the per-query
relative logits to the paged attention as `relative_logits=` (attention/extras.py: `LayerExtras.relative_logits`,
applied at each query's and key's true positions by the torch backend). The projections and short convolutions are
the module's own (its `k_sconv` / `v_sconv` are state modules, patched on their own: `state_layers.state_forward`).
Full-attention layers' logarithmic logit scaling (`log_scaling_n_floor`) takes each row's position in its own
sequence (`sequence_positions`), as transformers' does for a sequence alone.

Invariant: nothing but the "paged" attention function sees `relative_logits`; the adapter runs only inside a paged
forward (the start-up check compares it with the model's own forward, `probe`).
"""
from __future__ import annotations

import torch

from .paged_forward import sequence_positions


def inkling_attention(module, owner):
    """InklingAttention.forward on a packed step (see the module doc); its output is the module's: (output, None)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = module.config

    def forward(hidden_states, attention_mask=None, conv_mask=None, cache=None, **kwargs):
        rows = hidden_states.shape[:-1]
        per_head = (*rows, -1, module.head_dim)
        query = module.q_norm(module.q_proj(hidden_states).view(per_head)).transpose(1, 2)
        key = module.k_sconv(module.k_proj(hidden_states), cache=cache, conv_mask=conv_mask)
        value = module.v_sconv(module.v_proj(hidden_states), cache=cache, conv_mask=conv_mask)
        key = module.k_norm(key.view(per_head)).transpose(1, 2)
        value = value.view(per_head).transpose(1, 2)
        relative = module.r_proj(hidden_states).view(*rows, module.num_heads, -1) @ module.rel_logits_proj.proj
        if not module.is_sliding and config.log_scaling_n_floor is not None:
            tau = log_scale(config, sequence_positions(owner.require_context(module).metadata))
            query = (query.float() * tau.view(1, 1, -1, 1)).to(query.dtype)
            relative = (relative.float() * tau.view(1, -1, 1, 1)).to(relative.dtype)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, None)
        out, weights = attend(module, query, key, value, attention_mask, dropout=0.0, scaling=module.scaling,
                              sliding_window=module.sliding_window, relative_logits=relative, **kwargs)
        return module.o_proj(out.reshape(*rows, -1).contiguous()), weights

    return forward


def log_scale(config, positions: torch.Tensor) -> torch.Tensor:
    """The factor a full-attention layer scales the logits of a query at `positions` by: 1 + alpha *
    log(max(1, (position + 1) / n_floor))."""
    ratio = (positions + 1).float() / config.log_scaling_n_floor
    return 1.0 + config.log_scaling_alpha * torch.log(ratio.clamp(min=1.0))


RELATIVE_ATTENTION = {"InklingAttention": inkling_attention}  # class name -> its paged forward


def relative_attention_modules(model: torch.nn.Module) -> list:
    """[(module, factory)] for the model's attention modules with a learned relative-position bias
    (RELATIVE_ATTENTION), for a `ModulePatches`."""
    return [(m, RELATIVE_ATTENTION[type(m).__name__]) for m in model.modules()
            if type(m).__name__ in RELATIVE_ATTENTION]
