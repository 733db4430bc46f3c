"""model/spec.py: what the engine reads off a model (its KV shapes from what the attention modules produce, vocab,
length, state layers) and the refusals, naming the model, of what cannot be paged."""
import pytest
import torch
from transformers import PretrainedConfig

from hf_paged.model import describe_model
from hf_paged.tiny import tiny_hybrid

from conftest import cached_model


def test_a_plain_decoder_is_described_from_its_attention_calls():
    model = cached_model("llama")
    text = model.config
    spec = describe_model(model)
    assert (spec.kv.num_layers, spec.kv.num_kv_heads, spec.kv.head_dim) == (
        text.num_hidden_layers, text.num_key_value_heads, text.hidden_size // text.num_attention_heads)
    assert spec.kv.dtype == next(model.parameters()).dtype and spec.kv.attention_layers is None
    assert (spec.vocab_size, spec.max_model_len) == (text.vocab_size, text.max_position_embeddings)
    assert spec.accepts_logits_to_keep and not spec.has_state and spec.interface_layers == text.num_hidden_layers
    assert describe_model(model).kv == spec.kv  # the recorded shapes are kept on the model: the same answer again


def test_a_hybrid_stores_kv_only_for_its_attention_layers():
    model = tiny_hybrid("recurrent_gemma")
    kinds = model.config.layer_types
    spec = describe_model(model)
    assert spec.has_state and spec.kv.num_layers == len(kinds)
    assert spec.kv.attention_layers == tuple(i for i, kind in enumerate(kinds) if kind != "linear_attention")
    assert sorted(set(spec.state_layers.values())) == [i for i, kind in enumerate(kinds) if kind == "linear_attention"]


class NotGenerative(torch.nn.Module):
    def __init__(self, **config):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        if config:
            self.config = PretrainedConfig(**config)
            self.generation_config = None


@pytest.mark.parametrize("model, message", [
    (NotGenerative(), "NotGenerative is not a transformers generative model"),
    (NotGenerative(is_encoder_decoder=True), "is encoder-decoder; hf_paged serves decoder-only models"),
    (NotGenerative(num_hidden_layers=2), "config lacks attention heads / layers / hidden size"),
])
def test_what_cannot_be_paged_is_refused_naming_why(model, message):
    with pytest.raises(ValueError, match=message):
        describe_model(model)
