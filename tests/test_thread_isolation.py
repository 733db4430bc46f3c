"""What an engine switches for its forward is seen by its own thread only: another thread's plain forward of the same
model object, or its `save_pretrained`, made while the engine is in the middle of a forward, sees the model exactly as
the user left it. And after `hf_paged.disable()` every engine refuses with an error that says how to re-enable it.

The races are made deterministic: a forward hook on one layer, firing inside the engine's forward (the engine holding
the model's forward lock), runs the other thread's work and joins it."""
import json
import threading

import pytest
import torch

import hf_paged
from hf_paged import LLM, SamplingParams
from hf_paged.tiny import tiny_model

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 30, 7, 11], [3, 4, 5]]


def tiny_self_attending(name):
    """gpt_neo / bloom: their attention modules compute attention themselves (hf_paged swaps their forwards)."""
    import transformers as tf

    if name == "gpt_neo":
        config = tf.GPTNeoConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, window_size=4,
                                 attention_types=[[["global", "local"], 1]], max_position_embeddings=256)
    else:
        config = tf.BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=4)
    config.pad_token_id, config.bos_token_id, config.eos_token_id = 0, 1, 2
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.pad_token_id = 0
    return model


def model_for(name):
    return tiny_model(name) if name == "llama" else tiny_self_attending(name)


def first_layer(model):
    inner = model.base_model
    return (getattr(inner, "layers", None) or getattr(inner, "h"))[0]


def while_engine_forward(model, work):
    """Runs `work()` in another thread, joined, inside each engine forward (first layer's forward hook, engine thread
    only); returns the list of what each run returned or raised."""
    engine_thread = threading.get_ident()
    results = []

    def hook(module, args, output):
        if threading.get_ident() != engine_thread:
            return
        box = []

        def run():
            try:
                box.append(work())
            except Exception as e:  # noqa: BLE001 - reported by the test
                box.append(e)

        thread = threading.Thread(target=run)
        thread.start()
        thread.join(timeout=120)
        assert box, "the other thread's work did not finish (it waited for the engine?)"
        results.append(box[0])

    return first_layer(model).register_forward_hook(hook), results


@pytest.mark.parametrize("name", ["llama", "gpt_neo", "bloom"])
def test_plain_forward_in_another_thread_during_an_engine_forward_is_untouched(name, one_torch_thread):
    model = model_for(name)
    ids = torch.tensor([[5, 9, 30]])  # 3 rows: the small-linear kernel sums them in another order than F.linear
    expected_tokens = [o.token_ids for o in LLM(model).generate(PROMPTS, GREEDY, use_tqdm=False)]

    def plain():
        with torch.inference_mode():  # few rows, no grad: what the engine's small-linear kernel would take
            return model(ids).logits.clone()

    reference = plain()
    llm = LLM(model)
    handle, results = while_engine_forward(model, plain)
    try:
        got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        handle.remove()
    assert len(results) >= GREEDY.max_tokens
    errors = [r for r in results if isinstance(r, Exception)]
    assert not errors, errors[0]
    assert all(torch.equal(r, reference) for r in results)
    assert got == expected_tokens  # and the engine itself was not disturbed
    assert torch.equal(plain(), reference)
    assert all("forward" not in vars(m) for m in model.modules())


def test_save_pretrained_during_an_engine_forward_writes_a_clean_checkpoint(tmp_path, one_torch_thread):
    from transformers import AutoModelForCausalLM

    model = tiny_model("llama")
    expected = [o.token_ids for o in LLM(model).generate(PROMPTS, GREEDY, use_tqdm=False)]
    llm = LLM(model)
    saved = []

    def save():
        if not saved:
            model.save_pretrained(tmp_path)
            saved.append(True)

    handle, results = while_engine_forward(model, save)
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
    finally:
        handle.remove()
    assert saved and not [r for r in results if isinstance(r, Exception)]
    config = json.loads((tmp_path / "config.json").read_text())
    assert not [k for k in config if "hf_paged" in k], config
    assert config.get("_attn_implementation_internal") in (None, "sdpa")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config._attn_implementation == model.config._attn_implementation
    assert [o.token_ids for o in LLM(loaded).generate(PROMPTS, GREEDY, use_tqdm=False)] == expected


def test_after_disable_every_engine_says_how_to_re_enable(one_torch_thread):
    model = tiny_model("llama")
    fresh = tiny_model("llama", seed=1)
    llm = LLM(model)
    expected = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    stream = llm.stream(PROMPTS, GREEDY)
    next(stream)
    hf_paged.disable()
    try:
        with pytest.raises(RuntimeError, match=r"hf_paged\.disable\(\).*hf_paged\.enable\(\)"):
            for _ in stream:  # the snapshots of the step already run, then the next step's forward
                pass
        with pytest.raises(RuntimeError, match=r"hf_paged\.enable\(\)"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        for target in (model, fresh):
            with pytest.raises(RuntimeError, match=r"hf_paged\.enable\(\)"):
                LLM(target)
        assert model.config._attn_implementation == "sdpa"
        ids = torch.tensor([PROMPTS[0]])
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)  # plain HF
    finally:
        hf_paged.enable()
    llm.engine.check_idle()
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
    assert [o.token_ids for o in LLM(model).generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
    assert LLM(fresh).generate(PROMPTS, GREEDY, use_tqdm=False)
