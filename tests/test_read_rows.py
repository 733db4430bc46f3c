"""The last decoder layer computes, after its attention, only the rows the LM head reads (hf_paged/model/read_rows.py):
an engine that does gives HF's tokens (Llama, Mistral, Qwen2, Qwen3); the rows read hold the class forward's values;
a hook that would see the skip, a replaced part, another model code or the switch keeps the class forward."""
import types

import pytest
import torch

import hf_paged
from hf_paged.model import fused_layers, read_rows
from hf_paged.tiny import tiny_model

PROMPTS = [[5, 9, 13, 2, 7, 11, 3, 8, 21, 4, 6, 30, 12, 14, 15, 16, 17, 18, 19, 20, 22], [4, 4, 9], [8, 1, 6, 6, 2]]


@pytest.fixture(autouse=True)
def switches(monkeypatch):
    monkeypatch.delenv(read_rows.SWITCH, raising=False)
    monkeypatch.setenv(fused_layers.SWITCH, "0")  # the class forward for every other call: this path alone


@pytest.fixture
def calls(monkeypatch):
    """(rows the head read, rows of the step) of each call that took the path."""
    seen = []
    real = read_rows.forward_read_rows

    def counting(layer, rows_read, hidden_states, *args):
        seen.append((rows_read.numel(), hidden_states.shape[1]))
        return real(layer, rows_read, hidden_states, *args)
    monkeypatch.setattr(read_rows, "forward_read_rows", counting)
    return seen


def llama(arch="llama"):
    """A tiny model with peaked attention and a last layer whose MLP moves the logits."""
    model = tiny_model(arch)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
        model.model.layers[-1].mlp.down_proj.weight.mul_(4.0)
    return model


class Scaled(torch.nn.Module):
    """A projection of another kind than nn.Linear (as an adapter or a quantized linear would be)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) * 1.25


def hf_tokens(model, prompt, n=8):
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def engine_tokens(model, n=8, llm=None):
    llm = llm or hf_paged.LLM(model, block_size=4, max_num_batched_tokens=16)
    params = hf_paged.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_an_engine_whose_last_layer_computes_only_the_rows_read_gives_hfs_tokens(calls, arch):
    """Prompt chunks with no row read (the 21-token prompt's first 16), chunks that finish a prompt, decodes."""
    model = llama(arch)
    assert engine_tokens(model) == [hf_tokens(model, p) for p in PROMPTS]
    assert any(read == 0 for read, _ in calls) and any(0 < read < rows for read, rows in calls)
    assert all(read < rows for read, rows in calls)  # decode steps (every row read) run the class forward


def test_the_rows_read_hold_the_class_forwards_values_and_the_others_the_input():
    model = llama()
    layer = read_rows.last_layer(model)[0]
    hidden = torch.randn(1, 9, model.config.hidden_size)
    positions = torch.arange(9)[None]
    with torch.inference_mode():
        embeddings = model.model.rotary_emb(hidden, position_ids=positions)
        want = layer(hidden, position_ids=positions, position_embeddings=embeddings)
        rows = torch.tensor([2, 8])
        got = read_rows.forward_read_rows(layer, rows, hidden, None, positions, False, embeddings, {})
    torch.testing.assert_close(got[0, rows], want[0, rows], rtol=1e-6, atol=1e-6)
    others = [i for i in range(9) if i not in (2, 8)]
    assert torch.equal(got[0, others], hidden[0, others])
    assert not torch.equal(want[0, others], hidden[0, others])


@pytest.mark.parametrize("where", ["layer", "base", "norm", "norm2", "mlp", "down_proj", "act_fn"])
def test_a_hook_that_would_see_the_skip_keeps_the_class_forward(calls, where):
    model = llama()
    last = model.model.layers[-1]
    target = {"layer": last, "base": model.model, "norm": model.model.norm, "norm2": last.post_attention_layernorm,
              "mlp": last.mlp, "down_proj": last.mlp.down_proj, "act_fn": last.mlp.act_fn}[where]
    target.register_forward_hook(lambda module, args, out: None)
    assert engine_tokens(model) == [hf_tokens(model, p) for p in PROMPTS]
    assert calls == []


def test_hooks_before_the_skip_see_every_row_as_in_the_class_forward(calls):
    """The input norm and the attention module (o_proj included) run as the class code runs them: all rows."""
    model = llama()
    last = model.model.layers[-1]
    seen = {"class": [], "read": [], None: []}
    key = [None]
    for module in (last.input_layernorm, last.self_attn, last.self_attn.o_proj):
        module.register_forward_hook(lambda m, args, kwargs, out: seen[key[0]].append(
            tuple((args[0] if args else kwargs["hidden_states"]).shape)), with_kwargs=True)
    tokens = {}
    for name, switch in (("class", "0"), ("read", "1")):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(read_rows.SWITCH, switch)
            llm = hf_paged.LLM(model, block_size=4, max_num_batched_tokens=16)
        key[0] = name
        tokens[name] = engine_tokens(model, llm=llm)
        key[0] = None
    assert tokens["read"] == tokens["class"] == [hf_tokens(model, p) for p in PROMPTS]
    assert calls and seen["read"] == seen["class"]


def test_a_replaced_part_or_another_model_code_keeps_the_class_forward(calls, monkeypatch):
    model = llama()
    found = read_rows.last_layer(model)
    assert found[0] is model.model.layers[-1] and read_rows.unchanged(found)
    llm = hf_paged.LLM(model, block_size=4, max_num_batched_tokens=16)
    model.model.norm = type(model.model.norm)(model.config.hidden_size, eps=model.config.rms_norm_eps)
    assert not read_rows.unchanged(found)
    assert engine_tokens(model, llm=llm) == [hf_tokens(model, p) for p in PROMPTS]
    assert calls == []
    adapted = llama()
    llm = hf_paged.LLM(adapted, block_size=4, max_num_batched_tokens=16)
    mlp = adapted.model.layers[-1].mlp
    mlp.up_proj = Scaled(mlp.up_proj)  # a projection of another kind: it might mix rows
    assert engine_tokens(adapted, llm=llm) == [hf_tokens(adapted, p) for p in PROMPTS]
    assert calls == []
    assert read_rows.last_layer(tiny_model("gemma2")) is None  # Gemma's model and norm code: not the ones checked
    assert read_rows.last_layer(tiny_model("phi3")) is None  # a base model code checked, another decoder layer code
    fewer = llama()
    fewer.config.num_hidden_layers = 1  # the forward runs layers[:1]: that one is the last
    assert read_rows.last_layer(fewer)[0] is fewer.model.layers[0]
    monkeypatch.setattr(read_rows, "KNOWN_BASES", {})
    read_rows._base_known.cache_clear()
    try:
        assert read_rows.last_layer(llama()) is None
    finally:
        monkeypatch.undo()
        read_rows._base_known.cache_clear()
    other = llama()

    class OwnForward(type(other)):  # a causal LM of its own code: it might read any row of the last layer
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)
    other.__class__ = OwnForward
    assert read_rows.last_layer(other) is None


def test_the_switch_turns_it_off(calls, monkeypatch):
    monkeypatch.setenv(read_rows.SWITCH, "0")
    model = llama()
    assert engine_tokens(model) == [hf_tokens(model, p) for p in PROMPTS]
    assert calls == []


def test_only_steps_that_read_fewer_rows_with_no_grad_cache_or_training():
    layer = llama().model.layers[-1]
    hidden = torch.zeros(1, 5, 8)
    context = types.SimpleNamespace(rows_read=torch.tensor([4]))
    with torch.inference_mode():
        assert read_rows.takes(layer, hidden, None, {"paged_context": context}) is context.rows_read
        assert read_rows.takes(layer, hidden, None, {}) is None
        assert read_rows.takes(layer, hidden, object(), {"paged_context": context}) is None
        assert read_rows.takes(layer, hidden, None, {"paged_context": context, "past_key_values": None}) is None
        every = types.SimpleNamespace(rows_read=torch.arange(5))
        assert read_rows.takes(layer, hidden, None, {"paged_context": every}) is None
        layer.train()
        assert read_rows.takes(layer, hidden, None, {"paged_context": context}) is None
        layer.eval()
    assert read_rows.takes(layer, hidden, None, {"paged_context": context}) is None  # grad enabled
