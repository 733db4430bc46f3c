"""A mixture's fp32 expert products (model/expert_products.py): transformers' own outside an engine's forward, the
native kernel and oneDNN's per-expert products the same sums as torch's grouped product, the trial's choice, and
engines of gpt-oss (input-major experts) and Mixtral (output-major) giving HF's tokens on every path."""
import threading

import pytest
import torch
from transformers.integrations import moe

import hf_paged
from hf_paged import trials
from hf_paged.model import expert_products as X
from hf_paged.model.switches import THIS_THREAD
from hf_paged.tiny import tiny_mixed, tiny_model


@pytest.fixture
def inside_engine():
    """The running thread as inside an engine's forward (ExpertProducts.active)."""
    THIS_THREAD.experts = True
    yield
    THIS_THREAD.experts = False


def grouped_inputs(sizes: list[int], k: int, n: int, input_major: bool = True, extra_rows: int = 0, seed: int = 0):
    """Rows sorted by expert (`sizes[e]` rows for expert e, then `extra_rows` past the last end), weights [E, k, n]
    stored input-major, or as a view of [E, n, k] (output-major), and the cumulative ends."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(sum(sizes) + extra_rows, k, generator=g)
    stored = torch.randn(len(sizes), k, n, generator=g) if input_major else \
        torch.randn(len(sizes), n, k, generator=g).transpose(1, 2)
    ends = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)
    return rows, stored, ends


def reference(rows, weight, ends) -> torch.Tensor:
    """Each group times its expert's weight, in float64; rows past the last end: zeros."""
    out = torch.zeros(rows.shape[0], weight.shape[2], dtype=torch.float64)
    start = 0
    for e, end in enumerate(ends.tolist()):
        out[start:end] = rows[start:end].double() @ weight[e].double()
        start = end
    return out


@pytest.mark.parametrize("sizes, k, n", [([1, 0, 2, 7], 37, 16), ([6, 13, 1], 64, 112), ([0, 5, 12, 3, 0], 600, 1040),
                                         ([40], 300, 64)])
def test_the_native_kernel_sums_each_group_like_torch(sizes, k, n):
    """Tiles of 64 and 16 columns, groups of 0 to 40 rows (passes of 6 and a remainder), k past a partial-sum block
    (256), rows past the last end come back as zeros."""
    kernel = X.load_expert_gemm()
    if kernel is None:
        pytest.skip("no C compiler")
    rows, weight, ends = grouped_inputs(sizes, k, n, extra_rows=3)
    out = kernel(rows, weight, ends)
    want = reference(rows, weight, ends)
    assert torch.allclose(out.double(), want, rtol=1e-5, atol=1e-4 * k ** 0.5)
    assert torch.equal(out[sum(sizes):], torch.zeros(3, n))


@pytest.mark.parametrize("input_major", [True, False])
def test_every_path_gives_torchs_grouped_product(input_major):
    """oneDNN's per-expert products and the native candidate (expert_gemm input-major, small_gemm per expert
    output-major) against torch's grouped product, empty groups and rows past the last end included."""
    rows, weight, ends = grouped_inputs([3, 0, 9, 1], 48, 96, input_major, extra_rows=2)
    torch_out = torch._grouped_mm(rows, weight, offs=ends)[:13]
    native = X.native_product(rows, weight)
    for path in [X.per_expert] + ([native] if native is not None else []):
        out = path(rows, weight, ends)
        assert torch.allclose(out[:13], torch_out, rtol=1e-5, atol=1e-4)
        assert torch.equal(out[13:], torch.zeros(2, 96))


@pytest.mark.parametrize("k, n, path", [(304, 80, "dispatch"), (304, 128, "pairs"), (304, 128, "widened"),
                                        (305, 128, "dispatch"), (306, 192, "dispatch")])
def test_the_bf16_kernel_rounds_its_fp32_sums_once(k, n, path):
    """bf16 input-major weights, widened exactly or (avx512_bf16, k even, n a multiple of 64) in pairs: every output
    within one bf16 spacing of the exact product (float64), as torch's (oneDNN's) bf16 product; the two round apart
    only where their fp32 sums straddle a bf16 rounding boundary."""
    kernel = X.load_expert_gemm()
    if kernel is None or (path == "pairs" and kernel.gemm_pairs_fn is None):
        pytest.skip("no C compiler" if kernel is None else "no avx512_bf16")
    rows, weight, ends = grouped_inputs([3, 0, 17, 1, 6], k, n, extra_rows=2)
    rows, weight = rows.bfloat16(), weight.bfloat16()
    if path == "widened":  # what a CPU without avx512_bf16 runs
        out = kernel._run(kernel.fns[torch.bfloat16], rows, weight, ends)
    else:
        out = kernel(rows, weight, ends)
    assert out.dtype is torch.bfloat16 and torch.equal(out[27:], torch.zeros(2, n, dtype=torch.bfloat16))
    exact = reference(rows, weight, ends)[:27]
    spacing = torch.pow(2.0, torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
    assert bool(((out[:27].double() - exact).abs() <= spacing).all())
    if k * 2 % 16 == 0:  # torch's bf16 grouped product takes rows 16-byte aligned only
        assert (out[:27] != torch._grouped_mm(rows, weight, offs=ends)[:27]).double().mean() < 0.01


@pytest.mark.parametrize("k, path", [(96, "pairs"), (48, "widened"), (96, "widened")])
def test_the_bf16_output_major_kernels_round_their_fp32_sums_once(k, path):
    """Output-major bf16 weights (a view of [E, n, k]): dot products along k, widened (k a multiple of 16) or, with
    avx512_bf16, in pairs (k a multiple of 32); as the input-major kernel, each output within one bf16 spacing of the
    exact product, rarely apart from torch's; n not a multiple of the 4-output tile."""
    kernel = X.load_expert_gemm()
    if kernel is None or (path == "pairs" and kernel.pairs_fn is None):
        pytest.skip("no C compiler" if kernel is None else "no avx512_bf16")
    rows, weight, ends = grouped_inputs([5, 0, 7, 2, 3], k, 38, input_major=False, extra_rows=2)
    rows, weight = rows.bfloat16(), weight.transpose(1, 2).contiguous().bfloat16().transpose(1, 2)
    if path == "widened" and k % 32 == 0:  # what a CPU without avx512_bf16 runs
        out = kernel._run(kernel.dot_fn, rows, weight, ends)
    else:  # the dispatch: pairs where it may, widened for k = 48
        out = kernel.dot(rows, weight, ends)
    assert out.dtype is torch.bfloat16 and torch.equal(out[17:], torch.zeros(2, 38, dtype=torch.bfloat16))
    exact = reference(rows, weight, ends)[:17]
    spacing = torch.pow(2.0, torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
    assert bool(((out[:17].double() - exact).abs() <= spacing).all())
    assert (out[:17] != torch._grouped_mm(rows, weight, offs=ends)[:17]).double().mean() < 0.02
    assert X.native_product(rows, weight) == kernel.dot


def test_a_malformed_end_cannot_send_the_kernel_past_the_rows():
    """Ends past the rows or going back are clamped before the kernel reads them (what the kernel may trust). One
    thread: groups then run in order, so a later group overlapping an earlier one (an end going back) would show."""
    kernel = X.load_expert_gemm()
    if kernel is None:
        pytest.skip("no C compiler")
    rows, weight, _ = grouped_inputs([2, 2, 2], 16, 32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = kernel(rows, weight, torch.tensor([4, 2, 99], dtype=torch.int32))
    finally:
        torch.set_num_threads(threads)
    want = reference(rows, weight, torch.tensor([4, 4, 6]))
    assert torch.allclose(out.double(), want, atol=1e-4)


def test_outside_an_engines_forward_transformers_product_runs(monkeypatch):
    """The wrapper is transformers' function unless this thread is inside an engine's forward; another thread's
    call meanwhile gets transformers' too; disable() puts transformers' own function back."""
    assert moe._grouped_mm.hf_paged_original is X._original[0]
    ran = []
    monkeypatch.setattr(X, "per_expert", lambda *a: ran.append("onednn") or torch.zeros(1))
    monkeypatch.setenv(X.SWITCH, "onednn")
    rows, weight, ends = grouped_inputs([2, 3], 16, 32)
    want = torch._grouped_mm(rows, weight, offs=ends)
    assert torch.equal(moe._grouped_mm(rows, weight, offs=ends), want) and not ran
    THIS_THREAD.experts = True
    try:
        other = []
        thread = threading.Thread(target=lambda: other.append(moe._grouped_mm(rows, weight, offs=ends)))
        thread.start()
        thread.join()
        assert torch.equal(other[0], want) and not ran
        moe._grouped_mm(rows, weight, offs=ends)
        assert ran == ["onednn"]
    finally:
        THIS_THREAD.experts = False
    original = X._original[0]
    try:
        hf_paged.disable()
        assert moe._grouped_mm is original
    finally:
        hf_paged.enable()
    assert hasattr(moe._grouped_mm, "hf_paged_original")


class Wrapped(torch.Tensor):
    """A tensor subclass standing for a quantized weight or a DTensor shard: its storage is not its values."""


@pytest.mark.parametrize("case", ["bf16", "grad", "autocast", "no_onednn", "switch_off", "subclass", "compiling"])
def test_calls_the_other_paths_do_not_take_run_transformers_product(monkeypatch, inside_engine, case):
    ran = []
    monkeypatch.setattr(X, "per_expert", lambda *a: ran.append(1) or torch.zeros(1))
    monkeypatch.setenv(X.SWITCH, "0" if case == "switch_off" else "onednn")
    rows, weight, ends = grouped_inputs([2, 3], 16, 32)
    if case == "bf16":
        rows, weight = rows.bfloat16(), weight.bfloat16()
    if case == "grad":
        weight.requires_grad_(True)
    want = torch._grouped_mm(rows, weight, offs=ends)
    if case == "subclass":
        weight = weight.as_subclass(Wrapped)
    if case == "compiling":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    if case == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            moe._grouped_mm(rows, weight, offs=ends)
    elif case == "no_onednn":  # forced onto oneDNN's path while oneDNN is off: transformers' (the kernel may run)
        with torch.backends.mkldnn.flags(enabled=False):
            assert torch.equal(moe._grouped_mm(rows, weight, offs=ends), want)
    else:
        assert torch.equal(moe._grouped_mm(rows, weight, offs=ends), want)
    assert not ran


@pytest.mark.parametrize("costs, chosen", [({"grouped_mm": 3.0, "onednn": 2.0, "kernel": 1.0}, "kernel"),
                                           ({"grouped_mm": 3.0, "onednn": 1.0, "kernel": 5.0}, "onednn"),
                                           ({"grouped_mm": 1.0, "onednn": 0.97, "kernel": 2.0}, "grouped_mm")])
def test_the_trial_keeps_transformers_product_unless_another_is_faster(monkeypatch, inside_engine, costs, chosen):
    """A fake clock charges each path its cost; the table's choice (5 % margin for the baseline) is listed by
    expert_choices() and then runs alone."""
    X.TABLE.clear()
    now = [0.0]
    monkeypatch.setattr(trials, "clock", lambda: now[0])
    calls = []

    def charged(name, function):
        def run(*args, **kwargs):
            calls.append(name)
            now[0] += costs[name]
            return function(*args, **kwargs)
        return run
    monkeypatch.setattr(X, "per_expert", charged("onednn", X.per_expert))
    native = X.native_product
    plain = torch._grouped_mm
    monkeypatch.setattr(X, "native_product",
                        lambda r, w: charged("kernel", native(r, w) or (lambda i, w, o: plain(i, w, offs=o))))
    monkeypatch.delenv(X.SWITCH, raising=False)
    rows, weight, ends = grouped_inputs([2, 3], 16, 32)
    wrapper_original = charged("grouped_mm", X._original[0])
    for _ in range(3 * (1 + trials.SAMPLES)):
        X.grouped(wrapper_original, rows, weight, ends)
    (made,) = X.expert_choices()
    assert made["path"] == chosen and made["weight"] == [2, 16, 32] and made["layout"] == "kn"
    calls.clear()
    out = X.grouped(wrapper_original, rows, weight, ends)
    assert calls == [chosen]
    assert torch.allclose(out, torch._grouped_mm(rows, weight, offs=ends), atol=1e-4)
    X.TABLE.clear()


def assert_hfs_tokens(llm, model, prompts, new):
    params = hf_paged.SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        with torch.inference_mode():
            want = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None)
        assert list(out.outputs[0].token_ids) == want[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["gpt_oss", "mixtral"])
def test_a_bf16_engine_on_the_kernel_gives_the_tokens_of_transformers_product(monkeypatch, arch):
    """bf16 gpt-oss (input-major experts) and Mixtral (output-major): forced onto the kernel, the same greedy tokens
    as with transformers' product in the same engine (bf16 hf_paged parts from HF's bf16 generate on its float32
    attention sums: probe)."""
    calls = []
    function = X.native_product

    def counted(*args):
        kernel = function(*args)
        return None if kernel is None else lambda *a: calls.append(1) or kernel(*a)
    monkeypatch.setattr(X, "native_product", counted)
    model = (tiny_mixed("gpt_oss", head_dim=16) if arch == "gpt_oss" else tiny_model("mixtral")).to(torch.bfloat16)
    prompts = [[(5 * i) % 200 + 3 for i in range(50)], [5, 9, 13, 2, 7, 11, 3, 8, 21, 4, 6, 30, 2, 9], [4, 4, 9]]
    params = hf_paged.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens = {}
    for path in ("0", "kernel"):
        monkeypatch.setenv(X.SWITCH, path)
        llm = hf_paged.LLM(model, block_size=4, max_num_batched_tokens=32)
        tokens[path] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        assert bool(calls) is (path == "kernel")
    assert tokens["kernel"] == tokens["0"]


@pytest.mark.parametrize("arch", ["gpt_oss", "mixtral"])
@pytest.mark.parametrize("path", ["kernel", "onednn"])
def test_engines_give_hfs_tokens_on_every_path(monkeypatch, arch, path):
    """Forced: every grouped product of the engine's forwards on `path` (prefill in chunks and whole, decode)."""
    calls = []
    for name in ("per_expert", "native_product"):
        function = getattr(X, name)
        monkeypatch.setattr(X, name, lambda *a, f=function, n=name: calls.append(n) or f(*a))
    monkeypatch.setenv(X.SWITCH, path)
    model = tiny_mixed("gpt_oss", head_dim=16) if arch == "gpt_oss" else tiny_model("mixtral")
    llm = hf_paged.LLM(model, block_size=4, max_num_batched_tokens=32)
    prompts = [[(5 * i) % 200 + 3 for i in range(50)], [5, 9, 13, 2, 7, 11, 3, 8, 21, 4, 6, 30, 2, 9], [4, 4, 9]]
    assert_hfs_tokens(llm, model, prompts, 8)
    assert ("per_expert" if path == "onednn" else "native_product") in calls
    rows, weight, ends = grouped_inputs([2, 3], 16, 32)
    assert torch.equal(moe._grouped_mm(rows, weight, offs=ends), torch._grouped_mm(rows, weight, offs=ends))


@pytest.mark.parametrize("dtype, input_major", [(torch.float32, True), (torch.bfloat16, True),
                                                (torch.bfloat16, False)])
def test_the_kernels_give_the_same_bits_on_any_thread_count(dtype, input_major):
    """Each output's sum has one order whichever thread computes its tile: 1 and 2 torch threads agree bit for
    bit (the kernels run on the caller's torch thread count)."""
    kernel = X.load_expert_gemm()
    if kernel is None:
        pytest.skip("no C compiler")
    rows, weight, ends = grouped_inputs([9, 0, 14, 3, 7], 64, 144, input_major)
    rows, weight = rows.to(dtype), weight.to(dtype)
    run = X.native_product(rows, weight)
    threads = torch.get_num_threads()
    try:
        outs = []
        for count in (1, 2):
            torch.set_num_threads(count)
            outs.append(run(rows, weight, ends))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


def test_a_call_the_wrapper_was_not_written_for_goes_to_transformers(monkeypatch, inside_engine):
    """Without offsets, or with keywords transformers' function may take in a later version: transformers' own (here
    its own error for an unknown keyword), never another path."""
    ran = []
    monkeypatch.setattr(X, "grouped", lambda *a: ran.append(1))
    rows, weight, ends = grouped_inputs([2, 3], 16, 32)
    with pytest.raises(TypeError):
        moe._grouped_mm(rows, weight, offs=ends, later_keyword=1)
    assert not ran
    moe._grouped_mm(rows, weight, offs=ends)
    assert ran == [1]


def test_the_kernel_switch_leaves_it_out(monkeypatch):
    """HF_PAGED_EXPERT_GEMM=0: no input-major or bf16 kernel (not built, not a candidate); fp32 output-major weights
    keep the few-row linear kernel (its own switch)."""
    monkeypatch.setenv(X.KERNEL_SWITCH, "0")
    X.load_expert_gemm.cache_clear()
    try:
        assert X.load_expert_gemm() is None
        rows, weight, _ = grouped_inputs([2, 3], 32, 32)
        assert X.native_product(rows, weight) is None
        assert X.native_product(rows.bfloat16(), weight.bfloat16()) is None
        rows, weight, _ = grouped_inputs([2, 3], 32, 32, input_major=False)
        assert X.native_product(rows.bfloat16(), weight.bfloat16()) is None
    finally:
        monkeypatch.delenv(X.KERNEL_SWITCH)
        X.load_expert_gemm.cache_clear()
