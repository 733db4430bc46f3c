"""attention/backends/torch_sdpa.py: the torch backend serves every call (fp8 caches, strided pages, every extra) and
hands it to the plain-torch attention, with the native CPU decode kernel only when asked (the numbers themselves are
test_attention.py's)."""
import torch

from hf_paged.attention import AttentionMetadata, LayerExtras
from hf_paged.attention.backends import torch_sdpa
from hf_paged.attention.backends.torch_sdpa import TorchBackend
from hf_paged.attention.extras import EXTRA_NAMES


def test_every_call_is_served():
    meta = AttentionMetadata.build([2, 1], [2, 5], [[1], [2, 3]], [0, 1, 2], 4, torch.device("cpu"))
    strided_fp8 = torch.zeros(4, 4, 4, 8, dtype=torch.float8_e4m3fn)[:, :, :2]
    backend = TorchBackend()
    assert backend.unsupported_reason(torch.zeros(3, 4, 8), strided_fp8, meta, 7, 5.0) is None
    assert TorchBackend.extras == frozenset(EXTRA_NAMES)
    backend.check_extras(LayerExtras(sinks=torch.zeros(4), alibi_slopes=torch.ones(4), chunk_size=4))


def test_forward_hands_everything_to_the_torch_attention(monkeypatch):
    seen = []
    monkeypatch.setattr(torch_sdpa, "torch_paged_attention", lambda *args, **kwargs: seen.append((args, kwargs)))
    extras = LayerExtras(sinks=torch.zeros(2))
    TorchBackend(native_decode=True).forward("q", "k", "v", "meta", 0.5, 7, 3.0, kv_scales=(2.0, 4.0), extras=extras)
    TorchBackend().forward("q", "k", "v", "meta", 0.5, None, None)
    (args, kwargs), (_, plain) = seen
    assert args == ("q", "k", "v", "meta", 0.5, 7, 3.0, None, None)
    assert kwargs == {"native_decode": True, "kv_scales": (2.0, 4.0), "extras": extras}
    assert plain["native_decode"] is False and plain["kv_scales"] == (1.0, 1.0)
