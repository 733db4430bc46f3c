"""The int8 screen of a greedy LM head (hf_paged/model/int8_head.py, `greedy_pick_i8` in cpu/greedy_head.c): its
bound holds for every logit, its picks are the argmax of fp32 logits where the screen alone cannot tell, ties go to
the first index, and stale copies, changed weights and rows it cannot bound get the plain product. In the engine: the
`int8` runs of tests/test_greedy_head_engine.py."""
import pytest
import torch

from hf_paged.model import greedy_head, int8_head, packed_linear
from hf_paged.sampling import first_argmax

from test_greedy_head import Head, fp64_winners, near_ties

pytestmark = pytest.mark.skipif(not greedy_head.available(), reason="no C compiler")
I8 = greedy_head.SCREEN8


@pytest.mark.parametrize("n, k, scale", [(1001, 17, 1.0), (3000, 64, 1e-30), (3000, 100, 1e6), (4000, 512, 1e-3)])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16])
def test_the_bound_holds_for_every_logit(n, k, scale, rows):
    gen = torch.Generator().manual_seed(n + rows)
    net = Head(torch.randn(n, k, generator=gen) * scale)
    x = torch.randn(rows, k, generator=gen)
    screen, gap = greedy_head._screen(net.head, x, I8)
    weight = net.head.weight.detach()
    for logits in (x.double() @ weight.double().t(), torch.nn.functional.linear(x, weight).double()):
        error = (screen.double() - logits).abs().max(dim=1).values
        assert bool((error <= gap / 2).all())
        assert bool((error >= gap / 2 / 20).all())  # and not a vacuous bound: within 20x of the real error


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_picks_are_the_fp32_argmax_where_the_screen_cannot_tell(rows, one_torch_thread):
    x, weight = near_ties(rows, 600, 96, spread=2e-3, seed=rows)
    net = Head(weight)
    token = greedy_head.pick(net.head, x, I8)
    assert token is not None
    winners = fp64_winners(x, weight)
    assert sum(len(w) == 1 for w in winners) >= rows / 2  # mostly one clear fp32 winner per row...
    copy = packed_linear._INT8[net.head].packed
    alone = (x @ (copy.q.float() * copy.scales[:, None]).t()).argmax(dim=1)
    assert (alone != torch.tensor([min(w) for w in winners])).any()  # ...which the int8 screen alone misses
    assert [int(t) in w for t, w in zip(token, winners)] == [True] * rows


def test_a_bound_too_small_gives_wrong_picks():
    """The test above can fail: the native pass given no slack lets the screen decide alone."""
    x, weight = near_ties(16, 600, 96, spread=2e-3, seed=16)
    net = Head(weight)
    copy = packed_linear.copy_for(net.head, net.head.weight, torch.int8).packed
    token, _, _ = greedy_head.load_picker().pick_i8(copy, x, weight, torch.zeros(16, dtype=torch.float64))
    winners = fp64_winners(x, weight)
    assert not all(int(t) in w for t, w in zip(token, winners))


def test_exact_ties_go_to_the_first_index_as_first_argmax():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(301, 64, generator=gen)
    weight[[40, 41, 250]] = weight[7].clone()  # four identical rows
    x = torch.randn(8, 64, generator=gen)
    x[0] = weight[7] * 3
    net = Head(weight)
    token = greedy_head.pick(net.head, x, I8)
    assert int(token[0]) == 7
    assert token.tolist() == first_argmax(torch.nn.functional.linear(x, weight)).tolist()


def test_rows_it_cannot_bound_take_the_plain_product():
    net = Head(torch.randn(300, 64))
    x = torch.randn(4, 64)
    assert greedy_head.pick(net.head, x, I8) is not None
    x[2, 5] = float("nan")
    assert greedy_head.pick(net.head, x, I8) is None
    x[2, 5] = 1e35
    assert greedy_head.pick(net.head, x, I8) is None  # ||x|| max ||W_j|| beyond LIMIT
    tiny = Head(torch.randn(300, 64) * 1e-30)
    x = torch.randn(4, 64)
    x[1] *= 1e29  # ||x|| max ||W_j|| ~ 1: fine, but ||x|| max ||Q_j|| (~1e32) beyond LIMIT: the fp32 sums could grow
    assert greedy_head.pick(tiny.head, x, I8) is None
    assert greedy_head.pick(tiny.head, x[[0, 2, 3]], I8) is not None


def test_a_stale_copy_is_caught_by_the_picks_check():
    gen = torch.Generator().manual_seed(3)
    net, other = Head(torch.randn(300, 64, generator=gen)), Head(torch.randn(300, 64, generator=gen))
    x = torch.randn(16, 64, generator=gen)
    assert greedy_head.pick(net.head, x, I8) is not None
    packed_linear._INT8[net.head].packed = int8_head.quantize(other.head.weight.detach())  # a wrong screen
    assert greedy_head.pick(net.head, x, I8) is None
    assert packed_linear._INT8.get(net.head) is None  # dropped: the next call makes it afresh


def test_a_changed_weight_gets_a_new_copy():
    gen = torch.Generator().manual_seed(4)
    net = Head(torch.randn(500, 64, generator=gen))
    x = torch.randn(5, 64, generator=gen)
    assert greedy_head.pick(net.head, x, I8).tolist() == first_argmax(net.head(x)).tolist()
    first = packed_linear._INT8[net.head]
    with torch.no_grad():
        net.head.weight.copy_(net.head.weight.roll(7, dims=0))
    assert greedy_head.pick(net.head, x, I8).tolist() == first_argmax(net.head(x)).tolist()
    assert packed_linear._INT8[net.head] is not first
    assert packed_linear.forget([net.head]) == 1 and packed_linear._INT8.get(net.head) is None


def test_a_zero_row_and_a_short_tail_are_exact():
    """A weight row of zeros (scale 0) and sizes off the kernel's tiles (n % 4, k % 16) give the right picks."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(1003, 21, generator=gen)
    weight[1000] = 0
    x = torch.randn(7, 21, generator=gen)
    x[3] = -weight[:1000].sum(dim=0)  # row 3: most logits negative, the zero row's 0 among the largest
    net = Head(weight)
    assert greedy_head.pick(net.head, x, I8).tolist() == first_argmax(net.head(x)).tolist()


def bf16_head(weight: torch.Tensor) -> Head:
    return Head(weight.float()).to(torch.bfloat16)


@pytest.mark.parametrize("rows", [1, 4, 16])
def test_a_bf16_heads_bound_holds_against_its_rounded_logits(rows):
    gen = torch.Generator().manual_seed(rows)
    net = bf16_head(torch.randn(3001, 100, generator=gen))
    x = torch.randn(rows, 100, generator=gen).bfloat16()
    logits = torch.nn.functional.linear(x, net.head.weight)
    assert greedy_head.bound_holds(net.head, x, logits, I8)
    assert greedy_head.pick(net.head, x, I8).tolist() == first_argmax(logits).tolist()


def test_a_bf16_heads_ties_go_to_the_first_index_of_its_rounded_logits(monkeypatch):
    """Rows whose logits differ in fp32 but tie in bf16 (up to a dozen of them): the pick is the first of the tied
    bf16 maxima, as `first_argmax` of the bf16 logits takes it, not the fp32 argmax. The weight is an exact int8 copy
    (integers times a power of two: the copy's error is 0, so B_r is tiny): without the floor's widening for the
    rounding (`BF16_REL`) some picks go wrong."""
    gen = torch.Generator().manual_seed(3)
    base = torch.randint(-100, 101, (96,), generator=gen)
    base[0] = 127  # every row's largest entry: its scale is 2^-6 and its int8 values the integers themselves
    nudge = torch.randint(-1, 2, (600, 96), generator=gen) * (torch.rand(600, 96, generator=gen) < 0.05)
    nudge[:, 0] = 0
    weight = (base + nudge).float() * 2.0 ** -6
    x = torch.randn(16, 96, generator=gen)
    net = bf16_head(weight)
    x = x.bfloat16()
    logits = torch.nn.functional.linear(x, net.head.weight)
    want = first_argmax(logits)
    ties = (logits == logits.max(dim=1, keepdim=True).values).sum(dim=1)
    assert int(ties.max()) > 5 and (want != (x.float() @ net.head.weight.float().t()).argmax(dim=1)).any()
    assert greedy_head.pick(net.head, x, I8).tolist() == want.tolist()
    copy, gap = greedy_head._copy(net.head, x, I8)
    assert copy.error < 1e-4 * copy.w_norm_max  # the exact copy: only the fp32 sums' rounding is left in B_r
    monkeypatch.setattr(greedy_head, "BF16_REL", 0.0)
    token, _, _ = greedy_head.load_picker().pick_i8(copy, x.float(), net.head.weight, gap)
    assert token.tolist() != want.tolist()


def test_a_bf16_head_takes_only_the_int8_screen_and_keeps_its_own_packed_copy():
    net = bf16_head(torch.randn(500, 64))
    assert greedy_head.screens(4, torch.bfloat16) == (I8,) and greedy_head.screens(17, torch.bfloat16) == ()
    packed = packed_linear.copy_for(net.head, net.head.weight)  # the head's usual product's copy
    assert greedy_head.pick(net.head, torch.randn(3, 64).bfloat16(), I8) is not None
    assert packed_linear._INT8.get(net.head) is not None
    greedy_head.keep_copies(net.head)  # no trial, no choice: the int8 copy goes, the packed one stays
    assert packed_linear._INT8.get(net.head) is None and packed_linear._COPIES.get(net.head) is packed
