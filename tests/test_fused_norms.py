"""model/fused_norms.py: the native RMSNorm gives transformers' LlamaRMSNorm and GemmaRMSNorm output bit for bit (fp32
and bf16, row widths with and without tails, the sum's cascade levels), is used only for modules whose class runs
that very code, only during one forward of the thread that swapped it in, and leaves autograd and other dtypes to
the class."""
import itertools
import threading

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from hf_paged.model import FusedNorms, fused_norms
from hf_paged.model.fused_norms import is_llama_rms_norm, load_rms_norm, matching_lanes, verified_lanes

pytestmark = pytest.mark.skipif(load_rms_norm() is None, reason="the native RMSNorm does not build here")


@pytest.fixture(autouse=True)
def forced(monkeypatch):
    """Used wherever it matches bit for bit, whatever this machine's timing says (that is verified_lanes' own)."""
    monkeypatch.setenv("HF_PAGED_FUSED_NORMS", "force")
    verified_lanes.cache_clear()
    yield
    verified_lanes.cache_clear()


class Net(torch.nn.Module):
    def __init__(self, n=96):
        super().__init__()
        self.norm = LlamaRMSNorm(n, eps=1e-5)
        self.other = Qwen2RMSNorm(n)
        self.gemma = GemmaRMSNorm(n)
        with torch.no_grad():
            for module in (self.norm, self.other, self.gemma):
                module.weight.copy_(torch.randn(n))

    def forward(self, x):
        return self.gemma(self.other(self.norm(x)))


@pytest.mark.parametrize("kind", ["llama", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [40, 100, 512, 1000, 4096, 8200, 16408])
def test_bit_for_bit_with_transformers(n, dtype, kind):
    """Widths below one vector of every lane count, with scalar tails, with vectors left over the four sums, with
    one and two cascade levels (512: 16 steps of 4 x 8 lanes; 8200: over 256); rows from 1e-4 to 1e4. Gemma's
    weights near -1 too (1 + w near 0: its own rounding shows)."""
    lanes = matching_lanes(n, dtype, kind)
    assert lanes in fused_norms.LANES
    generator = torch.Generator().manual_seed(n)
    norm = (GemmaRMSNorm if kind == "gemma" else LlamaRMSNorm)(n, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(n, generator=generator))
        if kind == "gemma":
            norm.weight[::3] = -1 + torch.randn(len(norm.weight[::3]), generator=generator) * 1e-3
    norm = norm.to(dtype)
    x = (torch.randn(2, 33, n, generator=generator) * torch.logspace(-4, 4, 33).view(1, 33, 1)).to(dtype)
    assert torch.equal(load_rms_norm()(x, norm.weight, 1e-6, lanes, kind), norm(x))
    other = 8 if lanes == 16 else 16  # the other order: the same values, not the same bits
    if dtype == torch.float32:
        assert not torch.equal(load_rms_norm()(x, norm.weight, 1e-6, other, kind), norm(x))
    wrong = "llama" if kind == "gemma" else "gemma"  # the other formula: not the same values
    assert not torch.equal(load_rms_norm()(x, norm.weight, 1e-6, lanes, wrong), norm(x))


def test_which_modules_fuse():
    """LlamaRMSNorm and a class with the same code (Qwen2's) fuse as Llama's; Gemma's (1 + weight) and Gemma 3's
    (the same code) as Gemma's; not a subclass that overrides forward or Gemma's `_norm`, nor a module holding a
    forward of its own."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    net = Net()
    assert is_llama_rms_norm(net.norm) and is_llama_rms_norm(net.other) and not is_llama_rms_norm(net.gemma)
    assert [fused_norms.norm_kind(m) for m in (net.norm, net.other, net.gemma)] == ["llama", "llama", "gemma"]
    assert fused_norms.norm_kind(Gemma3RMSNorm(8)) == "gemma"
    sub = type("Scaled", (LlamaRMSNorm,), {"forward": lambda self, h: LlamaRMSNorm.forward(self, h) * 2})(8)
    assert not is_llama_rms_norm(sub) and fused_norms.norm_kind(sub) is None
    other_norm = type("Other", (GemmaRMSNorm,), {"_norm": lambda self, x: x})(8)
    assert fused_norms.norm_kind(other_norm) is None
    copy = type("Copy", (GemmaRMSNorm,), {})  # the same code: fuses, until its forward or _norm is patched
    assert fused_norms.norm_kind(copy(8)) == "gemma"
    copy.forward = lambda self, x: GemmaRMSNorm.forward(self, x) * 2
    assert fused_norms.norm_kind(copy(8)) is None
    own = GemmaRMSNorm(8)
    own._norm = lambda x: x  # an instance's own _norm: its forward calls that one
    assert fused_norms.norm_kind(own) is None
    norms = FusedNorms(net)
    assert norms.modules == [net.norm, net.other, net.gemma]
    net.other.forward = lambda h: torch.zeros_like(h)  # a hook's or wrapper's forward stays in place
    x = torch.randn(3, 96)
    with norms.active(), torch.inference_mode():
        assert "forward" in vars(net.norm)
        assert not net.other(x).any()
    assert "forward" not in vars(net.norm) and not net.other(x).any()


def test_swapped_only_for_one_forward_and_one_thread():
    """The engine's forward gets the native pass; the same model's forward in another thread meanwhile, and any
    forward after it, get the class's (the kernel is never reached: it would fail here)."""
    net = Net()
    norms = FusedNorms(net)
    x = torch.randn(2, 5, 96)
    want = net(x)
    calls = []
    kernel = load_rms_norm()
    seen = {}

    def counting(*args):
        calls.append(threading.get_ident())
        return kernel(*args)

    def other_thread():
        with torch.inference_mode():  # as an engine's forward runs (autograd would send it to the class anyway)
            seen["other"] = net(x)

    original = fused_norms.load_rms_norm
    fused_norms.load_rms_norm = lambda: counting
    try:
        with pytest.raises(RuntimeError, match="boom"):
            with norms.active(), torch.inference_mode():
                assert torch.equal(net(x), want)
                thread = threading.Thread(target=other_thread)
                thread.start()
                thread.join()
                raise RuntimeError("boom")
    finally:
        fused_norms.load_rms_norm = original
    assert calls and set(calls) == {threading.get_ident()} and len(calls) == 3  # three norms, this thread only
    assert torch.equal(seen["other"], want)
    assert all("forward" not in vars(m) for m in net.modules())


def test_autograd_and_other_dtypes_take_the_class_forward():
    net = Net()
    norms = FusedNorms(net)
    x = torch.randn(4, 96, requires_grad=True)
    with norms.active():
        out = net.norm(x)
        assert out.grad_fn is not None
        out.sum().backward()
        assert x.grad is not None
        half = net.norm.half()
        assert torch.equal(half(x.detach().half()), LlamaRMSNorm.forward(half, x.detach().half()))


def test_switched_off(monkeypatch):
    monkeypatch.setenv("HF_PAGED_FUSED_NORMS", "0")
    for cached in (load_rms_norm, matching_lanes, verified_lanes):
        cached.cache_clear()
    try:
        assert fused_norms.fused_norms_status() == "disabled by HF_PAGED_FUSED_NORMS=0"
        assert FusedNorms(Net()).modules == []
    finally:
        monkeypatch.setenv("HF_PAGED_FUSED_NORMS", "force")
        for cached in (load_rms_norm, matching_lanes, verified_lanes):
            cached.cache_clear()


@pytest.mark.parametrize("ours_faster", [True, False])
def test_used_only_where_timed_faster(monkeypatch, ours_faster):
    """Without `force` a width is used only if its 64-row pass beat transformers' forward here."""
    monkeypatch.setenv("HF_PAGED_FUSED_NORMS", "1")
    verified_lanes.cache_clear()
    turns = itertools.count()  # calls alternate: ours, theirs, ours, ...
    monkeypatch.setattr(fused_norms, "_seconds", lambda call: (1.0 if next(turns) % 2 == 0 else 2.0)
                        if ours_faster else (2.0 if next(turns) % 2 == 0 else 1.0))
    assert (verified_lanes(96, torch.float32, 1) is not None) is ours_faster
    assert (FusedNorms(Net()).modules != []) is ours_faster


def test_a_gemma_model_on_the_engine_runs_its_norms_natively_with_hfs_tokens(monkeypatch, one_torch_thread):
    """Gemma 2's norms (its (1 + weight) code) take the native pass in the engine's steps; the tokens are HF's."""
    import hf_paged
    from conftest import cached_model

    model = cached_model("gemma2")
    kernel = load_rms_norm()
    kinds = []

    def counting(*args):
        kinds.append(args[4] if len(args) > 4 else "llama")
        return kernel(*args)
    monkeypatch.setattr(fused_norms, "load_rms_norm", lambda: counting)
    prompts = [[5, 9, 14, 3, 77], [8, 8, 21], list(range(3, 30))]
    llm = hf_paged.LLM(model)
    outs = llm.generate(prompts, hf_paged.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    assert kinds and set(kinds) == {"gemma"}
    for prompt, out in zip(prompts, outs):
        want = model.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert list(out.token_ids) == want[0, len(prompt):].tolist()
