"""Llama-coded decoder layers in joined products (hf_paged/model/fused_layers.py): an engine that takes them gives HF's
tokens; the copies follow every change of the weights (version counter, sampled values) and the memory budget; a hook
on any part, an adapter, another transformers code or the switch keeps the class forward; the path is chosen only by
its trial. Speeds are never measured here: a fake clock advances by fixed costs."""
import copy

import pytest
import torch

from hf_paged import trials
import hf_paged
from hf_paged.model import fused_layers, layer_copies, linear_choice, onednn_linear, packed_linear
from hf_paged.model.fused_layers import FusedLayers
from hf_paged.model.linear_choice import TABLE
from hf_paged.tiny import tiny_model

PROMPTS = [[5, 9, 13, 2, 7, 11, 3, 8, 21, 4, 6, 30, 12, 14, 15, 16, 17, 18, 19, 20, 22], [4, 4, 9]]


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    for name in (fused_layers.SWITCH, "HF_PAGED_SMALL_LINEARS", linear_choice.CACHE_SWITCH, packed_linear.SWITCH):
        monkeypatch.delenv(name, raising=False)
    TABLE.clear()
    yield
    TABLE.clear()


@pytest.fixture
def calls(monkeypatch):
    """Counts of the fused and the class computations of layer calls."""
    counted = {"fused": 0, "class": 0}
    for name, attribute in (("fused", "_fused"), ("class", "_class")):
        real = getattr(fused_layers, attribute)

        def counting(*args, real=real, name=name):
            counted[name] += 1
            return real(*args)
        monkeypatch.setattr(fused_layers, attribute, counting)
    return counted


def hf_tokens(model, prompt, n=10):
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def engine_tokens(llm, prompts=PROMPTS, n=10):
    params = hf_paged.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_hf(llm, model, prompts=PROMPTS):
    assert engine_tokens(llm, prompts) == [hf_tokens(model, p) for p in prompts]


def llama(sharpen_attention: float = 6.0, arch: str = "llama", dtype: torch.dtype = torch.float32, **overrides):
    """The tiny Llama (or another model with Llama's layer code) with peaked attention: its tokens depend on what each
    layer's attention computes. bf16: its layers take oneDNN's packed joined copies."""
    model = tiny_model(arch, **overrides)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(sharpen_attention)
    return model.to(dtype)


BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not packed_linear.supported(), reason="no oneDNN bf16"))
DTYPES = [torch.float32, BF16]


def new_llm(model):
    return hf_paged.LLM(model, block_size=4, max_num_batched_tokens=16)


def copies(model):
    return [layer_copies._COPIES.get(m) for m in model.model.layers]


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_engine_whose_layers_are_fused_gives_hfs_tokens(monkeypatch, calls, dtype):
    """Prefill (class forward: more rows than MAX_ROWS would be; here chunks of 16), decode and a chunked prompt; fp32
    (transposed copies) and bf16 (oneDNN's packed copies: HF's bf16 tokens on this sharpened model)."""
    monkeypatch.setenv(fused_layers.SWITCH, "force")
    model = llama(dtype=dtype)
    llm = new_llm(model)
    assert len(llm.engine.runner.layers.layers) == model.config.num_hidden_layers
    assert_hf(llm, model)
    assert calls["fused"] > 0 and all(c is not None and c.onednn is (dtype is torch.bfloat16) for c in copies(model))


@pytest.mark.parametrize("arch, dtype", [("mistral", torch.float32), ("qwen2", torch.float32),
                                         ("qwen3", torch.float32), ("qwen2", BF16.values[0])])
def test_mistral_qwen2_and_qwen3_attention_code_fused_gives_hfs_tokens(monkeypatch, calls, arch, dtype):
    """Mistral's sliding window (8 here: shorter than the prompts), Qwen2's q / k / v biases (an in-place edit of one
    followed; in bf16 too: the biases inside oneDNN's product), Qwen3's per-head q / k norms (one replaced after the
    engine started)."""
    if dtype is torch.bfloat16 and not packed_linear.supported():
        pytest.skip("no oneDNN bf16")
    monkeypatch.setenv(fused_layers.SWITCH, "force")
    # Qwen2: a window of 8 on its first layer, random q / k / v biases (they start at zero)
    windows = dict(use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    model = llama(arch=arch, dtype=dtype, **(windows if arch == "qwen2" else {}))
    if arch == "qwen2":
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("bias"):
                    parameter.normal_(0.0, 1.0)
    llm = new_llm(model)
    assert len(llm.engine.runner.layers.layers) == model.config.num_hidden_layers
    assert_hf(llm, model, PROMPTS + [list(range(3, 40))])
    assert calls["fused"] > 0
    if arch == "qwen2":
        with torch.no_grad():
            model.model.layers[0].self_attn.k_proj.bias.add_(2.0)
        llm.engine.scheduler.set_context(object())
        assert_hf(llm, model)
    if arch == "qwen3":  # a q norm replaced after the engine started: that layer runs the class forward, new norm
        attention = model.model.layers[0].self_attn
        replaced = copy.deepcopy(attention.q_norm)
        with torch.no_grad():
            replaced.weight.mul_(1.5)
        attention.q_norm = replaced
        llm.engine.scheduler.set_context(object())
        assert_hf(llm, model)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_copies_follow_every_change_of_the_weights(monkeypatch, calls, dtype):
    monkeypatch.setenv(fused_layers.SWITCH, "force")
    model = llama(dtype=dtype)
    llm = new_llm(model)
    assert_hf(llm, model)
    first = copies(model)[0]
    weight = model.model.layers[0].mlp.down_proj.weight
    sampled = {s + i for r in first.records[6:] for s in r.starts for i in range(packed_linear.PIECE)}
    spot = next(i for i in range(weight.numel()) if i not in sampled)
    with torch.no_grad():  # in place, where the samples do not look: the version counter moves
        weight.view(-1)[spot] += 4.0
    llm.engine.scheduler.set_context(object())  # new K/V only (kv_context cannot see the edit)
    assert_hf(llm, model)
    second = copies(model)[0]
    assert second is not first and second is not None
    k_proj = model.model.layers[0].self_attn.k_proj
    with torch.no_grad():  # through .data: no version change; the sampled entries catch it
        k_proj.weight.data.copy_(torch.randn(k_proj.weight.shape, dtype=dtype))
    llm.engine.scheduler.set_context(object())
    assert_hf(llm, model)
    assert copies(model)[0] is not second


def test_reset_prefix_cache_drops_the_copies(monkeypatch):
    monkeypatch.setenv(fused_layers.SWITCH, "force")
    model = llama()
    llm = new_llm(model)
    engine_tokens(llm)
    assert all(c is not None for c in copies(model))
    llm.reset_prefix_cache()
    assert all(c is None for c in copies(model))


@pytest.mark.parametrize("bias", ["attention_bias", "mlp_bias"])
def test_biases_the_fused_forward_does_not_add_keep_the_class_forward(monkeypatch, calls, bias):
    """Llama's attention_bias puts one on o_proj too, mlp_bias on the MLP's: only q / k / v biases are added."""
    monkeypatch.setenv(fused_layers.SWITCH, "force")
    model = tiny_model("llama", **{bias: True})
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0.0, 0.5)
    llm = new_llm(model)
    assert llm.engine.runner.layers.layers == []
    assert_hf(llm, model)
    assert calls["fused"] == 0


def test_a_hook_on_any_part_keeps_the_class_forward(monkeypatch, calls):
    monkeypatch.setenv(fused_layers.SWITCH, "force")
    model = llama()
    seen = []
    handle = model.model.layers[1].mlp.up_proj.register_forward_hook(lambda *a: seen.append(1))
    llm = new_llm(model)
    assert_hf(llm, model)
    assert seen and calls["fused"] > 0  # the other layer took the fused path, the hooked one the class forward
    assert layer_copies._COPIES.get(model.model.layers[1]) is None
    handle.remove()
    seen.clear()
    engine_tokens(llm)
    assert not seen and layer_copies._COPIES.get(model.model.layers[1]) is not None


def test_over_the_memory_budget_the_class_forward_runs(monkeypatch, calls):
    monkeypatch.setenv(fused_layers.SWITCH, "force")
    monkeypatch.setattr(packed_linear, "_budget", [0])
    model = llama()
    assert_hf(new_llm(model), model)
    assert calls["fused"] == 0 and all(c is None for c in copies(model))


def test_switched_off_it_finds_no_layer(monkeypatch):
    model = llama()
    assert len(FusedLayers(model).layers) == model.config.num_hidden_layers
    monkeypatch.setenv(fused_layers.SWITCH, "0")
    assert FusedLayers(model).layers == []


def test_projections_an_adapter_wraps_are_not_fused():
    pytest.importorskip("peft")
    import test_peft

    model = test_peft.peft_model()
    assert FusedLayers(model).layers == []


@pytest.mark.parametrize("fused_cost, chosen", [(1.0, fused_layers.FUSED), (5.0, fused_layers.CLASS)])
def test_the_trial_keeps_the_class_forward_unless_the_fused_one_is_faster(monkeypatch, fused_cost, chosen):
    monkeypatch.setenv("HF_PAGED_SMALL_LINEARS", "0")  # no trials of the projections' own products meanwhile
    clock = type("Clock", (), {"now": 0.0, "__call__": lambda self: self.now})()
    monkeypatch.setattr(trials, "clock", clock)
    for attribute, cost in (("_fused", fused_cost), ("_class", 3.0)):
        real = getattr(fused_layers, attribute)

        def charged(*args, real=real, cost=cost):
            clock.now += cost
            return real(*args)
        monkeypatch.setattr(fused_layers, attribute, charged)
    model = llama()
    llm = new_llm(model)
    assert_hf(llm, model)
    made = {c.path for k, c in TABLE.choices.items() if k.dtype == "layer"}
    assert made == {chosen}
    assert all((c is not None) == (chosen == fused_layers.FUSED) for c in copies(model))


@pytest.mark.skipif(not packed_linear.supported(), reason="no oneDNN bf16")
def test_an_fp32_choice_leaves_a_bf16_models_copies_of_the_same_shape():
    """Choices are per dtype ("layer", "layer bf16"): an fp32 bucket keeping the class forward drops only fp32
    copies."""
    bf16 = llama(dtype=torch.bfloat16)
    fp32 = llama()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(fused_layers.SWITCH, "force")
        engine_tokens(new_llm(bf16))
        engine_tokens(new_llm(fp32))
    assert all(c is not None for c in copies(bf16) + copies(fp32))
    key = linear_choice.Key(copies(fp32)[0].shape, "layer", 4, torch.get_num_threads(), False)
    TABLE.fast[key] = fused_layers.CLASS
    fused_layers._after_choice(key)
    assert all(c is None for c in copies(fp32)) and all(c is not None for c in copies(bf16))


@pytest.mark.skipif(not onednn_linear.available(), reason="no oneDNN")
def test_fp32_layers_on_onednn_copies_give_hfs_tokens(monkeypatch, calls):
    """The third candidate of an fp32 layer's trial: its joined weights packed by oneDNN. Chosen (forced through the
    trial), it runs from its own copies and the transposed ones go."""
    fastest = trials.fastest
    monkeypatch.setattr(trials, "fastest", lambda seconds, baseline: (
        fused_layers.FUSED_ONEDNN if fused_layers.FUSED_ONEDNN in seconds else fastest(seconds, baseline)))
    monkeypatch.setattr(trials, "DROP", float("inf"))
    monkeypatch.setattr(trials, "LONG_DROP", float("inf"))
    model = llama()
    llm = new_llm(model)
    for _ in range(8):
        assert_hf(llm, model)
        if any(k.dtype == "layer" for k in TABLE.fast):
            break
    chosen = {c.path for k, c in TABLE.choices.items() if k.dtype == "layer"}
    assert chosen == {fused_layers.FUSED_ONEDNN}
    before = calls["fused"]
    assert_hf(llm, model)
    assert calls["fused"] > before
    assert all(c is None for c in copies(model))
    assert all((c := layer_copies._ONEDNN.get(m)) is not None and c.onednn for m in model.model.layers)


@pytest.mark.parametrize("dtype", DTYPES)
def test_trials_copy_the_weights_of_a_few_layers_only(monkeypatch, dtype):
    """Eight layers of one shape: in each trial (a row bucket of one shape), the candidates that copy a module's
    weights (the fused layers' joined copies, the projections' transposed ones) run on at most trials.COPY_HOLDERS
    modules (each such copy costs a pass over the weights, most of them dropped once the trial is over); the other
    modules' calls run the rest; the tokens are HF's."""
    from hf_paged.model import small_linear

    copiers = fused_layers.COPYING | small_linear.COPYING | packed_linear.COPYING
    holders, others = {}, {}
    for table in ("trials", "choices", "fast"):  # a clean table: an earlier test's trial of these shapes left half-way
        monkeypatch.setattr(TABLE, table, {})  # holds places of its (gone) modules, freed at arbitrary calls
    # no candidate dropped early: else where the non-copying ones time 2x slower than a copying one (bf16 here, at
    # times) they leave first, and the other modules' calls can only SKIP
    monkeypatch.setattr(trials, "DROP", float("inf"))
    monkeypatch.setattr(trials, "LONG_DROP", float("inf"))
    real = TABLE.pick

    def pick(key, products, identity="", holder=0, copying=frozenset()):
        name, product = real(key, products, identity, holder, copying)
        if name is not None and name != trials.SKIP:
            (holders if name in copiers else others).setdefault(key, set()).add(holder)
        return name, product
    monkeypatch.setattr(TABLE, "pick", pick)
    model = llama(num_hidden_layers=8, dtype=dtype)
    assert_hf(new_llm(model), model)
    layer_keys = [key for key in holders if str(key.dtype).startswith("layer")]
    assert layer_keys and any(key.dtype == dtype for key in holders)
    assert all(len(modules) <= trials.COPY_HOLDERS for modules in holders.values())
    # more modules ran a timed call than hold places: the rest ran the class forward (not SKIP, not a copy)
    assert any(len(holders[key] | others.get(key, set())) > trials.COPY_HOLDERS for key in layer_keys)
