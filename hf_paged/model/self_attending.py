"""Paged forwards for attention modules that compute attention themselves instead of calling transformers'
AttentionInterface (bloom and mpt add ALiBi inside the module; gpt_neo, xglm, mvp, trocr use their own bmm): each
replaces the module's forward for one paged step (installed by `paged_forward.ModulePatches`), running the module's
own projections and then `attend_paged` with what the module would have added (ALiBi slopes, a window, its scale)."""
from __future__ import annotations

import torch

from ..attention import LayerExtras
from .paged_forward import ModulePatches, UnsupportedAttention, _model_type, attend_paged


def _heads_first(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[1, T, H * D] or [1, T, H, D] -> [1, H, T, D]."""
    return x.reshape(x.shape[0], x.shape[1], num_heads, -1).transpose(1, 2)


def bloom_attention(module, owner: ModulePatches):
    """BloomAttention.forward on the paged cache: fused QKV per head, ALiBi slopes (times the module's beta) added to
    scaled scores, then the dense projection and the residual as the module does it."""
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes, dropout_add

    if module.pretraining_tp > 1 and module.slow_but_exact:
        raise UnsupportedAttention("model type 'bloom': slow_but_exact tensor-parallel attention is not supported")

    def forward(hidden_states, residual, alibi=None, attention_mask=None, layer_past=None, use_cache=False,
                output_attentions=False, **kwargs):
        batch, length, _ = hidden_states.shape
        fused = module.query_key_value(hidden_states).view(batch, length, module.num_heads, 3, module.head_dim)
        q, k, v = (fused[..., i, :].transpose(1, 2) for i in range(3))
        slopes = _get_alibi_slopes(module.num_heads, hidden_states.device) * module.beta
        out = attend_paged(module, q, k, v, owner.require_context(module), module.inv_norm_factor,
                           extras=LayerExtras(alibi_slopes=slopes))
        output = module.dense(out.reshape(batch, length, -1))
        return dropout_add(output, residual, module.hidden_dropout, module.training), None

    return forward


def mpt_attention(module, owner: ModulePatches):
    """MptAttention.forward on the paged cache: clipped fused QKV, ALiBi slopes read off the bias the model passes
    (slope * (k - last)), then the output projection."""
    def forward(hidden_states, position_bias=None, cache=None, attention_mask=None, **kwargs):
        mixed = module.Wqkv(hidden_states)
        if module.clip_qkv:
            mixed = mixed.clamp(min=-module.clip_qkv, max=module.clip_qkv)
        q, k, v = (_heads_first(x, module.n_heads) for x in mixed.chunk(3, dim=2))
        slopes = None if position_bias is None else (position_bias[:, 0, -1] - position_bias[:, 0, -2]).float()
        out = attend_paged(module, q, k, v, owner.require_context(module), module.softmax_scale,
                           extras=LayerExtras(alibi_slopes=slopes))
        return module.out_proj(out.reshape(hidden_states.shape[0], hidden_states.shape[1], -1)), None

    return forward


def gpt_neo_attention(module, owner: ModulePatches):
    """GPTNeoSelfAttention.forward on the paged cache: unscaled scores, `config.window_size` on its local layers."""
    window = module.config.window_size if module.attention_type == "local" else None

    def forward(hidden_states, attention_mask=None, layer_past=None, use_cache=False, output_attentions=False,
                **kwargs):
        q, k, v = (_heads_first(proj(hidden_states), module.num_heads)
                   for proj in (module.q_proj, module.k_proj, module.v_proj))
        out = attend_paged(module, q, k, v, owner.require_context(module), 1.0, window, layer=module.layer_id)
        out = module.out_proj(out.reshape(hidden_states.shape[0], hidden_states.shape[1], -1))
        return module.resid_dropout(out), None

    return forward


def projected_attention(module, owner: ModulePatches):
    """The bmm attention of xglm, mvp and trocr decoders (q_proj x scaling, k_proj, v_proj, out_proj), self-attention
    only: a cross-attention or attention-prompt call is refused."""
    def forward(hidden_states, key_value_states=None, cache=None, attention_mask=None, attn_prompt=None, **kwargs):
        if key_value_states is not None or attn_prompt is not None:
            raise UnsupportedAttention(f"model type {_model_type(module)!r}: cross-attention / attention prompts")
        q, k, v = (_heads_first(proj(hidden_states), module.num_heads)
                   for proj in (module.q_proj, module.k_proj, module.v_proj))
        out = attend_paged(module, q, k, v, owner.require_context(module), module.scaling)
        return module.out_proj(out.reshape(hidden_states.shape[0], hidden_states.shape[1], -1)), None

    return forward


SELF_ATTENDING = {"BloomAttention": bloom_attention, "MptAttention": mpt_attention,
                  "GPTNeoSelfAttention": gpt_neo_attention, "GPTNeoFlashAttention2": gpt_neo_attention,
                  "XGLMAttention": projected_attention, "MvpAttention": projected_attention,
                  "TrOCRAttention": projected_attention}


def self_attending_modules(model: torch.nn.Module) -> list:
    """[(module, factory)] for the model's attention modules that compute attention themselves and have a paged
    forward here (SELF_ATTENDING)."""
    return [(m, SELF_ATTENDING[type(m).__name__]) for m in model.modules() if type(m).__name__ in SELF_ATTENDING]
