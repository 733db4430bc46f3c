"""Tiny random-weight models of real architectures, built from configs (no downloads).

Used by `hf-paged demo`, the tests and the benchmarks. `sharpen` scales the output head so greedy
choices have clear margins and fp reordering between implementations cannot flip them.
"""
from __future__ import annotations

import torch

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3", "gpt2", "gpt_neox", "mixtral")


def tiny_config(arch: str, vocab_size: int = 256, hidden: int = 64, layers: int = 2, heads: int = 4,
                kv_heads: int = 2, max_len: int = 512, **overrides):
    import transformers as tf

    common = dict(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  intermediate_size=hidden * 2, max_position_embeddings=max_len, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0, tie_word_embeddings=False)
    if arch == "llama":
        config = tf.LlamaConfig(num_key_value_heads=kv_heads, **common)
    elif arch == "mistral":
        config = tf.MistralConfig(num_key_value_heads=kv_heads, sliding_window=8, **common)
    elif arch == "qwen2":
        config = tf.Qwen2Config(num_key_value_heads=kv_heads, **common)
    elif arch == "qwen3":
        config = tf.Qwen3Config(num_key_value_heads=kv_heads, head_dim=hidden // heads, **common)
    elif arch == "gemma2":
        config = tf.Gemma2Config(num_key_value_heads=kv_heads, head_dim=hidden // heads, sliding_window=8,
                                 attn_logit_softcapping=5.0, final_logit_softcapping=30.0,
                                 query_pre_attn_scalar=hidden // heads, **common)
    elif arch == "phi3":
        config = tf.Phi3Config(num_key_value_heads=kv_heads, **common)
    elif arch == "mixtral":
        config = tf.MixtralConfig(num_key_value_heads=kv_heads, num_local_experts=4, num_experts_per_tok=2,
                                  sliding_window=None, **common)
    elif arch == "gpt2":
        config = tf.GPT2Config(vocab_size=vocab_size, n_embd=hidden, n_layer=layers, n_head=heads,
                               n_positions=max_len, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                               tie_word_embeddings=False)  # sharpen the head, not the input embeddings
    elif arch == "gpt_neox":
        config = tf.GPTNeoXConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                                  num_attention_heads=heads, intermediate_size=hidden * 2,
                                  max_position_embeddings=max_len, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                  tie_word_embeddings=False)
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {ARCHITECTURES}")
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def tiny_model(arch: str = "llama", seed: int = 0, sharpen: float = 8.0, dtype=torch.float32,
               attn_implementation: str | None = None, **config_overrides):
    """A random-weight causal LM in eval mode. `sharpen` multiplies the output head's weights."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharpen)
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    return model.eval()


_THREE_TO_ONE = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
_LINEAR = dict(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
               head_dim=16)
_MAMBA = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16, mamba_chunk_size=16)
# hybrid / state-space stacks, 4 layers holding every layer type of the family's own pattern (3 state : 1 attention
# where the family mixes them; minimax: its own 7 : 1 in 8 layers), sizes that fit a hidden size of 64
HYBRIDS = {
    "qwen3_5_text": dict(layer_types=_THREE_TO_ONE, **_LINEAR),
    "qwen3_next": dict(layer_types=_THREE_TO_ONE, **_LINEAR),
    "olmo_hybrid": dict(layer_types=_THREE_TO_ONE, **_LINEAR),
    "nemotron_h": dict(layer_types=["linear_attention", "moe", "full_attention", "mlp"], head_dim=16,
                       mamba_num_heads=8, mamba_head_dim=16, n_groups=1, ssm_state_size=16, chunk_size=16),
    "falcon_h1": dict(head_dim=16, mamba_d_ssm=128, **_MAMBA),
    "granitemoehybrid": dict(layer_types=["mamba", "mamba", "mamba", "attention"], **_MAMBA),
    "bamba": dict(attn_layer_indices=[3], **_MAMBA),
    "jamba": dict(attn_layer_period=4, attn_layer_offset=3, expert_layer_period=2, expert_layer_offset=1,
                  num_experts=2, mamba_d_state=8, use_mamba_kernels=False),
    "zamba": dict(attn_layer_period=2, attn_layer_offset=0, attention_hidden_size=128, attention_head_dim=32,
                  n_mamba_heads=2, mamba_d_state=16, mamba_dt_rank=4, use_mamba_kernels=False),
    "zamba2": dict(layers_block_type=["mamba", "mamba", "hybrid", "mamba"], hybrid_layer_ids=[2], mamba_d_state=16,
                   n_mamba_heads=8, use_mamba_kernels=False, chunk_size=16, attention_head_dim=16),
    "lfm2": dict(layer_types=["conv", "conv", "conv", "full_attention"]),
    "lfm3": dict(layer_types=["conv", "conv", "sliding_attention", "full_attention"]),
    "mamba2": dict(num_heads=8, head_dim=16, expand=2, n_groups=1, state_size=16, chunk_size=16),
    "mamba": dict(state_size=8),
    "falcon_mamba": dict(state_size=8),
    "zaya": dict(head_dim=16),
    # MiniMax-Text-01's 7 lightning-attention layers : 1 full; blocks of 8 tokens (256 in the real model), so that
    # prompts span several of the block-wise prefill's blocks
    "minimax": dict(layer_types=["linear_attention"] * 7 + ["full_attention"], num_hidden_layers=8, head_dim=16,
                    num_local_experts=2, block_size=8),
    # state kept outside the cache calls (model/own_state.py): recurrent_gemma's recurrent blocks on themselves, with
    # a local-attention layer of a window shorter than the longer prompts (its own 2 : 1 pattern, 4 layers); rwkv's
    # blocks in the state list its forward passes down (halving the hidden states every 2 layers, as its own
    # `rescale_every` does)
    "recurrent_gemma": dict(block_types=["recurrent", "recurrent", "attention"], attention_window_size=16,
                            head_dim=16, lru_width=64),
    "rwkv": dict(attention_hidden_size=64, rescale_every=2),
    # sliding-window and full attention layers (3 : 1), each with four short convolutions (two inside its attention)
    # and a learned relative-position bias (its extent shorter than the longer prompts); logits not divided by the
    # full-size width multiplier (24), so that a sharpened head gives clear margins
    "inkling_text": dict(local_layer_ids=[0, 1, 2], head_dim=16, swa_num_attention_heads=4, swa_num_key_value_heads=2,
                         swa_head_dim=16, sliding_window_size=8, d_rel=4, rel_extent=6, moe_intermediate_size=32,
                         n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                         logits_mup_width_multiplier=1.0),
}


def tiny_hybrid(model_type: str, seed: int = 0, sharpen: float = 8.0, layers: int = 4, hidden: int = 64,
                vocab_size: int = 256, dtype=torch.float32, **overrides):
    """A random-weight hybrid (attention + state layers) or state-space causal LM of `model_type` (one of
    `HYBRIDS`), in eval mode, its output head scaled by `sharpen`. Mamba-2 mixers (a `dt_bias`) are given a scan that
    weighs on their output: as initialized, their B and C (through a convolution of weights ~0.02) are ~1e-3 and
    the D skip (1) makes up nearly all of it, so a wrong scan would still give HF's tokens; here the convolution is
    scaled by `MAMBA2_CONV_GAIN`, D set to 0.1 and dt's bias to -3 (small steps: a state that keeps many tokens)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    sizes = dict(hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2, intermediate_size=hidden * 2,
                 vocab_size=vocab_size, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                 tie_word_embeddings=False, num_hidden_layers=layers)
    config = CONFIG_MAPPING[model_type](**{**sizes, **HYBRIDS[model_type], **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharpen)
        for module in model.modules():
            if all(hasattr(module, name) for name in ("dt_bias", "A_log", "D", "conv1d")):
                module.conv1d.weight.mul_(MAMBA2_CONV_GAIN)
                module.dt_bias.fill_(-3.0)
                module.D.fill_(0.1)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 2
    return model.eval()


MAMBA2_CONV_GAIN = 30.0
_FIVE_TO_ONE = ["sliding_attention"] * 5 + ["full_attention"]
# stacks mixing sliding-window and full-attention layers, in the family's own pattern
MIXED = {
    "gemma3_text": dict(layer_types=_FIVE_TO_ONE, head_dim=16, query_pre_attn_scalar=16),
    "gemma2": dict(layer_types=["sliding_attention", "full_attention"] * 3, head_dim=16, query_pre_attn_scalar=16,
                   attn_logit_softcapping=5.0, final_logit_softcapping=30.0),
    "cohere2": dict(layer_types=["sliding_attention"] * 3 + ["full_attention"], logit_scale=1.0),
    "gpt_oss": dict(layer_types=["sliding_attention", "full_attention"] * 2, head_dim=16, num_local_experts=4,
                    num_experts_per_tok=2),
    # sliding layers with twice the K/V heads of the full ones and V heads smaller than K heads (its own 1 : 4)
    "mimo_v2_flash": dict(layer_types=["full_attention"] + ["sliding_attention"] * 4, head_dim=16, v_head_dim=8,
                          mlp_layer_types=["dense"] + ["sparse"] * 4, n_routed_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=32),
    # chunked attention (a query sees its own chunk of `window` tokens) between full layers, with NoPE
    "llama4_text": dict(layer_types=["chunked_attention", "full_attention"] * 2, head_dim=16, num_local_experts=2,
                        intermediate_size_mlp=128, no_rope_layers=[1, 0, 1, 0]),
}


def tiny_mixed(model_type: str, window: int = 8, seed: int = 0, sharpen: float = 8.0, hidden: int = 64,
               vocab_size: int = 256, max_len: int = 512, dtype=torch.float32, **overrides):
    """A random-weight stack of `model_type` (one of `MIXED`) mixing sliding-window (`window` tokens; llama4: chunks of
    `window` tokens) and full-attention layers in its own pattern, in eval mode, its output head scaled by `sharpen`."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    options = {**MIXED[model_type], **overrides}
    sizes = dict(hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2, intermediate_size=hidden * 2,
                 vocab_size=vocab_size, max_position_embeddings=max_len, pad_token_id=0, bos_token_id=1,
                 eos_token_id=2, tie_word_embeddings=False, num_hidden_layers=len(options["layer_types"]),
                 **({"attention_chunk_size": window} if "chunked_attention" in options["layer_types"]
                    else {"sliding_window": window}))
    config = CONFIG_MAPPING[model_type](**{**sizes, **options})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharpen)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 2
    return model.eval()


SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")  # ids 0-3, matching tiny_config's pad / bos / eos ids
CHAT_TEMPLATE = ("{% for message in messages %}[{{ message['role'] }}] {{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[assistant] {% endif %}")


def tiny_vocab(vocab_size: int = 128) -> dict[str, int]:
    """Special tokens, then one token per character: printable ASCII, newline and tab first, then filler characters
    from the CJK block so that any vocabulary size is covered (random weights produce those: visibly noise)."""
    chars = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    if vocab_size < len(SPECIAL_TOKENS) + len(chars):
        raise ValueError(f"a character vocabulary needs at least {len(SPECIAL_TOKENS) + len(chars)} ids")
    chars += [chr(0x4E00 + k) for k in range(vocab_size - len(SPECIAL_TOKENS) - len(chars))]
    return {token: i for i, token in enumerate((*SPECIAL_TOKENS, *chars))}


def tiny_tokenizer(vocab_size: int = 128):
    """A character-level fast tokenizer built in code (no files, no download), with a chat template."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(tiny_vocab(vocab_size), merges=[], unk_token="<unk>"))  # no merges: one id per char
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", padding_side="left")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_chat_model(seed: int = 0, vocab_size: int = 128):
    """(model, tokenizer): a random-weight 2-layer Llama over `tiny_tokenizer`'s vocabulary (`hf-paged ... --model
    tiny`). Its text is noise; it exercises every code path without a download."""
    import torch

    model = tiny_model("llama", seed=seed, vocab_size=vocab_size, hidden=64, layers=2, heads=4, kv_heads=2,
                       max_len=2048, sharpen=2.0)
    with torch.no_grad():  # pad, bos and unk (they decode to nothing) never win a greedy pick
        model.get_output_embeddings().weight[[0, 1, 3]] = 0.0
    return model, tiny_tokenizer(vocab_size)


def generate_batch_configs(max_new_tokens: int, num_blocks: int | None = None):
    """(GenerationConfig, ContinuousBatchingConfig or None) for HF's own `generate_batch` baseline: greedy, no
    token stops a row; `num_blocks` sizes its cache (None: HF's default, a share of host RAM)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    return config, ContinuousBatchingConfig(num_blocks=num_blocks) if num_blocks is not None else None


# ---- what the benchmarks and the model census take from transformers (imported here, at the package's edge) ----
def causal_lm_types() -> list[str]:
    """Every model type transformers registers as a causal LM, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def config_of(model_type: str, **fields):
    """A config of `model_type`'s own config class with `fields` (the rest its defaults)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type](**fields)


def model_from_config(config, dtype=None):
    """A random-weight causal LM built from `config` (the caller seeds torch), in eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config, **({"dtype": dtype} if dtype is not None else {})).eval()


def dynamic_cache(**options):
    """transformers' own DynamicCache (`options`: its constructor's, e.g. config=)."""
    from transformers import DynamicCache

    return DynamicCache(**options)


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def text_generation_pipeline(model, tokenizer, **options):
    """transformers' own `pipeline("text-generation", ...)` on `model` / `tokenizer`."""
    from transformers import pipeline

    return pipeline("text-generation", model=model, tokenizer=tokenizer, **options)
