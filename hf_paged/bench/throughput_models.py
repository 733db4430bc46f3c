"""The throughput benchmark's random models (`--arch`) and their workloads: the standard Llama, hybrids of a family's
shape (Gated DeltaNet + attention: `qwen3_5_text`; Mamba-2 + attention: `nemotron_h`, `falcon_h1`; short convolutions
+ attention: `lfm2`; Mamba-1 only: `falcon_mamba`), stacks that mix sliding-window and full-attention layers in their
family's own pattern (`gemma3_text`, `gemma2`, `gpt_oss`), a mixture of experts stored output-major (`mixtral`), a
dense model at a released model's sizes (`qwen2.5-0.5b`), each with `--small` sizes for smoke runs.

Invariants:
- Every arch runs the same prompts (16-200 random tokens, seed SEED) and new-token counts; only the model differs.
- A model dict's generic keys are vocab_size, hidden, layers, heads, kv_heads, max_len (and `window` for the mixed
  stacks: their sliding layers' window, llama4-style chunks not included); every other key is a field of the
  family's own config. `layers` of a mixed stack is the length of its `layer_types`.
- Sizes stay near the standard workload's (hidden 512, vocab 32000) so that runs compare (but the released model's
  sizes of DENSE_SETUPS); the attention shapes are
  the family's own where they set its cost (gemma: head dim 256; gpt-oss: sinks, 128-token windows, a mixture of
  experts, here 8 experts, 2 per token).
"""
from __future__ import annotations

SEED = 0
FULL = dict(model=dict(vocab_size=32000, hidden=512, layers=8, heads=8, kv_heads=2, max_len=1024,
                       intermediate_size=1376), prompt_len=(16, 200), requests=[16, 64], max_tokens=64)
SMALL = dict(model=dict(vocab_size=1000, hidden=128, layers=2, heads=4, kv_heads=2, max_len=1024,
                        intermediate_size=344), prompt_len=(16, 200), requests=[4, 8], max_tokens=8)
_THREE_TO_ONE = ["linear_attention"] * 3 + ["full_attention"]
_LFM2 = ["conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv", "full_attention"]
_NEMOTRON = ["linear_attention", "mlp"] * 2 + ["linear_attention", "full_attention", "linear_attention", "mlp"]
# hybrids (hf_paged.tiny.HYBRIDS): the same workload, a model of the family's shape
HYBRID_SETUPS = {
    "qwen3_5_text": (
        dict(FULL, model=dict(vocab_size=32000, hidden=512, layers=8, heads=8, kv_heads=2, max_len=1024, head_dim=64,
                              intermediate_size=1024, layer_types=_THREE_TO_ONE * 2, linear_num_key_heads=4,
                              linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64)),
        dict(SMALL, model=dict(vocab_size=1000, hidden=128, layers=4, heads=4, kv_heads=2, max_len=1024, head_dim=32,
                               intermediate_size=256, layer_types=_THREE_TO_ONE, linear_num_key_heads=2,
                               linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32))),
    # Nemotron-H's pattern (Mamba-2 : MLP alternating, one attention layer in 8), its 128-wide states and chunks
    "nemotron_h": (
        dict(FULL, model=dict(vocab_size=32000, hidden=512, layers=8, heads=8, kv_heads=2, max_len=1024, head_dim=64,
                              intermediate_size=1376, layer_types=_NEMOTRON, mamba_num_heads=16, mamba_head_dim=64,
                              n_groups=2, ssm_state_size=128, chunk_size=128)),
        dict(SMALL, model=dict(vocab_size=1000, hidden=128, layers=8, heads=4, kv_heads=2, max_len=1024, head_dim=32,
                               intermediate_size=344, layer_types=_NEMOTRON, mamba_num_heads=8, mamba_head_dim=32,
                               n_groups=1, ssm_state_size=16, chunk_size=16))),
    # LFM2's pattern (short gated convolutions, attention every 2-3 layers), its 3-token convolution window
    "lfm2": (
        dict(FULL, model=dict(vocab_size=32000, hidden=512, layers=8, heads=8, kv_heads=2, max_len=1024,
                              intermediate_size=1376, block_auto_adjust_ff_dim=False, conv_L_cache=3,
                              layer_types=_LFM2)),
        dict(SMALL, model=dict(vocab_size=1000, hidden=128, layers=4, heads=4, kv_heads=2, max_len=1024,
                               intermediate_size=344, block_auto_adjust_ff_dim=False, conv_L_cache=3,
                               layer_types=_LFM2[:3] + ["full_attention"]))),
    # Falcon-Mamba: Mamba-1 mixers only (no attention), state 16, expand 2
    "falcon_mamba": (
        dict(FULL, model=dict(vocab_size=32000, hidden=512, layers=8, heads=8, kv_heads=2, max_len=1024,
                              state_size=16, expand=2, conv_kernel=4, time_step_rank=32)),
        dict(SMALL, model=dict(vocab_size=1000, hidden=128, layers=2, heads=4, kv_heads=2, max_len=1024,
                               state_size=16, expand=2, conv_kernel=4, time_step_rank=8))),
    # Falcon-H1: attention and a Mamba-2 mixer side by side in every layer
    "falcon_h1": (
        dict(FULL, model=dict(vocab_size=32000, hidden=512, layers=8, heads=8, kv_heads=2, max_len=1024, head_dim=64,
                              intermediate_size=1376, mamba_d_ssm=1024, mamba_n_heads=16, mamba_d_head=64,
                              mamba_n_groups=1, mamba_d_state=128, mamba_chunk_size=128)),
        dict(SMALL, model=dict(vocab_size=1000, hidden=128, layers=2, heads=4, kv_heads=2, max_len=1024, head_dim=32,
                               intermediate_size=344, mamba_d_ssm=256, mamba_n_heads=8, mamba_d_head=32,
                               mamba_n_groups=1, mamba_d_state=16, mamba_chunk_size=16))),
}
_FIVE_TO_ONE = ["sliding_attention"] * 5 + ["full_attention"]
_ALTERNATING = ["sliding_attention", "full_attention"]


def _mixed(full: dict, small: dict) -> tuple[dict, dict]:
    return (dict(FULL, model=dict(full, layers=len(full["layer_types"]))),
            dict(SMALL, model=dict(small, layers=len(small["layer_types"]))))


# sliding + full attention stacks (hf_paged.tiny.MIXED), the family's pattern, window and head dim
MIXED_SETUPS = {
    "gemma3_text": _mixed(  # gemma 3 1B's pattern, window and head dim
        dict(vocab_size=32000, hidden=512, heads=4, kv_heads=1, max_len=1024, window=512, head_dim=256,
             query_pre_attn_scalar=256, intermediate_size=1376, layer_types=_FIVE_TO_ONE),
        dict(vocab_size=1000, hidden=128, heads=4, kv_heads=1, max_len=1024, window=512, head_dim=32,
             query_pre_attn_scalar=32, intermediate_size=344, layer_types=_FIVE_TO_ONE)),
    "gemma2": _mixed(  # gemma 2's soft-capped scores and logits, window 4096, head dim 256
        dict(vocab_size=32000, hidden=512, heads=8, kv_heads=4, max_len=1024, window=4096, head_dim=256,
             query_pre_attn_scalar=256, intermediate_size=1376, attn_logit_softcapping=50.0,
             final_logit_softcapping=30.0, layer_types=_ALTERNATING * 4),
        dict(vocab_size=1000, hidden=128, heads=4, kv_heads=2, max_len=1024, window=4096, head_dim=32,
             query_pre_attn_scalar=32, intermediate_size=344, attn_logit_softcapping=50.0,
             final_logit_softcapping=30.0, layer_types=_ALTERNATING * 2)),
    "gpt_oss": _mixed(  # gpt-oss: attention sinks, 128-token windows every other layer, a mixture of experts
        dict(vocab_size=32000, hidden=512, heads=8, kv_heads=2, max_len=1024, window=128, head_dim=64,
             intermediate_size=512, num_local_experts=8, num_experts_per_tok=2, layer_types=_ALTERNATING * 4),
        dict(vocab_size=1000, hidden=128, heads=4, kv_heads=2, max_len=1024, window=128, head_dim=32,
             intermediate_size=128, num_local_experts=4, num_experts_per_tok=2, layer_types=_ALTERNATING * 2)),
}
# a mixture of experts stored output-major ([experts, out, in]: Mixtral, Qwen-MoE), full attention, 8 experts, 2 per
# token, the gpt-oss setup's expert sizes
MOE_SETUPS = {
    "mixtral": (dict(FULL, model=dict(FULL["model"], intermediate_size=512, num_local_experts=8,
                                      num_experts_per_tok=2)),
                dict(SMALL, model=dict(SMALL["model"], intermediate_size=128, num_local_experts=4,
                                       num_experts_per_tok=2))),
}
# a dense model at a released model's own sizes (Qwen2.5-0.5B: q / k / v biases, tied 151,936-token embeddings), random
# weights: what the standard workload's small sizes do not show (24 layers, an LM head of 136 M weights)
DENSE_SETUPS = {
    "qwen2.5-0.5b": ("qwen2", dict(FULL, model=dict(vocab_size=151936, hidden=896, layers=24, heads=14, kv_heads=2,
                                                    max_len=1024, intermediate_size=4864, tie_word_embeddings=True)),
                     dict(SMALL, model=dict(SMALL["model"], tie_word_embeddings=True))),
}
ARCHS = ("llama", *HYBRID_SETUPS, *MIXED_SETUPS, *MOE_SETUPS, *DENSE_SETUPS)


def workload(arch: str, small: bool) -> dict:
    """The model sizes, prompt lengths and default counts of one run."""
    if arch == "llama":
        return SMALL if small else FULL
    if arch in DENSE_SETUPS:
        return DENSE_SETUPS[arch][2 if small else 1]
    setups = next(group for group in (HYBRID_SETUPS, MIXED_SETUPS, MOE_SETUPS) if arch in group)
    return setups[arch][1 if small else 0]


def build_model(arch: str, sizes: dict):
    """The benchmark's random model (seed SEED, output head not sharpened) of `arch` with `sizes` (a setup's model)."""
    from hf_paged.tiny import tiny_hybrid, tiny_mixed, tiny_model

    if arch == "llama" or arch in MOE_SETUPS:
        return tiny_model(arch, seed=SEED, sharpen=1.0, **sizes)
    if arch in DENSE_SETUPS:
        return tiny_model(DENSE_SETUPS[arch][0], seed=SEED, sharpen=1.0, **sizes)
    rest = dict(sizes)
    generic = {name: rest.pop(key) for key, name in (("vocab_size", "vocab_size"), ("hidden", "hidden"),
               ("heads", "num_attention_heads"), ("kv_heads", "num_key_value_heads"))}
    if arch in MIXED_SETUPS:
        rest.pop("layers")  # the length of layer_types
        return tiny_mixed(arch, seed=SEED, sharpen=1.0, max_len=rest.pop("max_len"), window=rest.pop("window"),
                          **generic, **rest)
    return tiny_hybrid(arch, seed=SEED, sharpen=1.0, layers=rest.pop("layers"),
                       max_position_embeddings=rest.pop("max_len"), **generic, **rest)
