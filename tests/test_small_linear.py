"""Few-row CPU linears (hf_paged/model/small_linear.py): same products as F.linear, swapped only for one forward."""
import pytest
import torch

from hf_paged.model import SmallBatchLinears
from hf_paged.model.small_linear import CHUNK, MAX_ROWS


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(48, 40)
        self.head = torch.nn.Linear(40, CHUNK + 100, bias=False)  # taller than one chunk
        self.quantized = type("QuantLinear", (torch.nn.Linear,), {})(40, 8)  # a subclass keeps its own forward

    def forward(self, x):
        h = self.proj(x)
        return self.head(h), self.quantized(h)


@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS, MAX_ROWS + 1])
def test_same_products_as_f_linear(rows):
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(1, rows, 48)
    want = net(x)
    linears = SmallBatchLinears(net)
    assert {id(m) for m in linears.modules} == {id(net.proj), id(net.head)}
    with linears.active(rows):
        got = net(x)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.is_contiguous()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_forwards_are_restored_even_on_error():
    net = Net()
    linears = SmallBatchLinears(net)
    with pytest.raises(RuntimeError):
        with linears.active(4):
            assert "forward" in vars(net.proj)  # swapped while active
            raise RuntimeError("boom")
    assert "forward" not in vars(net.proj) and "forward" not in vars(net.head)
    with linears.active(MAX_ROWS + 1):  # more rows: nothing is swapped at all
        assert "forward" not in vars(net.proj)
