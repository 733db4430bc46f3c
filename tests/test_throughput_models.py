"""The throughput benchmark's models (hf_paged/bench/throughput_models.py): each --arch has its full and --small
workload, the same prompts; a mixed sliding / full stack is built as its family (pattern, window) and hf_paged gives
HF padded generate's tokens on it."""
from types import SimpleNamespace

import pytest

from hf_paged.bench import throughput, throughput_models


def test_workload():
    assert throughput.workload("llama", True) is throughput_models.SMALL
    assert throughput.workload("llama", False) is throughput_models.FULL
    full, small = throughput_models.HYBRID_SETUPS["qwen3_5_text"]
    assert throughput.workload("qwen3_5_text", False) is full and throughput.workload("qwen3_5_text", True) is small
    assert small["model"]["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    for arch, (full, small) in throughput_models.MIXED_SETUPS.items():
        assert throughput.workload(arch, False) is full and throughput.workload(arch, True) is small
        assert full["model"]["layers"] == len(full["model"]["layer_types"]) and full["prompt_len"] == (16, 200)
    full, small = throughput_models.MOE_SETUPS["mixtral"]
    assert throughput.workload("mixtral", False) is full and throughput.workload("mixtral", True) is small
    assert full["prompt_len"] == (16, 200) and full["model"]["hidden"] == 512 and full["model"]["layers"] == 8


def test_the_mixture_stores_its_experts_output_major(restore):
    """--arch mixtral: 8 experts of [out, in] (the layout transformers hands to the grouped product transposed), 2
    per token; hf_paged gives HF padded generate's tokens."""
    setup = dict(throughput.workload("mixtral", True), prompt_len=(8, 40))
    model = throughput.build_model("mixtral", setup["model"])
    experts = [m for m in model.modules() if type(m).__name__ == "MixtralExperts"]
    assert model.config.model_type == "mixtral" and len(experts) == 2 and not experts[0].is_transposed
    assert experts[0].gate_up_proj.shape == (4, 2 * 128, 128) and model.config.num_experts_per_tok == 2
    args = SimpleNamespace(arch="mixtral", dtype="float32", max_tokens=3)
    paged = throughput.measure("hf_paged", 2, args, setup, 1)
    padded = throughput.measure("hf_padded", 2, args, setup, 1)
    assert paged["tokens"] == padded["tokens"] and [len(t) for t in paged["tokens"]] == [3, 3]


@pytest.mark.parametrize("arch", list(throughput_models.MIXED_SETUPS))
def test_mixed_stacks_are_built_as_their_family_and_give_hfs_tokens(restore, arch):
    """--arch gemma3_text / gemma2 / gpt_oss at --small sizes (two requests, prompts up to 40 tokens: a window of
    128 binds in none, 3 new tokens): the family's model with the setup's window and layer pattern."""
    setup = dict(throughput.workload(arch, True), prompt_len=(8, 40))
    model = throughput.build_model(arch, setup["model"])
    assert model.config.model_type == arch and model.config.layer_types == setup["model"]["layer_types"]
    assert model.config.sliding_window == setup["model"]["window"]
    args = SimpleNamespace(arch=arch, dtype="float32", max_tokens=3)
    paged = throughput.measure("hf_paged", 2, args, setup, 1)
    padded = throughput.measure("hf_padded", 2, args, setup, 1)
    assert paged["tokens"] == padded["tokens"] and [len(t) for t in paged["tokens"]] == [3, 3]


@pytest.mark.parametrize("arch", ["nemotron_h", "falcon_h1", "lfm2", "falcon_mamba"])
def test_state_space_hybrids_are_built_as_their_family_and_give_hfs_tokens(restore, arch):
    """--arch nemotron_h (Mamba-2 and MLP layers alternating, one attention layer in 8) / falcon_h1 (attention and a
    Mamba-2 mixer side by side in every layer) / lfm2 (short gated convolutions between attention layers) /
    falcon_mamba (Mamba-1 mixers only) at --small sizes: the family's model and sizes, HF padded's tokens."""
    full, small = throughput_models.HYBRID_SETUPS[arch]
    assert throughput.workload(arch, False) is full and full["model"]["hidden"] == 512
    setup = dict(small, prompt_len=(8, 40))
    model = throughput.build_model(arch, setup["model"])
    assert model.config.model_type == arch
    if arch == "lfm2":
        assert model.config.layer_types == setup["model"]["layer_types"] and model.config.conv_L_cache == 3
    else:
        mixers = [m for m in model.modules() if hasattr(m, "ssm_state_size")]
        assert mixers and mixers[0].ssm_state_size == 16
    if arch == "nemotron_h":
        assert model.config.layers_block_type == setup["model"]["layer_types"] and len(mixers) == 4
    args = SimpleNamespace(arch=arch, dtype="float32", max_tokens=3)
    paged = throughput.measure("hf_paged", 2, args, setup, 1)
    padded = throughput.measure("hf_padded", 2, args, setup, 1)
    assert paged["tokens"] == padded["tokens"] and [len(t) for t in paged["tokens"]] == [3, 3]


def test_the_dense_model_has_the_released_models_sizes_and_gives_hfs_tokens(restore):
    """--arch qwen2.5-0.5b: Qwen2 at Qwen2.5-0.5B's sizes (tied embeddings, q / k / v biases); at --small sizes
    hf_paged gives HF padded generate's tokens."""
    family, full, small = throughput_models.DENSE_SETUPS["qwen2.5-0.5b"]
    assert throughput.workload("qwen2.5-0.5b", False) is full and throughput.workload("qwen2.5-0.5b", True) is small
    assert (full["model"]["hidden"], full["model"]["layers"], full["model"]["vocab_size"]) == (896, 24, 151936)
    setup = dict(small, prompt_len=(8, 40))
    model = throughput.build_model("qwen2.5-0.5b", setup["model"])
    assert model.config.model_type == family == "qwen2" and model.config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    args = SimpleNamespace(arch="qwen2.5-0.5b", dtype="float32", max_tokens=3)
    paged = throughput.measure("hf_paged", 2, args, setup, 1)
    padded = throughput.measure("hf_padded", 2, args, setup, 1)
    assert paged["tokens"] == padded["tokens"] and [len(t) for t in paged["tokens"]] == [3, 3]
    params = paged["params"]  # the tied head's weight is the embedding's: not taken from the body twice
    assert params["non_embedding"] == params["total"] - params["embedding"] == params["active_non_embedding"]
