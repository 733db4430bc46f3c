"""Few-row CPU linears (hf_paged/model/small_linear.py): the native kernel, W @ x^T and the measured choice among them
and F.linear give F.linear's products (float64 reference), are swapped in only for one forward, and never read past a
recast weight. How the measured choice is made: tests/test_linear_choice.py."""
import threading

import pytest
import torch

from hf_paged.model import SmallBatchLinears
from hf_paged.model import small_linear
from hf_paged.model.linear_choice import TABLE
from hf_paged.model.small_linear import CHUNK, KERNEL_MAX_ROWS, MAX_ROWS, load_small_gemm


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(48, 40)
        self.head = torch.nn.Linear(40, CHUNK + 100, bias=False)  # taller than one chunk
        self.quantized = type("QuantLinear", (torch.nn.Linear,), {})(40, 8)  # a subclass keeps its own forward

    def forward(self, x):
        h = self.proj(x)
        return self.head(h), self.quantized(h)


PRODUCTS = {  # fixture param -> (environment, how small_linear_status() starts)
    "kernel": ({"HF_PAGED_SMALL_LINEARS": "kernel"}, "native kernel (forced"),
    "w_xt": ({"HF_PAGED_SMALL_LINEARS": "w_xt"}, "W @ x^T (forced"),
    "kernel_missing": ({"HF_PAGED_SMALL_LINEARS": "kernel", "HF_PAGED_SMALL_GEMM": "0"}, "W @ x^T (disabled"),
    "measured": ({}, "native kernel, W @ x^T, x @ (a transposed copy of W), oneDNN's GEMM or F.linear, the fastest "
                     "measured"),
    "measured_no_kernel": ({"HF_PAGED_SMALL_GEMM": "0"},
                           "W @ x^T, x @ (a transposed copy of W), oneDNN's GEMM or F.linear, the fastest measured"),
}


@pytest.fixture(params=list(PRODUCTS))
def product(request, monkeypatch):
    """Every product: the native kernel forced (this machine has a C compiler: it must load), W @ x^T forced or as
    the forced kernel's fallback, and the measured choice (linear_choice) with and without the kernel."""
    monkeypatch.delenv("HF_PAGED_SMALL_LINEARS", raising=False)
    for name, value in PRODUCTS[request.param][0].items():
        monkeypatch.setenv(name, value)
    load_small_gemm.cache_clear()
    TABLE.clear()
    yield request.param
    load_small_gemm.cache_clear()
    TABLE.clear()


def test_the_kernel_builds_here(monkeypatch):
    monkeypatch.delenv("HF_PAGED_SMALL_LINEARS", raising=False)
    monkeypatch.delenv("HF_PAGED_SMALL_GEMM", raising=False)
    load_small_gemm.cache_clear()
    assert load_small_gemm() is not None
    assert small_linear.small_linear_status().startswith(
        "native kernel, W @ x^T, x @ (a transposed copy of W), oneDNN's GEMM or F.linear")


@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS, MAX_ROWS + 1, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1])
def test_same_products_as_f_linear(rows, product):
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(1, rows, 48)
    want = net(x)
    linears = SmallBatchLinears(net)
    assert {id(m) for m in linears.modules} == {id(net.proj), id(net.head)}
    assert small_linear.small_linear_status().startswith(PRODUCTS[product][1])
    with linears.active(), torch.inference_mode():  # as the engine runs it (with gradients: F.linear, see below)
        got = net(x)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.is_contiguous()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_each_call_picks_its_product_by_its_own_rows(monkeypatch):
    """In a prefill step the layers get many rows (F.linear) while the LM head gets only the sampled rows (the
    kernel): the choice is made per call, not per step."""
    monkeypatch.setenv("HF_PAGED_SMALL_LINEARS", "kernel")
    load_small_gemm.cache_clear()
    net = Net()
    linears = SmallBatchLinears(net)
    calls = []
    kernel = load_small_gemm()
    monkeypatch.setattr(type(kernel), "__call__", lambda self, rows, *a: calls.append(rows.shape[0]) or
                        torch.nn.functional.linear(rows, *a))
    many, few = torch.randn(1, KERNEL_MAX_ROWS + 1, 48), torch.randn(1, 3, 40)
    with linears.active(), torch.inference_mode():
        h = net.proj(many)
        out = net.head(few)
    assert calls == [3] and h.shape == (1, KERNEL_MAX_ROWS + 1, 40) and out.shape == (1, 3, CHUNK + 100)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 31, 32, 33, 48, 64, 100, KERNEL_MAX_ROWS])
@pytest.mark.parametrize("out_features, in_features", [(1, 1), (5, 7), (8, 16), (37, 33), (130, 70)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_against_float64(rows, out_features, in_features, bias):
    """Every row count of both kernel paths (dot products up to 8 rows, four at a time; 16- and 32-row tiles from 9), output
    counts that leave short tiles, inputs not a multiple of the vector width, rows strided inside a wider tensor."""
    kernel = load_small_gemm()
    assert kernel is not None
    g = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    wide = torch.randn(rows, in_features + 5, generator=g)
    x = wide[:, 2:2 + in_features]  # each row contiguous, rows in_features + 5 apart
    weight = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    want = x.double() @ weight.double().t() + (b.double() if bias else 0)
    got = kernel(x, weight, b)
    bound = (x.double().abs() @ weight.double().abs().t() + (b.double().abs() if bias else 0)) * 2e-6 + 1e-7
    assert got.shape == want.shape and bool(((got.double() - want).abs() <= bound).all())


def test_forwards_are_restored_even_on_error(product):
    net = Net()
    linears = SmallBatchLinears(net)
    with pytest.raises(RuntimeError):
        with linears.active():
            assert "forward" in vars(net.proj)  # swapped while active
            raise RuntimeError("boom")
    assert "forward" not in vars(net.proj) and "forward" not in vars(net.head)


@pytest.mark.parametrize("cast", ["double", "half"])
def test_a_model_cast_after_the_engine_was_built_gets_f_linear(cast):
    """The swapped forwards hold the modules' parameters; `model.double()` / `.half()` afterwards change their
    dtype in place. The kernel must not read them as fp32 (a read past the end of the buffer)."""
    load_small_gemm.cache_clear()
    torch.manual_seed(0)
    net = Net()
    linears = SmallBatchLinears(net)
    net.to(getattr(torch, cast))
    x = torch.randn(1, 5, 48, dtype=getattr(torch, cast))
    want = net(x)
    with linears.active(), torch.inference_mode():
        got = net(x)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_concurrent_calls_share_nothing():
    """Two threads multiplying through the kernel at once (e.g. a user's own forward while an engine runs) each get
    their own products: the kernel's scratch is per call."""
    kernel = load_small_gemm()
    weight = torch.randn(300, 200)
    inputs = [torch.randn(24, 200), torch.randn(40, 200)]
    wants = [x @ weight.t() for x in inputs]
    failures = []

    def work(x, want):
        for _ in range(200):
            if not torch.allclose(kernel(x, weight, None), want, rtol=1e-4, atol=1e-4):
                failures.append(1)

    threads = [threading.Thread(target=work, args=pair) for pair in zip(inputs, wants)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


def test_a_module_with_its_own_forward_keeps_it(product):
    """accelerate's offloading hooks (device_map with "disk" / "cpu" parts) and user wrappers put a forward on the
    instance: it is neither replaced during the step nor deleted after it."""
    net = Net()
    linears = SmallBatchLinears(net)
    net.proj.forward = lambda input: torch.zeros(*input.shape[:-1], 40)  # noqa: A002
    x = torch.randn(1, 3, 48)
    with linears.active(), torch.inference_mode():
        assert not net.proj(x).any() and "forward" in vars(net.head)
    assert not net.proj(x).any() and "forward" not in vars(net.head)


def test_gradients_and_autocast_and_replaced_parameters_follow_f_linear(product):
    """What the swapped forward must not change, in a forward that is not the engine's own (another thread on the
    same model while a step runs): autograd, CPU autocast, parameters replaced after the engine was built, the
    `input=` keyword, empty inputs."""
    torch.manual_seed(0)
    net = Net()
    linears = SmallBatchLinears(net)
    x = torch.randn(1, 5, 48, requires_grad=True)
    reference = x.detach().clone().requires_grad_()
    torch.nn.functional.linear(reference, net.proj.weight, net.proj.bias).sum().backward()
    with linears.active():
        out = net.proj(input=x)
        assert out.grad_fn is not None
        out.sum().backward()
        torch.testing.assert_close(x.grad, reference.grad)
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
            assert net.proj(x.detach()).dtype == torch.bfloat16
        with torch.no_grad():
            net.proj.weight = torch.nn.Parameter(torch.randn(40, 48))  # same shape, new values
            x2 = torch.randn(2, 48)
            torch.testing.assert_close(net.proj(x2), torch.nn.functional.linear(x2, net.proj.weight, net.proj.bias))
            net.proj.weight, net.proj.bias = torch.nn.Parameter(torch.randn(6, 48)), None  # another shape
            assert net.proj(x2).shape == (2, 6)
    empty = torch.nn.Linear(0, 5)
    with SmallBatchLinears(empty).active(), torch.no_grad():
        torch.testing.assert_close(empty(torch.randn(3, 0)), empty.bias.expand(3, 5))


@pytest.mark.parametrize("rows", [3, 16, 40])
def test_long_sums_stay_accurate(rows):
    """in_features in the thousands, all-positive data (the worst case for a running sum): the error stays within
    a few float32 roundings of the float64 result, like BLAS's blocked sums."""
    kernel = load_small_gemm()
    g = torch.Generator().manual_seed(rows)
    x = torch.rand(rows, 8192, generator=g)
    weight = torch.rand(24, 8192, generator=g)
    want = x.double() @ weight.double().t()
    error = ((kernel(x, weight, None).double() - want).abs() / want).max().item()
    blas = ((torch.nn.functional.linear(x, weight).double() - want).abs() / want).max().item()
    assert error <= max(4 * blas, 2e-6), (error, blas)


def test_a_step_whose_products_are_all_f_linear_swaps_nothing(monkeypatch):
    """Measured mode: once every layer's choice for the step's row buckets is made and is F.linear (`plain`), the
    forwards are not swapped in at all (the same F.linear, without a wrapper per call); a layer whose choice is not
    made yet, or is another product, keeps the swap."""
    monkeypatch.delenv("HF_PAGED_SMALL_LINEARS", raising=False)
    load_small_gemm.cache_clear()
    TABLE.clear()
    net = Net()
    net.get_output_embeddings = lambda: net.head
    linears = SmallBatchLinears(net)
    assert linears.head is net.head and not linears.plain(3, 1)  # nothing measured yet

    def swapped(rows, head_rows):
        with linears.active(rows, head_rows), torch.inference_mode():
            seen = "forward" in vars(net.proj), "forward" in vars(net.head)
            net.proj(torch.randn(1, rows, 48))
            net.head(torch.randn(1, head_rows, 40))
        return seen

    while not TABLE.fast or TABLE.trials:  # first calls: measured
        assert swapped(3, 1) == (True, True)
    fast = dict(TABLE.fast)
    assert len(fast) == 2
    monkeypatch.setattr(TABLE, "fast", {key: torch.nn.functional.linear for key in fast})
    assert linears.plain(3, 1) and swapped(3, 1) == (False, False)
    assert not linears.plain(3, 2) and swapped(3, 2) == (True, True)  # the head's bucket of 2 is not measured yet
    many = KERNEL_MAX_ROWS + 1  # beyond the kernels: a bucket of many rows, measured on its own (onednn_linear)
    assert not linears.plain(many, 1)
    proj_many = (net.proj.weight.shape, torch.float32, 256, torch.get_num_threads(), False)
    monkeypatch.setattr(TABLE, "fast", {**TABLE.fast, proj_many: torch.nn.functional.linear})
    assert linears.plain(many, 1)
    assert linears.plain_steps == {(3, 1, torch.get_num_threads()), (many, 1, torch.get_num_threads())}
    other = SmallBatchLinears(net)
    monkeypatch.setattr(TABLE, "fast", {**TABLE.fast, next(iter(fast)): small_linear._w_xt})
    assert not other.plain(3, 1)
    TABLE.clear()
