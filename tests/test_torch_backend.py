"""attention/torch_backend.py: the cache write every backend relies on (`store_kv`), quantizing into fp8 pages. (The
torch attention itself against the float64 reference is test_attention.py.)"""
import torch

from hf_paged.attention import store_kv


def test_store_kv_quantizes_into_fp8_pages():
    cache = torch.zeros(4, 8, 2, 16, dtype=torch.float8_e4m3fn)
    other = torch.zeros_like(cache)
    new = torch.randn(3, 2, 16) * 50
    store_kv(new, new, cache, other, torch.tensor([0, 9, 31]), k_scale=0.5, v_scale=1.0)
    flat = cache.view(-1, 2, 16).float()
    torch.testing.assert_close(flat[[0, 9, 31]] * 0.5, new, atol=4.0, rtol=0.07)
    assert flat[1].abs().sum() == 0
