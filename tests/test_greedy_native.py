"""The native passes of the greedy head (hf_paged/model/greedy_native.py, cpu/greedy_head.c) called directly: the
int8 screen is x . q_j times the scale in fp32 for any row count and any tail of the tiles, and with a slack that
lets every j through the picks are the first argmax of the exact logits (fp32, or a bf16 head's bf16-rounded ones).
What the picks need of the slack: tests/test_int8_head.py and tests/test_greedy_head.py."""
import pytest
import torch

from hf_paged.model import greedy_native, int8_head
from hf_paged.sampling import first_argmax

pytestmark = pytest.mark.skipif(greedy_native.load_picker() is None, reason="no C compiler")


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("n, k", [(1003, 21), (64, 64), (257, 130)])
def test_the_int8_screen_is_the_scaled_dot_with_the_int8_rows(m, n, k):
    gen = torch.Generator().manual_seed(m * n + k)
    weight = torch.randn(n, k, generator=gen)
    copy = int8_head.quantize(weight)
    x = torch.randn(m, k, generator=gen)
    screen = greedy_native.load_picker().screen_i8(copy, x)
    want = (x.double() @ copy.q.double().t()) * copy.scales.double()
    assert screen.shape == (m, n)
    torch.testing.assert_close(screen.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_with_room_for_every_j_the_picks_are_the_first_argmax_of_the_exact_logits(dtype):
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(501, 40, generator=gen).to(dtype)
    weight[300] = weight[17]  # a tie: the first index
    x = torch.randn(6, 40, generator=gen).to(dtype)
    x[2] = weight[17] * 2
    copy = int8_head.quantize(weight)
    slack = torch.full((6,), 1e30, dtype=torch.float64)
    token, value, screen = greedy_native.load_picker().pick_i8(copy, x.float(), weight, slack)
    logits = torch.nn.functional.linear(x, weight)
    assert token.tolist() == first_argmax(logits).tolist() and int(token[2]) == 17
    if dtype is torch.bfloat16:  # the value: the bf16-rounded fp32 sum, as the head's usual product rounds it
        assert torch.equal(value.bfloat16().float(), value)
    torch.testing.assert_close(value, logits.float().gather(1, token[:, None])[:, 0], rtol=1e-5, atol=1e-5)
