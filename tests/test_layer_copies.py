"""The fused layers' weight copies (hf_paged/model/layer_copies.py): each layout in its own store (fp32 transposed,
fp32 packed by oneDNN, bf16 packed), products equal to the weights' own, made again when a weight changes, dropped by
`forget` per store and by the sample check wherever a `.data` write changed them."""
import pytest
import torch

from hf_paged.model import layer_copies, packed_linear
from hf_paged.model.layer_copies import LayerCopies, Samples, copies_for, forget


class Layer(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.projs = torch.nn.ModuleList(torch.nn.Linear(32, n, bias=False) for n in (32, 16, 16, 32, 48, 48, 32))
        self.projs[6] = torch.nn.Linear(48, 32, bias=False)
        self.to(dtype)

    def weights(self):
        return [m.weight for m in self.projs]


def joined_product(copies: LayerCopies, x: torch.Tensor, which: str) -> torch.Tensor:
    weight = getattr(copies, which)
    if copies.onednn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return x @ weight


ONEDNN_FP32 = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")


@pytest.mark.parametrize("onednn", [False, pytest.param(True, marks=ONEDNN_FP32)])
def test_fp32_layouts_live_apart_and_multiply_like_the_weights(onednn):
    layer = Layer()
    copies = copies_for(layer, layer.weights(), onednn)
    assert copies is not None and copies.onednn is onednn
    assert (layer_copies._ONEDNN if onednn else layer_copies._COPIES).get(layer) is copies
    assert (layer_copies._COPIES if onednn else layer_copies._ONEDNN).get(layer) is None
    assert copies_for(layer, layer.weights(), onednn) is copies  # unchanged weights: the same copy
    x = torch.randn(5, 32)
    q, k, v = (w for w in layer.weights()[:3])
    torch.testing.assert_close(joined_product(copies, x, "qkv"), x @ torch.cat([q, k, v]).t(), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        layer.projs[1].weight.add_(1.0)  # the version counter moves: made again
    again = copies_for(layer, layer.weights(), onednn)
    assert again is not copies
    torch.testing.assert_close(joined_product(again, x, "qkv")[:, 32:48], x @ layer.projs[1].weight.t(),
                               rtol=1e-5, atol=1e-5)
    other = copies_for(layer, layer.weights(), not onednn)  # the other layout beside it
    assert other is not None and forget([layer], (layer_copies._ONEDNN,)) == 1
    assert layer_copies._COPIES.get(layer) is not None and layer_copies._ONEDNN.get(layer) is None
    assert forget([layer]) >= 1 and layer_copies._COPIES.get(layer) is None and layer_copies._ONEDNN.get(layer) is None


@pytest.mark.skipif(not packed_linear.supported(), reason="no oneDNN bf16")
def test_bf16_copies_are_packed_whatever_is_asked():
    layer = Layer(torch.bfloat16)
    copies = copies_for(layer, layer.weights(), onednn=False)
    assert copies.onednn and layer_copies._COPIES.get(layer) is copies
    assert copies_for(layer, layer.weights(), onednn=True) is copies  # bf16: one layout, one store


@pytest.mark.parametrize("onednn", [False, pytest.param(True, marks=ONEDNN_FP32)])
def test_the_sample_check_drops_copies_a_data_write_changed(onednn):
    layers = [Layer(), Layer()]
    mods = [list(layer.projs) for layer in layers]
    for layer in layers:
        copies_for(layer, layer.weights(), onednn)
    samples = Samples()
    assert samples.check(layers, mods)
    with torch.no_grad():
        layers[1].projs[4].weight.data.copy_(torch.randn(48, 32))  # no version change
    assert not samples.check(layers, mods)
    store = layer_copies._ONEDNN if onednn else layer_copies._COPIES
    assert all(store.get(layer) is None for layer in layers)
