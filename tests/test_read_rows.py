"""The last decoder layer computes, after its attention, only the rows the LM head reads (hf_paged/model/read_rows.py):
an engine that does gives HF's tokens; the rows read hold the class forward's values; a hook that would see the skip,
a replaced part, another model code or the switch keeps the class forward."""
import types

import pytest
import torch

import hf_paged
from hf_paged.model import fused_layers, layer_code, read_rows
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

    def counting(parts, rows_read, hidden_states, *args):
        seen.append((rows_read.numel(), hidden_states.shape[1]))
        return real(parts, rows_read, hidden_states, *args)
    monkeypatch.setattr(read_rows, "forward_read_rows", counting)
    return seen


def llama():
    """The tiny Llama with peaked attention and a last layer whose MLP moves the logits."""
    model = tiny_model("llama")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
        model.model.layers[-1].mlp.down_proj.weight.mul_(4.0)
    return model


def hf_tokens(model, prompt, n=8):
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def engine_tokens(model, n=8, llm=None):
    llm = llm or hf_paged.LLM(model, block_size=4, max_num_batched_tokens=16)
    params = hf_paged.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_an_engine_whose_last_layer_computes_only_the_rows_read_gives_hfs_tokens(calls):
    """Prompt chunks with no row read (the 21-token prompt's first 16), chunks that finish a prompt, decodes."""
    model = llama()
    assert engine_tokens(model) == [hf_tokens(model, p) for p in PROMPTS]
    assert any(read == 0 for read, _ in calls) and any(0 < read < rows for read, rows in calls)
    assert all(read < rows for read, rows in calls)  # decode steps (every row read) run the class forward


def test_the_rows_read_hold_the_class_forwards_values_and_the_others_the_input():
    model = llama()
    layer, parts, _, _ = read_rows.last_layer(model)
    hidden = torch.randn(1, 9, model.config.hidden_size)
    positions = torch.arange(9)[None]
    with torch.inference_mode():
        embeddings = model.model.rotary_emb(hidden, position_ids=positions)
        want = layer(hidden, position_ids=positions, position_embeddings=embeddings)
        rows = torch.tensor([2, 8])
        got = read_rows.forward_read_rows(parts, rows, hidden, None, positions, False, embeddings, {})
    torch.testing.assert_close(got[0, rows], want[0, rows], rtol=1e-6, atol=1e-6)
    others = [i for i in range(9) if i not in (2, 8)]
    assert torch.equal(got[0, others], hidden[0, others])
    assert not torch.equal(want[0, others], hidden[0, others])


@pytest.mark.parametrize("where", ["layer", "base", "norm", "o_proj", "down_proj", "act_fn"])
def test_a_hook_that_would_see_the_skip_keeps_the_class_forward(calls, where):
    model = llama()
    last = model.model.layers[-1]
    target = {"layer": last, "base": model.model, "norm": model.model.norm, "o_proj": last.self_attn.o_proj,
              "down_proj": last.mlp.down_proj, "act_fn": last.mlp.act_fn}[where]
    shapes = []
    target.register_forward_hook(lambda module, args, out: shapes.append(tuple(args[0].shape)) if args else None)
    assert engine_tokens(model) == [hf_tokens(model, p) for p in PROMPTS]
    assert calls == []


def test_a_replaced_part_or_another_model_code_keeps_the_class_forward(calls, monkeypatch):
    model = llama()
    found = read_rows.last_layer(model)
    assert found[0] is model.model.layers[-1] and read_rows.unchanged(found)
    llm = hf_paged.LLM(model, block_size=4, max_num_batched_tokens=16)
    model.model.norm = type(model.model.norm)(model.config.hidden_size, eps=model.config.rms_norm_eps)
    assert not read_rows.unchanged(found)
    assert engine_tokens(model, llm=llm) == [hf_tokens(model, p) for p in PROMPTS]
    assert calls == []
    assert read_rows.last_layer(tiny_model("mistral")) is None  # Mistral's model code: not the one checked
    fewer = llama()
    fewer.config.num_hidden_layers = 1  # the forward runs layers[:1]: that one is the last
    assert read_rows.last_layer(fewer)[0] is fewer.model.layers[0]
    monkeypatch.setitem(layer_code.KNOWN_SOURCES, "LlamaModel", "0" * 16)
    layer_code.references.cache_clear()
    try:
        assert read_rows.last_layer(llama()) is None
    finally:
        monkeypatch.undo()
        layer_code.references.cache_clear()


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
