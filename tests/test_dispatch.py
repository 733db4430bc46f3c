"""The backend chooser (attention/dispatch.py): decisions made once per kind of call and memoized in the chooser,
availability (library imports) tried once, a named backend giving way to "auto" on calls it does not cover, and the
fp8 rule. CPU only; no optional library is imported (the Triton kernels must not be defined here: other test files
decide the interpreter mode first)."""
import pytest
import torch
from test_attention import MIXED, make_case

import hf_paged
from hf_paged.attention import AttentionBackend, AttentionBackends, choose_backends, dispatch, unavailable
from hf_paged.attention.backends import missing_backend
from hf_paged.attention.backends.cuda import CudaBackend
from hf_paged.attention.backends.torch_sdpa import TorchBackend
from hf_paged.attention.metadata import AttentionMetadata
from hf_paged.tiny import tiny_model

DECODES = [(1, 9), (1, 17)]


def call(seqs, dtype=torch.float32, cache_dtype=None, seed=0):
    """(query, key_cache, value_cache, metadata) of one step over `seqs` [(query_len, context_len)]."""
    query, kc, vc, cu, ctx, tables, *_ = make_case(seqs, 4, 2, 16, 8, dtype, seed)
    if cache_dtype is not None:
        kc, vc = kc.to(cache_dtype), vc.to(cache_dtype)
    qlens = [q for q, _ in seqs]
    meta = AttentionMetadata.build(qlens, ctx.tolist(), tables.tolist(), [0] * sum(qlens), 8, "cpu")
    return query, kc, vc, meta


class DecodeOnly(AttentionBackend):
    """A stand-in decode-only backend (no fp8) that records its calls."""

    name = "cuda"
    prefill = False

    def __init__(self):
        self.calls = 0

    def forward(self, query, key_cache, value_cache, metadata, scale, sliding_window, softcap, key=None,
                value=None, kv_scales=(1.0, 1.0)):
        self.calls += 1
        return TorchBackend().forward(query, key_cache, value_cache, metadata, scale, sliding_window, softcap)


@pytest.fixture
def decode_only_cuda(monkeypatch):
    """Backend "cuda" is DecodeOnly, available on CPU."""
    real = dispatch.backend_class
    monkeypatch.setattr(dispatch, "backend_class", lambda name: DecodeOnly if name == "cuda" else real(name))


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # gemma2: windowed and global layers, soft-capped logits
def test_engine_decides_each_kind_of_call_once(monkeypatch, arch):
    """Every layer of every step asks the engine's chooser; it decides each kind of call once (a prefill step and a
    decode step, times windowed / global layers), and checks the torch backend's availability once per engine. A
    run with 4x the steps makes exactly as many decisions."""
    decided, availability_checks, asked = [], [], []
    decide, backend_for = AttentionBackends._decide, AttentionBackends.backend_for
    monkeypatch.setattr(AttentionBackends, "_decide", lambda self, *a: decided.append(a) or decide(self, *a))
    monkeypatch.setattr(AttentionBackends, "backend_for", lambda self, *a: asked.append(1) or backend_for(self, *a))
    monkeypatch.setattr(TorchBackend, "unavailable_reason", classmethod(lambda cls, device: availability_checks.append(
        device)))
    model = tiny_model(arch)
    hf_paged.LLM(model, block_size=8, num_blocks=32)  # the once-per-model start-up check (its own calls) is done
    prompts = [[5, 9, 30, 7], [11, 3, 4, 5, 6, 7, 8, 9, 10]]
    counts = {}
    for max_tokens in (3, 12):
        decided.clear(), availability_checks.clear(), asked.clear()
        llm = hf_paged.LLM(model, block_size=8, num_blocks=32, attention_backend="auto")
        params = hf_paged.SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0)
        llm.generate(prompts, params, use_tqdm=False)
        backends = llm.engine.runner.backends
        assert len(decided) == len(backends.decisions)  # one decision per kind of call, never repeated
        assert len(availability_checks) == 1
        assert all(isinstance(b, TorchBackend) and b.native_decode for b in backends.decisions.values())
        counts[max_tokens] = (len(decided), len(asked))
    layer_kinds = 2 if arch == "gemma2" else 1
    assert counts[3][0] == counts[12][0] == 2 * layer_kinds  # (prefill step, decode step) x layer kinds
    assert counts[12][1] > counts[3][1] >= 3 * model.config.num_hidden_layers  # asked per layer per step


def test_a_backend_that_fails_to_import_is_tried_once(monkeypatch):
    """"auto" on an accelerator walks AUTO_ORDER; a backend whose module does not import is tried once per chooser,
    whatever the calls, and its reason kept."""
    looked_up = []
    real = dispatch.backend_class

    def backend_class(name):
        looked_up.append(name)
        return missing_backend(name, "flash3 backend could not be imported: no module") if name == "flash3" \
            else real(name)

    monkeypatch.setattr(dispatch, "backend_class", backend_class)
    monkeypatch.setattr(dispatch, "AUTO_ORDER", ("flash3", "torch"))
    backends = choose_backends("auto", torch.device("cuda"))  # a device name only: nothing runs on it
    assert looked_up == []  # nothing is imported before a call needs it
    for step in range(3):
        for seqs, window in ((MIXED, None), (DECODES, None), (DECODES, 4)):
            query, kc, vc, meta = call(seqs, seed=step)
            assert isinstance(backends.backend_for(query, kc, meta, window, None), TorchBackend)
    assert looked_up == ["flash3", "torch"]
    assert "could not be imported" in backends.unavailable["flash3"]
    assert len(backends.decisions) == 3


def test_named_backend_gives_way_to_auto_on_calls_it_does_not_cover(decode_only_cuda):
    backends = choose_backends("cuda", "cpu")
    decode, prefill = call(DECODES), call(MIXED)
    for _ in range(2):
        assert isinstance(backends.backend_for(*decode[:2], decode[3], None, None), DecodeOnly)
        fallback = backends.backend_for(*prefill[:2], prefill[3], None, None)
        assert isinstance(fallback, TorchBackend) and fallback.native_decode  # "auto" on CPU
    assert len(backends.decisions) == 2
    out = backends.attend(*decode)
    assert backends.named.calls == 1 and out.shape == decode[0].shape
    strict = choose_backends("cuda", "cpu", strict=True)
    with pytest.raises(ValueError, match="attention backend 'cuda' is not available here: .*decode-only"):
        strict.backend_for(*prefill[:2], prefill[3], None, None)


def test_only_fp8_backends_read_scaled_fp8_caches(decode_only_cuda):
    query, kc, vc, meta = call(DECODES, cache_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="does not read scaled fp8 caches"):
        choose_backends("cuda", "cpu", strict=True).attend(query, kc, vc, meta, kv_scales=(0.5, 0.5))
    backend = choose_backends("cuda", "cpu").backend_for(query, kc, meta, None, None)
    assert isinstance(backend, TorchBackend) and backend.fp8
    assert TorchBackend.fp8 and not CudaBackend.fp8


def test_named_backend_that_cannot_run_is_refused_when_chosen():
    with pytest.raises(ValueError, match="attention_backend 'flash3' cannot run on cpu: "):
        choose_backends("flash3", "cpu")
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        choose_backends("fast", "cpu")
    assert unavailable("auto", torch.device("cpu")) is None and unavailable("torch", torch.device("cpu")) is None
    assert "CUDA tensors" in unavailable("cuda", torch.device("cpu"))
    assert "unknown" in unavailable("fast", torch.device("cpu"))


def test_named_torch_is_plain_torch_and_flags():
    assert not choose_backends("torch", "cpu").named.native_decode  # the reference: no native kernel
    assert not TorchBackend.graph_capturable and CudaBackend.graph_capturable and not CudaBackend.prefill
