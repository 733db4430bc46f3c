"""x @ (a transposed copy of W) as a measured few-row fp32 product (hf_paged/model/transposed_copy.py): chosen only by
its trial, F.linear's products up to rounding, never a stale copy (version counter, sampled values), dropped when no
bucket of its shape chose it, unavailable (not endless) over the memory budget, switchable, and an engine whose
linears take it gives HF's tokens. Speeds are never measured here: a fake clock advances by fixed costs."""
import pytest
import torch

from hf_paged import trials
import hf_paged
from hf_paged.model import SmallBatchLinears, linear_choice, packed_linear, small_linear, transposed_copy
from hf_paged.model.linear_choice import TABLE
from hf_paged.model.small_linear import load_small_gemm
from hf_paged.tiny import tiny_model


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    for name in ("HF_PAGED_SMALL_LINEARS", "HF_PAGED_SMALL_GEMM", linear_choice.CACHE_SWITCH, packed_linear.SWITCH):
        monkeypatch.delenv(name, raising=False)
    load_small_gemm.cache_clear()
    TABLE.clear()
    yield
    TABLE.clear()
    load_small_gemm.cache_clear()


def costs(monkeypatch, each: dict[str, float]) -> dict[str, int]:
    """Every candidate's call advances a fake clock by its cost (the copy's product through `multiply`, the others
    wrapped); returns the calls counted per name."""
    clock, calls = FakeClock(), dict.fromkeys(each, 0)
    monkeypatch.setattr(trials, "clock", clock)
    real_candidates, real_multiply = small_linear.candidates, transposed_copy.multiply

    def charged(name, product):
        def run(*args):
            calls[name] += 1
            clock.now += each[name]
            return product(*args)
        return run

    monkeypatch.setattr(small_linear, "candidates", lambda kernel: {
        name: (p if p is transposed_copy.MARKER else charged(name, p))
        for name, p in real_candidates(kernel).items() if name in each})
    monkeypatch.setattr(transposed_copy, "multiply", charged(transposed_copy.NAME, real_multiply))
    return calls


def run(net, x):
    with SmallBatchLinears(net).active(), torch.inference_mode():
        return net(x)


def settle(net, x):
    """Calls until no trial is left, each checked against F.linear; the last result."""
    for _ in range(100):
        out = run(net, x)
        torch.testing.assert_close(out, torch.nn.functional.linear(x, net.weight, net.bias), rtol=1e-5, atol=1e-5)
        if not TABLE.trials:
            return out
    raise AssertionError("the trial never ended")


def copy_of(net):
    return dict(packed_linear.copies_of(packed_linear.TRANSPOSED)).get(net)


def test_a_trial_can_choose_it_and_its_results_follow_every_change_of_the_weight(monkeypatch):
    calls = costs(monkeypatch, {"kernel": 5.0, "w_xt": 5.0, transposed_copy.NAME: 1.0, "f_linear": 5.0})
    torch.manual_seed(0)
    net, x = torch.nn.Linear(64, 96), torch.randn(6, 64)
    settle(net, x)
    (choice,) = TABLE.choices.values()
    assert choice.path == transposed_copy.NAME and calls[transposed_copy.NAME] >= 2
    first = copy_of(net)
    assert first is not None and first.packed.shape == (64, 96) and first.packed.is_contiguous()
    used = calls[transposed_copy.NAME]
    want = lambda: torch.nn.functional.linear(x, net.weight, net.bias)  # noqa: E731
    torch.testing.assert_close(run(net, x), want(), rtol=1e-5, atol=1e-5)
    assert calls[transposed_copy.NAME] == used + 1  # the chosen product ran
    sampled = {s + i for s in first.starts for i in range(packed_linear.PIECE)}
    spot = next(i for i in range(net.weight.numel()) if i not in sampled)
    with torch.no_grad():  # an in-place edit the samples do not see: the version counter moves
        net.weight.view(-1)[spot] += 4.0
    torch.testing.assert_close(run(net, x), want(), rtol=1e-5, atol=1e-5)
    second = copy_of(net)
    assert second is not first
    net.weight.data.copy_(torch.randn(96, 64))  # through .data: no version change; the sampled entries catch it
    torch.testing.assert_close(run(net, x), want(), rtol=1e-5, atol=1e-5)
    assert copy_of(net) is not second


def test_copies_are_dropped_once_no_bucket_of_their_shape_chose_them(monkeypatch):
    costs(monkeypatch, {"kernel": 1.0, "w_xt": 5.0, transposed_copy.NAME: 3.0, "f_linear": 5.0})
    made = []
    real_copy_for = packed_linear.copy_for
    monkeypatch.setattr(packed_linear, "copy_for", lambda *a: made.append(a[0]) or real_copy_for(*a))
    torch.manual_seed(0)
    net, x = torch.nn.Linear(64, 96), torch.randn(6, 64)
    settle(net, x)
    (choice,) = TABLE.choices.values()
    assert choice.path == "kernel" and made  # the trial made and ran the copy ...
    assert copy_of(net) is None  # ... and dropped it with the choice
    settle(net, torch.randn(40, 64))  # another bucket of the shape: its trial makes the copy again
    assert copy_of(net) is None


def test_a_module_over_the_memory_budget_makes_it_unavailable_and_the_trial_ends(monkeypatch):
    costs(monkeypatch, {"kernel": 5.0, "w_xt": 5.0, transposed_copy.NAME: 1.0, "f_linear": 5.0})
    monkeypatch.setattr(packed_linear, "_budget", [0])
    torch.manual_seed(0)
    net, x = torch.nn.Linear(64, 96), torch.randn(6, 64)
    settle(net, x)
    (choice,) = TABLE.choices.values()
    assert choice.path != transposed_copy.NAME and choice.seconds[transposed_copy.NAME] == float("inf")
    assert copy_of(net) is None


def test_switched_off_it_is_neither_offered_nor_used(monkeypatch):
    monkeypatch.setenv(packed_linear.SWITCH, "0")
    assert transposed_copy.NAME not in small_linear.candidates(load_small_gemm())
    torch.manual_seed(0)
    net, x = torch.nn.Linear(64, 96), torch.randn(6, 64)
    assert SmallBatchLinears(net).packed.modules == []
    # a choice made before it was switched off runs F.linear, making no copy
    key = linear_choice.Key(tuple(net.weight.shape), torch.float32, 8, torch.get_num_threads(),
                            load_small_gemm() is not None)
    TABLE.fast[key] = transposed_copy.MARKER
    torch.testing.assert_close(run(net, x), torch.nn.functional.linear(x, net.weight, net.bias))
    assert copy_of(net) is None


def test_an_engine_whose_linears_take_it_gives_hfs_tokens(monkeypatch):
    """Every trial that offers the copy chooses it; greedy tokens against HF's generate (fp32): prefill, decode, a
    chunked prompt."""
    fastest = trials.fastest
    monkeypatch.setattr(trials, "fastest", lambda seconds, baseline: (
        transposed_copy.NAME if transposed_copy.NAME in seconds else fastest(seconds, baseline)))
    monkeypatch.setattr(trials, "DROP", float("inf"))  # no candidate leaves a trial early (timing)
    monkeypatch.setattr(trials, "LONG_DROP", float("inf"))
    model = tiny_model("llama")
    llm = hf_paged.LLM(model, block_size=4, max_num_batched_tokens=16)
    prompts = [[5, 9, 13, 2, 7, 11, 3, 8, 21, 4, 6, 30, 12, 14, 15, 16, 17, 18, 19, 20, 22], [4, 4, 9]]
    params = hf_paged.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    chosen = [c.path for c in TABLE.choices.values()]
    assert transposed_copy.NAME in chosen
    assert any(copy_of(m) is not None for m in model.modules())
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            want = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)
        assert list(out.outputs[0].token_ids) == want[0, len(prompt):].tolist()


def test_transposed_copies_leave_half_the_budget_to_the_other_copies(monkeypatch):
    """A decode step meets its layers before its LM head: their copies must not take the head screen's room."""
    import weakref

    stores = [weakref.WeakKeyDictionary() for _ in range(3)]  # this test's copies only
    for name, store in zip(("_COPIES", "_INT8", "_TRANSPOSED"), stores):
        monkeypatch.setattr(packed_linear, name, store)
    monkeypatch.setattr(packed_linear, "STORES", tuple(stores))
    monkeypatch.setattr(packed_linear, "EXTRA_STORES", [])
    torch.manual_seed(0)
    net = torch.nn.Linear(64, 96)
    size = net.weight.numel() * 4
    monkeypatch.setattr(packed_linear, "_budget", [2 * size - 1])  # the whole budget takes it, half of it does not
    assert transposed_copy.copy_of(net, net.weight) is None
    monkeypatch.setattr(packed_linear, "_budget", [2 * size])
    assert transposed_copy.copy_of(net, net.weight) is not None


def test_no_copy_of_an_adapters_base_layer_whose_weights_peft_rewrites_mid_forward():
    """PEFT's merged layer with its adapters disabled unmerges when called (through `.data`, no version bump), after
    the forward's checks ran: its base layer's copy would be stale. Every fp32 linear's choice is the copy here."""
    pytest.importorskip("peft")
    import test_peft

    model = test_peft.peft_model()
    kernel = load_small_gemm() is not None
    for shape in {tuple(m.weight.shape) for m in model.modules() if type(m) is torch.nn.Linear}:
        for rows in linear_choice.BUCKETS:
            key = linear_choice.Key(shape, torch.float32, rows, torch.get_num_threads(), kernel)
            TABLE.fast[key] = transposed_copy.MARKER
    llm, before = test_peft.warm_llm(model)
    assert any(copy_of(m) is not None for m in model.modules())  # the copy is used where no adapter wraps
    model.merge_adapter()
    assert test_peft.serve(llm)[0] == test_peft.hf_tokens(model)
    with model.disable_adapter():  # unmerged lazily, layer by layer, inside the next forward
        test_peft.assert_fresh(llm, model, before)
