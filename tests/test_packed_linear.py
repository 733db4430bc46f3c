"""bf16 CPU linears on oneDNN's packed copies (hf_paged/model/packed_linear.py): F.linear's products up to bf16
rounding, never a stale copy (version counter, address, sampled values), memory bounded, switchable, and an engine
whose linears take them gives HF's tokens up to bf16 rounding flips."""
import pytest
import torch

from hf_paged import trials
from hf_paged.model import SmallBatchLinears, packed_linear
from hf_paged.model.linear_choice import TABLE

pytestmark = pytest.mark.skipif(not packed_linear._onednn_bf16(), reason="no oneDNN bf16 in this torch build")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(64, 48)
        self.head = torch.nn.Linear(48, 300, bias=False)

    def forward(self, x):
        return self.head(self.proj(x))


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setenv(packed_linear.SWITCH, "force")
    TABLE.clear()
    yield
    TABLE.clear()


def make(seed=0):
    torch.manual_seed(seed)
    return Net().to(torch.bfloat16)


def run(net, linears, x):
    with linears.active(), torch.inference_mode():
        return net(x)


def close(a, b):
    """Equal up to bf16 rounding of sums accumulated in another order."""
    return torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("rows", [1, 3, 64, 128, 129, 300])
def test_packed_products_are_f_linears(forced, rows):
    net = make()
    linears = SmallBatchLinears(net)
    assert set(map(id, linears.packed.modules)) == {id(net.proj), id(net.head)}
    x = torch.randn(1, rows, 64, dtype=torch.bfloat16)
    want = net(x)
    got = run(net, linears, x)
    assert got.shape == want.shape and got.dtype == torch.bfloat16 and close(got, want)
    assert (packed_linear._COPIES.get(net.proj) is not None) == (rows <= 128)  # beyond 128 rows: F.linear


def test_outside_the_swap_and_in_other_threads_a_plain_forward_runs(forced):
    net = make()
    linears = SmallBatchLinears(net)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    assert torch.equal(net(x), torch.nn.functional.linear(torch.nn.functional.linear(x, net.proj.weight, net.proj.bias),
                                                          net.head.weight))
    assert packed_linear._COPIES.get(net.proj) is None
    run(net, linears, x)
    assert "forward" not in vars(net.proj)


def sampled_entries(copy, weight):
    """Which entries of `weight` (flattened) the copy's samples read."""
    flat = weight.detach().view(-1)
    sampled = torch.zeros(flat.numel(), dtype=torch.bool)
    for view in copy.sample_views(weight):
        start = (view.data_ptr() - flat.data_ptr()) // flat.element_size()
        sampled[start:start + view.numel()] = True
    return sampled


def change_through_data(weight, how):
    new = torch.randn_like(weight)
    if how == "copy_":
        weight.data.copy_(new)
    elif how == "add_":  # PEFT's LoRA merge: base_layer.weight.data += delta
        weight.data += new
    return new


@pytest.mark.parametrize("how", ["in_place", "in_place_unsampled", "copy_", "add_", "new_storage", "load_state_dict"])
def test_a_changed_weight_is_never_read_from_a_stale_copy(forced, how):
    """Each way a weight changes after it was packed: in place through the tensor (version counter), through `.data`
    (no version bump: the sampled values), given new storage (address), `load_state_dict` (copy_ under no_grad)."""
    net = make()
    linears = SmallBatchLinears(net)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    before = run(net, linears, x)
    old = packed_linear._COPIES[net.proj]
    with torch.no_grad():
        if how == "in_place":
            net.proj.weight.mul_(-3)
        elif how == "in_place_unsampled":  # through the tensor (version bump), no sampled entry changed
            net.proj.weight.view(-1)[~sampled_entries(old, net.proj.weight)] = 0
        elif how in ("copy_", "add_"):
            change_through_data(net.proj.weight, how)
        elif how == "new_storage":
            net.proj.weight.data = torch.randn_like(net.proj.weight)
        else:
            net.load_state_dict(make(seed=1).state_dict())
    got = run(net, linears, x)
    assert close(got, net(x)) and not close(got, before)
    assert packed_linear._COPIES[net.proj] is not old


def test_a_data_write_missing_every_sample_needs_forget(forced):
    """The documented blind spot: a `.data` write to entries no sample covers keeps the copy;
    `PackedLinears.forget()` (what `reset_prefix_cache()` calls) drops it."""
    net = make()
    linears = SmallBatchLinears(net)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    run(net, linears, x)
    copy = packed_linear._COPIES[net.proj]
    net.proj.weight.data.view(-1)[~sampled_entries(copy, net.proj.weight)] = 0  # no version bump, samples kept
    assert packed_linear._COPIES[net.proj] is copy and linears.packed.verify()
    stale = run(net, linears, x)
    assert not close(stale, net(x))  # the blind spot is real
    assert linears.packed.forget() == 2
    assert close(run(net, linears, x), net(x))


def test_memory_budget_bounds_the_copies(forced, monkeypatch):
    net = make()
    taken = sum(c.nbytes for c in packed_linear._all_copies())  # other tests' models may still be alive
    padded = torch.ops.mkldnn._nbytes(torch.ops.mkldnn._reorder_linear_weight(net.proj.weight.detach(), 64))
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    if padded > net.proj.weight.numel() * 2:  # oneDNN pads it here (on an AVX-512 Xeon: 6 KiB of weight, 8 KiB packed)
        monkeypatch.setattr(packed_linear, "_budget", [taken + net.proj.weight.numel() * 2])  # not its copy's size
        linears = SmallBatchLinears(net)
        assert close(run(net, linears, x), net(x)) and packed_linear._COPIES.get(net.proj) is None
    monkeypatch.setattr(packed_linear, "_budget", [taken + padded])  # room for proj's copy only
    linears = SmallBatchLinears(net)
    assert close(run(net, linears, x), net(x))
    assert packed_linear._COPIES.get(net.proj) is not None and packed_linear._COPIES.get(net.head) is None


def test_switched_off_and_fp32_take_no_packed_copies(monkeypatch):
    monkeypatch.setenv(packed_linear.SWITCH, "0")
    assert SmallBatchLinears(make()).packed.modules == SmallBatchLinears(make().float()).packed.modules == []
    monkeypatch.setenv(packed_linear.SWITCH, "force")
    monkeypatch.setenv("HF_PAGED_SMALL_LINEARS", "0")  # everything off
    assert SmallBatchLinears(make()).packed.modules == []
    monkeypatch.delenv("HF_PAGED_SMALL_LINEARS")
    run(net := make().float(), SmallBatchLinears(net), torch.randn(2, 64))
    assert packed_linear._COPIES.get(net.proj) is None and packed_linear._COPIES.get(net.head) is None


def test_gradients_and_autocast_get_f_linear(forced):
    net = make()
    linears = SmallBatchLinears(net)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    with linears.active():
        y = net(x)
    assert y.grad_fn is not None  # F.linear recorded the graph; the packed product records none
    assert packed_linear._COPIES.get(net.proj) is None


def test_copies_die_with_their_module(forced):
    import gc

    net = make()
    linears = SmallBatchLinears(net)
    run(net, linears, torch.randn(2, 64, dtype=torch.bfloat16))
    mine = {id(packed_linear._COPIES[net.proj]), id(packed_linear._COPIES[net.head])}
    del net, linears
    gc.collect()
    assert not mine & {id(c) for c in packed_linear._COPIES.values()}


def test_measured_choice_is_reported(monkeypatch):
    monkeypatch.delenv(packed_linear.SWITCH, raising=False)
    TABLE.clear()
    net, x = make(), torch.randn(3, 64, dtype=torch.bfloat16)
    linears = SmallBatchLinears(net)
    for _ in range(2 * (1 + trials.SAMPLES)):  # the trials: the candidates in turn, each result right
        assert close(run(net, linears, x), net(x))
    assert not TABLE.trials
    chosen = {(tuple(c["shape"]), c["rows"]): c for c in TABLE.report()}
    assert set(chosen) == {((48, 64), 4), ((300, 48), 4)}
    assert all(set(c["us"]) == {"packed", "f_linear"} and c["dtype"] == "bfloat16" for c in chosen.values())
    TABLE.clear()


@pytest.mark.parametrize("mode", ["force", "0"])
def test_engine_tokens_match_hf_bf16_up_to_rounding_flips(mode, monkeypatch, one_torch_thread):
    """A bf16 tiny llama through the engine with every linear on its packed copy (and with none): greedy tokens
    part from HF bf16 `generate` only where the two choices are within a few bf16 spacings in fp32 math."""
    import hf_paged
    from conftest import fp32_divergences
    from hf_paged.tiny import tiny_model

    monkeypatch.setenv(packed_linear.SWITCH, mode)
    model = tiny_model("llama").to(torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (5, 17, 9, 30)]
    want = []
    for p in prompts:  # HF's own generate (no cache_implementation="paged")
        out = model.generate(torch.tensor([p]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
        want.append(out[0, len(p):].tolist())
    llm = hf_paged.LLM(model)
    params = hf_paged.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    got = [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    packed = [m for m in llm.engine.runner.linears.packed.modules if packed_linear._COPIES.get(m) is not None]
    assert bool(packed) == (mode == "force")
    found = fp32_divergences(model, prompts, got, want)
    assert all(gap <= 4 * spacing for _, _, gap, spacing in found), found


def test_peft_merge_and_unmerge_repack_the_base_weights(forced, one_torch_thread):
    """PEFT merges a LoRA adapter into the base weights through `.data` (`+=`, or `= ` with safe_merge) and unmerges
    with `-=`: no version bump. An LLM on the bf16 model, every linear on its packed copy, serves the merged and the
    unmerged model's own tokens (HF bf16 `generate`, up to rounding flips), never the copy of weights before."""
    peft = pytest.importorskip("peft")
    import hf_paged
    from conftest import fp32_divergences
    from hf_paged.tiny import tiny_model

    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                             init_lora_weights=False)
    model = peft.get_peft_model(tiny_model("llama", seed=3), config).to(torch.bfloat16).eval()
    prompts = [[5, 9, 30, 31, 32], [40, 41, 7]]
    params = hf_paged.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = hf_paged.LLM(model, enable_prefix_caching=False)

    def check(label):
        got = [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        want = [model.generate(input_ids=torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                               pad_token_id=0)[0, len(p):].tolist() for p in prompts]
        found = fp32_divergences(model, prompts, got, want)
        assert all(gap <= 4 * spacing for _, _, gap, spacing in found), (label, found)
        return got

    with_adapter = check("adapter")
    packed = [m for m in llm.engine.runner.linears.packed.modules if packed_linear._COPIES.get(m) is not None]
    assert len(packed) > 20  # the base layers (and the LoRA matrices) ran on packed copies
    with model.disable_adapter():
        base = check("base")
    assert base != with_adapter, "the adapter does not change these tokens: the test tests nothing"
    model.merge_adapter()
    check("merged")
    model.unmerge_adapter()
    with model.disable_adapter():
        check("unmerged, disabled")
    model.merge_adapter(safe_merge=True)  # new storage
    check("safe-merged")


def test_a_weight_that_cannot_be_packed_runs_f_linear(forced, monkeypatch, caplog):
    """oneDNN refusing a weight (or no memory for its copy) costs speed, not the step: F.linear, one warning."""
    def refuse(weight, hint):
        raise RuntimeError("no packing today")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    net = make()
    linears = SmallBatchLinears(net)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    for _ in range(2):
        assert torch.equal(run(net, linears, x), net(x))
    assert packed_linear._COPIES.get(net.proj) is None
    assert sum("no packing today" in r.getMessage() for r in caplog.records) == 2  # once per weight shape


def test_a_copy_does_not_keep_a_replaced_weight_alive(forced):
    """A weight given new storage (`model.to(...)`, `.data = ...`): its copy holds no view of it, and the next
    forward's check drops the stale copy and every view of the old storage (then only the caller holds it)."""
    net = make()
    linears = SmallBatchLinears(net)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    run(net, linears, x)
    run(net, linears, x)  # its check joined views of the packed weights
    old = net.proj.weight.data
    net.proj.weight.data = old.clone()

    def holders(t):
        return torch._C._storage_Use_Count(t.untyped_storage()._cdata)

    alone = holders(torch.empty(3))  # a tensor nobody else holds (the storage object asked adds its own count)
    assert holders(old) > alone  # the engine's joined sample still views it, until the next forward
    assert linears.packed.verify()  # the other copies still hold; the stale one is dropped
    assert packed_linear._COPIES.get(net.proj) is None and holders(old) == alone
    assert close(run(net, linears, x), net(x))


@pytest.mark.parametrize("how", ["new_storage", "in_place"])
def test_copy_for_repacks_a_changed_weight(how):
    """The per-call check alone (without the forward's sample check): other storage or a bumped version repacks."""
    net = make()
    first = packed_linear.copy_for(net.proj, net.proj.weight)
    assert packed_linear.copy_for(net.proj, net.proj.weight) is first
    with torch.no_grad():
        if how == "new_storage":
            net.proj.weight.data = net.proj.weight.data.clone()
        else:
            net.proj.weight.view(-1)[5] += 1
    assert packed_linear.copy_for(net.proj, net.proj.weight) is not first


def test_a_nan_in_a_sampled_entry_is_no_change(forced, monkeypatch):
    """Samples compare bit for bit: a NaN weight entry does not drop and repack every copy at every forward."""
    packs = []
    real = packed_linear.PackedCopy.__init__
    monkeypatch.setattr(packed_linear.PackedCopy, "__init__", lambda self, w, cast=None: (packs.append(1), real(self, w, cast))[1])
    net = make()
    with torch.no_grad():
        net.proj.weight.view(-1)[0] = float("nan")
    linears = SmallBatchLinears(net)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    for _ in range(4):
        run(net, linears, x)
    assert len(packs) == 2  # proj and head, once each


def test_other_storage_at_the_packed_weights_address_is_not_the_packed_weight(forced):
    """New storage where the packed weight's was (an allocator hands a freed address out again; here another storage
    object over the same memory, through numpy, stands in for it), same shape, version 0, edited only where no
    sample reads: the copy knows its storage (a weak reference to it), not only its address."""
    net = make()
    linears = SmallBatchLinears(net)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    run(net, linears, x)
    copy = packed_linear._COPIES[net.proj]
    weight = net.proj.weight.data
    alias = torch.from_numpy(weight.view(torch.int16).numpy()).view(torch.bfloat16)  # same memory, new storage
    assert alias.data_ptr() == copy.address and alias.untyped_storage()._cdata != copy.storage.cdata
    net.proj.weight.data = alias
    assert net.proj.weight._version == copy.version
    with torch.no_grad():  # through numpy's buffer: unsampled entries only, no version bump
        alias.view(-1)[~sampled_entries(copy, alias)] *= -8
    assert not copy.matches(net.proj.weight)
    assert close(run(net, linears, x), net(x))


def test_a_same_address_reinterpretation_and_a_strided_bias_get_f_linear(forced):
    net = make()
    linears = SmallBatchLinears(net)
    for _ in range(2):
        run(net, linears, torch.randn(2, 64, dtype=torch.bfloat16))
    net.proj.weight.data = net.proj.weight.data.view(torch.float16)  # same storage and address, another dtype
    net.proj.bias.data = net.proj.bias.data.view(torch.float16)
    x = torch.randn(2, 64, dtype=torch.float16)
    assert torch.equal(run(net.proj, linears, x), net.proj(x))
    other = make()
    other.proj.bias = torch.nn.Parameter(torch.randn(96, dtype=torch.bfloat16)[::2])  # a strided bias
    linears = SmallBatchLinears(other)
    y = torch.randn(2, 64, dtype=torch.bfloat16)
    assert close(run(other, linears, y), other(y))


def test_a_copy_dropped_by_another_thread_meanwhile_is_no_error(forced, monkeypatch):
    """`reset_prefix_cache()` of another engine on the model (another thread) drops the copies between a call's look
    at its copy and its repack: the call packs anew."""
    net = make()
    linears = SmallBatchLinears(net)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    run(net, linears, x)
    net.proj.weight.data = net.proj.weight.data.clone()  # its next call repacks
    real = packed_linear._LOCK

    class DropFirst:  # the other thread's forget() runs as this call takes the lock
        def __enter__(self):
            packed_linear._COPIES.pop(net.proj, None)
            return real.__enter__()

        def __exit__(self, *exc):
            return real.__exit__(*exc)

    monkeypatch.setattr(packed_linear, "_LOCK", DropFirst())
    monkeypatch.setattr(linears.packed, "verify", lambda: True)  # as if the weight changed after the check
    assert close(run(net, linears, x), net(x))


def test_inference_tensors_and_recomputed_weights_are_not_packed(forced):
    """A weight made under inference_mode has no version counter (an in-place edit of unsampled entries would go
    unseen): not packed. A pruned weight is recomputed on every call (a new tensor each time): not packed either."""
    with torch.inference_mode():
        net = make()
    linears = SmallBatchLinears(net)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    run(net, linears, x)
    assert packed_linear._COPIES.get(net.proj) is None
    with torch.inference_mode():
        net.proj.weight[1:4].mul_(-8)
        assert close(run(net, linears, x), net(x))
    pruned = make()
    from torch.nn.utils import prune

    prune.random_unstructured(pruned.proj, "weight", amount=0.3)
    linears = SmallBatchLinears(pruned)
    assert close(run(pruned, linears, x), pruned(x))
    assert packed_linear._COPIES.get(pruned.proj) is None and packed_linear._COPIES.get(pruned.head) is not None

