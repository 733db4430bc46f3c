"""The greedy LM head (hf_paged/model/greedy_head.py): picks from a bf16 screen are the argmax of fp32 logits, near
ties and exact ties included; stale copies, non-finite rows, a bound that does not hold and other threads get the
plain product. In the engine: tests/test_greedy_head_engine.py."""
import threading

import pytest
import torch

from hf_paged.model import greedy_head, packed_linear
from hf_paged.model.linear_choice import TABLE, Key
from hf_paged.sampling import first_argmax

from conftest import cached_model

pytestmark = pytest.mark.skipif(not greedy_head.bf16_available(), reason="no oneDNN bf16 or no C compiler")


@pytest.fixture(params=["force", "int8"])
def forced(monkeypatch, request):
    """Picks wherever the screen may run: the bf16 one, or the int8 one (these tests' heads see at most 16 rows)."""
    monkeypatch.setenv(greedy_head.SWITCH, request.param)
    yield request.param


class Head(torch.nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        with torch.no_grad():
            self.head.weight.copy_(weight)


def fp64_winners(rows: torch.Tensor, weight: torch.Tensor) -> list[set[int]]:
    """Per row, every j whose float64 logit is within fp32 rounding of the row's maximum (any fp32 evaluation may
    pick one of them)."""
    exact = rows.double() @ weight.double().t()
    tolerance = 4 * rows.shape[1] * 2.0 ** -24 * (rows.double().abs() @ weight.double().abs().t())
    top = exact.max(dim=1, keepdim=True).values
    return [set((exact[r] >= top[r] - tolerance[r]).nonzero()[:, 0].tolist()) for r in range(rows.shape[0])]


def near_ties(rows: int, n: int, k: int, spread: float, seed: int = 0):
    """Rows and a weight whose logits for each row differ by ~`spread` relative: far below bf16's resolution (~4e-3)
    and far above fp32's (~1e-6), so the screen cannot order them but every fp32 evaluation agrees."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    base = torch.randn(k, generator=gen)
    weight = base + spread * torch.randn(n, k, generator=gen)
    return x, weight


@pytest.mark.parametrize("rows", [1, 3, 16, 64, 128])
def test_picks_are_the_fp32_argmax_where_the_screen_cannot_tell(rows, one_torch_thread):
    x, weight = near_ties(rows, 600, 96, spread=2e-3, seed=rows)
    net = Head(weight)
    token = greedy_head.pick(net.head, x)
    assert token is not None
    winners = fp64_winners(x, net.head.weight.detach())
    assert sum(len(w) == 1 for w in winners) >= rows / 2  # mostly one clear fp32 winner per row...
    screen = (x.bfloat16().float() @ weight.bfloat16().float().t()).argmax(dim=1)
    assert (screen != torch.tensor([min(w) for w in winners])).any()  # ...which the bf16 screen alone misses
    assert [int(t) in w for t, w in zip(token, winners)] == [True] * rows


def test_a_bound_too_small_gives_wrong_picks():
    """The test above can fail: the native pass given no slack lets the screen decide alone."""
    x, weight = near_ties(64, 600, 96, spread=2e-3, seed=64)
    screen = x.bfloat16() @ weight.bfloat16().t()
    token, _, seen = greedy_head.load_picker()(screen.contiguous(), x, weight, torch.zeros(64, dtype=torch.float64))
    winners = fp64_winners(x, weight)
    assert not all(int(t) in w for t, w in zip(token, winners))
    assert int(seen.min()) >= 1


def test_exact_ties_go_to_the_first_index_as_first_argmax():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(300, 64, generator=gen)
    weight[[40, 41, 250]] = weight[7].clone()  # four identical rows
    x = torch.randn(8, 64, generator=gen)
    x[0] = weight[7] * 3  # row 0's maximum is at 7, 40, 41, 250 alike
    net = Head(weight)
    token = greedy_head.pick(net.head, x)
    assert int(token[0]) == 7
    assert token.tolist() == first_argmax(torch.nn.functional.linear(x, weight)).tolist()


@pytest.mark.parametrize("scale", [1e-30, 1e-3, 1.0, 1e6])
def test_picks_match_first_argmax_on_random_heads_of_any_scale(scale):
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(1000, 128, generator=gen) * scale
    x = torch.randn(32, 128, generator=gen)
    net = Head(weight)
    token = greedy_head.pick(net.head, x)
    winners = fp64_winners(x, weight)
    assert all(int(t) in w for t, w in zip(token, winners))


def test_non_finite_or_huge_rows_take_the_plain_product():
    net = Head(torch.randn(300, 64))
    x = torch.randn(4, 64)
    x[2, 5] = float("nan")
    assert greedy_head.pick(net.head, x) is None
    x[2, 5] = 1e35
    assert greedy_head.pick(net.head, x) is None  # ||x|| max ||W|| beyond LIMIT


def test_a_stale_copy_is_caught_by_the_picks_check():
    gen = torch.Generator().manual_seed(3)
    net, other = Head(torch.randn(300, 64, generator=gen)), Head(torch.randn(300, 64, generator=gen))
    x = torch.randn(16, 64, generator=gen)
    assert greedy_head.pick(net.head, x) is not None
    copy = packed_linear._COPIES[net.head]
    copy.packed = packed_linear.copy_for(other.head, other.head.weight, torch.bfloat16).packed  # a wrong screen
    assert greedy_head.pick(net.head, x) is None
    assert packed_linear._COPIES.get(net.head) is None  # dropped: the next call packs afresh

def test_other_threads_and_plain_calls_get_plain_logits(forced):
    model = cached_model("llama")
    head = model.get_output_embeddings()
    x = torch.randn(1, 3, head.in_features)
    bound = greedy_head.greedy_head_forward.__get__(head)
    assert torch.equal(bound(x), torch.nn.functional.linear(x, head.weight))  # no GreedyStep set: plain
    seen = []
    step = greedy_head.GreedyStep(head, lambda m, inp: torch.nn.functional.linear(inp, m.weight))
    from hf_paged.model.switches import THIS_THREAD
    THIS_THREAD.greedy, THIS_THREAD.linears = step, {id(head)}
    try:
        worker = threading.Thread(target=lambda: seen.append(bound(x)))
        worker.start()
        worker.join()
        assert torch.equal(seen[0], torch.nn.functional.linear(x, head.weight))
        with torch.no_grad():
            placeholder = bound(x)  # this thread: picks, and a placeholder shaped like the logits
        assert step.token_ids is not None and placeholder.shape == (1, 3, head.out_features)
        assert step.token_ids.tolist() == first_argmax(torch.nn.functional.linear(x[0], head.weight)).tolist()
    finally:
        THIS_THREAD.greedy, THIS_THREAD.linears = None, set()


def test_a_screen_beyond_its_bound_is_never_chosen(monkeypatch, caplog):
    """A trial first checks the bound's premises on this machine: a screen whose bound does not hold (here: both cut
    to nothing) is no candidate; with neither, the usual product is the only one, chosen at once, with warnings."""
    monkeypatch.delenv(greedy_head.SWITCH, raising=False)
    TABLE.clear()
    try:
        gen = torch.Generator().manual_seed(4)
        net = Head(torch.randn(3000, 64, generator=gen))
        x = torch.randn(8, 64, generator=gen)
        assert greedy_head.bound_holds(net.head, x, torch.nn.functional.linear(x, net.head.weight))
        monkeypatch.setattr(greedy_head, "bound_factor", lambda k: 0.0)
        logits = torch.nn.functional.linear(x, net.head.weight)
        assert not greedy_head.bound_holds(net.head, x, logits)
        assert greedy_head.bound_holds(net.head, x, logits, greedy_head.SCREEN8)
        monkeypatch.setattr(greedy_head.int8_head, "slack", lambda norms, head, k: 0 * norms)
        assert not greedy_head.bound_holds(net.head, x, logits, greedy_head.SCREEN8)
        step = greedy_head.GreedyStep(net.head, lambda m, inp: torch.nn.functional.linear(inp, m.weight))
        key = Key(tuple(net.head.weight.shape), "greedy", 8, torch.get_num_threads(), True)
        with caplog.at_level("WARNING", logger="hf_paged"):
            assert greedy_head._trial(key, net.head, x, step) == (None, greedy_head.PLAIN)
        assert not TABLE.trials and TABLE.choices[key].source == "only candidate"
        assert "bf16 screen of a (3000, 64) LM head strayed beyond its rounding bound" in caplog.text
        assert "int8 screen of a (3000, 64) LM head strayed beyond its rounding bound" in caplog.text
        assert greedy_head.known_plain(net.head, 7)
    finally:
        TABLE.clear()


def test_status_says_whether_the_screen_is_on(monkeypatch):
    from hf_paged.model.small_linear import small_linear_status

    monkeypatch.setenv(greedy_head.SWITCH, "0")
    assert greedy_head.status() == f"off ({greedy_head.SWITCH}=0)" and not greedy_head.available()
    monkeypatch.setenv(greedy_head.SWITCH, "force")
    assert greedy_head.status() == "int8 (1-16 rows) and bf16 screens, forced (bf16)"
    monkeypatch.setenv(greedy_head.SWITCH, "int8")
    assert greedy_head.status().endswith("forced (int8)")
    monkeypatch.delenv(greedy_head.SWITCH)
    assert "LM head: int8 (1-16 rows) and bf16 screens, measured per row count" in small_linear_status()


def test_copies_of_weights_of_two_dtypes_are_verified_alike():
    """bf16 linears beside an fp32 head's bf16 screen (greedy_head): the samples of both are compared bit for bit, so
    nothing is repacked at every forward, and a write through `.data` to either is seen."""
    torch.manual_seed(0)
    proj = torch.nn.Linear(64, 48).to(torch.bfloat16)
    head = torch.nn.Linear(48, 300, bias=False)
    assert packed_linear.copy_for(proj, proj.weight) is not None
    assert packed_linear.copy_for(head, head.weight, torch.bfloat16) is not None
    packed = packed_linear.PackedLinears([proj, head])
    assert packed.verify() and packed.verify()
    assert packed_linear._COPIES.get(proj) is not None and packed_linear._COPIES.get(head) is not None
    head.weight.data.mul_(-1)
    assert not packed.verify()
    assert packed_linear._COPIES.get(head) is None and packed_linear._COPIES.get(proj) is None

