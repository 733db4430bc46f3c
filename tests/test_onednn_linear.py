"""oneDNN's fp32 GEMM as a measured product (hf_paged/model/onednn_linear.py): F.linear's sums up to rounding, F.linear
itself while oneDNN is disabled, offered to few-row calls and, on their own keys, to calls of many rows (a prefill
step's), chosen only by its trial, switchable, and an engine whose linears take it gives HF's tokens. Speeds are never
measured here: a fake clock advances by fixed costs."""
import pytest
import torch

from hf_paged import trials
import hf_paged
from hf_paged.model import SmallBatchLinears, linear_choice, onednn_linear, small_linear
from hf_paged.model.linear_choice import MANY_MAX, TABLE, Key, many_bucket
from hf_paged.model.small_linear import KERNEL_MAX_ROWS, load_small_gemm
from hf_paged.tiny import tiny_model

pytestmark = pytest.mark.skipif(not onednn_linear.available(), reason="torch built without oneDNN")


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    for name in ("HF_PAGED_SMALL_LINEARS", "HF_PAGED_SMALL_GEMM", linear_choice.CACHE_SWITCH, onednn_linear.SWITCH):
        monkeypatch.delenv(name, raising=False)
    load_small_gemm.cache_clear()
    TABLE.clear()
    yield
    TABLE.clear()


def many_costs(monkeypatch, each: dict[str, float]) -> dict[str, int]:
    """Every many-row candidate's call advances a fake clock by its cost; returns the calls counted per name."""
    now, calls = [0.0], dict.fromkeys(each, 0)
    monkeypatch.setattr(trials, "clock", lambda: now[0])
    real = onednn_linear.many_row_products

    def products():
        def fake(name, f):
            def run(rows, weight, bias):
                calls[name] += 1
                now[0] += each[name]
                return f(rows, weight, bias)
            return run
        return {name: fake(name, f) for name, f in real().items() if name in each}
    monkeypatch.setattr(onednn_linear, "many_row_products", products)
    return calls


@pytest.mark.parametrize("rows, out_features, bias", [(1, 8, False), (5, 40, True), (64, 96, True), (300, 24, False)])
def test_same_sums_as_f_linear(rows, out_features, bias):
    torch.manual_seed(0)
    net = torch.nn.Linear(48, out_features, bias=bias)
    x = torch.randn(rows, 48)
    got = onednn_linear.product(x, net.weight, net.bias)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, net.weight, net.bias), rtol=1e-5, atol=1e-5)
    assert got.shape == (rows, out_features) and got.dtype is torch.float32


def test_f_linear_itself_while_onednn_is_disabled(monkeypatch):
    torch.manual_seed(0)
    net = torch.nn.Linear(48, 40)
    x = torch.randn(7, 48)
    called = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: called.append(1) or real(*a), raising=False)
    with torch.backends.mkldnn.flags(enabled=False):
        got = onednn_linear.product(x, net.weight, net.bias)
    assert not called and torch.equal(got, torch.nn.functional.linear(x, net.weight, net.bias))
    onednn_linear.product(x, net.weight, net.bias)
    assert called


def test_offered_to_few_and_many_rows_and_switched_off(monkeypatch):
    assert onednn_linear.NAME in small_linear.candidates(load_small_gemm())
    assert list(onednn_linear.many_row_products()) == [onednn_linear.NAME, "f_linear"]
    monkeypatch.setenv(onednn_linear.SWITCH, "0")
    assert onednn_linear.NAME not in small_linear.candidates(load_small_gemm())
    assert list(onednn_linear.many_row_products()) == ["f_linear"]
    assert "oneDNN's GEMM" not in small_linear.small_linear_status()


def test_many_row_buckets():
    assert [many_bucket(m) for m in (129, 256, 257, 4096, 4097, MANY_MAX, MANY_MAX + 1, 10 ** 6)] == \
        [256, 256, 512, 4096, 8192, MANY_MAX, MANY_MAX, MANY_MAX]


@pytest.mark.parametrize("winner", ["onednn", "f_linear"])
def test_many_rows_take_what_their_trial_chose(monkeypatch, winner):
    """A prefill-sized call runs its own trial (oneDNN against F.linear); the winner runs from then on; a step whose
    every linear chose F.linear swaps nothing (`plain`)."""
    costs = {"onednn": 1e-3, "f_linear": 3e-3} if winner == "onednn" else {"onednn": 3e-3, "f_linear": 1e-3}
    calls = many_costs(monkeypatch, costs)
    torch.manual_seed(0)
    net = torch.nn.Linear(48, 40)
    linears = SmallBatchLinears(net)
    rows = KERNEL_MAX_ROWS + 72
    x = torch.randn(1, rows, 48)
    want = torch.nn.functional.linear(x, net.weight, net.bias)
    key = Key((40, 48), torch.float32, 256, torch.get_num_threads(), False)
    for _ in range(4 * (1 + trials.SAMPLES)):  # a trial's calls (more than enough)
        with linears.active(), torch.inference_mode():
            torch.testing.assert_close(net(x), want, rtol=1e-5, atol=1e-5)
        if key in TABLE.fast:
            break
    assert TABLE.choices[key].path == winner and not TABLE.trials
    before = dict(calls)
    with linears.active(), torch.inference_mode():
        out = net(x)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert {n: calls[n] - before[n] for n in calls} == {n: int(n == winner) for n in calls}
    if winner == "f_linear":  # the table holds F.linear itself (here: the counting wrapper)
        TABLE.fast[key] = torch.nn.functional.linear
    assert linears.plain(rows, rows) is (winner == "f_linear")
    assert f"40x48 float32 threads={torch.get_num_threads()} (no kernel): 256 {winner}" in \
        small_linear.small_linear_status()


def test_an_engine_whose_linears_take_it_gives_hfs_tokens(monkeypatch):
    """Every trial that offers oneDNN chooses it, few rows and many alike; greedy tokens against HF's generate
    (fp32): prefill (a 150-token prompt: many rows), decode, a chunked prompt."""
    fastest = trials.fastest
    monkeypatch.setattr(trials, "fastest", lambda seconds, baseline: (
        onednn_linear.NAME if onednn_linear.NAME in seconds else fastest(seconds, baseline)))
    monkeypatch.setattr(trials, "DROP", float("inf"))  # no candidate leaves a trial early
    monkeypatch.setattr(trials, "LONG_DROP", float("inf"))
    model = tiny_model("llama")
    llm = hf_paged.LLM(model, block_size=4, max_num_batched_tokens=256, enable_prefix_caching=False)
    prompts = [[(7 * i) % 90 + 3 for i in range(150)], [5, 9, 13, 2, 7, 11, 3, 8, 21, 4, 6, 30], [4, 4, 9]]
    params = hf_paged.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    many = {Key(m.weight.shape, torch.float32, 256, torch.get_num_threads(), False) for m in model.modules()
            if type(m) is torch.nn.Linear and m is not model.lm_head}
    for _ in range(12):  # a prefill step calls each layer once: the many-row trials end within a few calls
        outs = llm.generate(prompts, params, use_tqdm=False)
        if many <= set(TABLE.fast):
            break
    chosen = {(k.rows, c.path) for k, c in TABLE.choices.items() if k.dtype is torch.float32}
    assert {TABLE.choices[k].path for k in many} == {onednn_linear.NAME}
    assert any(r <= KERNEL_MAX_ROWS and p == onednn_linear.NAME for r, p in chosen)
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            want = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)
        assert list(out.outputs[0].token_ids) == want[0, len(prompt):].tolist()
