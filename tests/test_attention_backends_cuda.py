"""attention/backends/cuda.py: the CUDA backend's rules, checked on the CPU: decodes only, the head sizes, dtypes and
caches it reads, why it is unavailable without CUDA tensors or its prerequisites."""
import torch
from test_attention import MIXED, make_case

from hf_paged.attention import cuda_backend, why_not
from hf_paged.attention.backends.cuda import CudaBackend
from hf_paged.attention.metadata import AttentionMetadata


def _decode_case(head_dim=64, dtype=torch.float16, seqs=((1, 5), (1, 17))):
    query, kc, _, _, ctx, tables, *_ = make_case(list(seqs), 8, 2, head_dim, 16, dtype, seed=0)
    qlens = [q for q, _ in seqs]
    meta = AttentionMetadata.build(qlens, ctx.tolist(), tables.tolist(), [0] * sum(qlens), 16, "cpu")
    return query, kc, meta


def test_cuda_backend_reasons_on_cpu():
    query, kc, meta = _decode_case()
    assert "CUDA tensors" in CudaBackend.unavailable_reason(torch.device("cpu"))
    assert "CUDA tensors" in why_not("cuda", query, kc, meta, None, None)
    if not torch.cuda.is_available():
        assert cuda_backend.prerequisites_missing() is not None
        assert CudaBackend.unavailable_reason(torch.device("cuda")) == cuda_backend.prerequisites_missing()
    backend = CudaBackend()
    assert not backend.prefill and backend.decode and backend.graph_capturable and not backend.fp8
    assert backend.unsupported_reason(query, kc, meta, None, None) is None
    assert backend.unsupported_reason(query, kc, meta, 4, 30.0) is None  # window and softcap: supported
    assert "does not read scaled fp8 caches" in backend.unsupported_reason(query, kc.to(torch.float8_e4m3fn), meta,
                                                                           None, None)
    query, kc, meta = _decode_case(seqs=MIXED)
    assert "decode-only" in backend.unsupported_reason(query, kc, meta, None, None)
    query, kc, meta = _decode_case(head_dim=96)
    assert "head_dim" in backend.unsupported_reason(query, kc, meta, None, None)
    query, kc, meta = _decode_case(dtype=torch.float64)
    assert "float32 / float16 / bfloat16" in backend.unsupported_reason(query, kc, meta, None, None)
    query, kc, meta = _decode_case(dtype=torch.float32)
    assert "KV cache" in backend.unsupported_reason(query, kc.half(), meta, None, None)
