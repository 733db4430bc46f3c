"""The start-up check's float32 reference (hf_paged/model/fp32_attention.py, probe.py): the model's own attention
function on float32 inputs; registered only while hf_paged is enabled; a bf16 model whose router amplifies the
attention's rounding (a random gpt-oss-shaped stack) is served, on the check's word, and a bf16 model with positions
wrong after cached context is still refused."""
import pytest
import torch

import hf_paged
import hf_paged.model.paged_forward as paged_forward
from hf_paged import LLM
from hf_paged.bench import throughput
from hf_paged.model import fp32_attention, probe
from hf_paged.tiny import tiny_model

from conftest import chunk_blind, tiny_biogpt


def test_the_wrapper_runs_the_models_own_attention_on_float32_inputs():
    import transformers.models.llama.modeling_llama as llama

    model = tiny_model("llama", dtype=torch.bfloat16, attn_implementation="eager")
    module = model.model.layers[0].self_attn
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, heads, 7, 16).bfloat16() for heads in (4, 2, 2))
    mask = torch.full((7, 7), float("-inf")).triu(1)[None, None].bfloat16()
    out, _ = fp32_attention.eager_float32(module, q, k, v, mask, scaling=0.25)
    want, _ = llama.eager_attention_forward(module, q.float(), k.float(), v.float(), mask.float(), scaling=0.25)
    assert out.dtype is torch.bfloat16 and torch.equal(out, want.bfloat16())
    bf16, _ = llama.eager_attention_forward(module, q, k, v, mask, scaling=0.25)
    assert not torch.equal(out, bf16)  # the model's own bf16 sums round otherwise


def test_registered_only_while_enabled():
    from transformers import AttentionInterface

    names = set(fp32_attention.NAMES.values())
    assert names <= set(AttentionInterface._global_mapping)
    hf_paged.disable()
    try:
        assert not names & set(AttentionInterface._global_mapping)
    finally:
        hf_paged.enable()
    assert names <= set(AttentionInterface._global_mapping)


def test_no_reference_for_an_attention_it_does_not_wrap():
    model = tiny_model("llama")
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(fp32_attention.NoReference), fp32_attention.float32_attention([model.config]):
        pass


def gpt_oss_bf16():
    """The throughput benchmark's gpt-oss-shaped stack in bf16: its own bf16 forward and its float32-attention one
    part by a router flip on the check's random prompts (measured: 0.25 of the largest logit at one step)."""
    setup = throughput.workload("gpt_oss", False)
    return throughput.build_model("gpt_oss", setup["model"]).to(torch.bfloat16)


def test_a_bf16_model_whose_router_amplifies_rounding_is_served(monkeypatch, caplog):
    model = gpt_oss_bf16()
    LLM(model, block_size=16)  # served
    assert "agree with its own forward summing its attention in float32" in caplog.text
    model.__dict__.pop("_hf_paged_probe", None)
    monkeypatch.setattr(probe, "_float32_reference", lambda *args: float("inf"))  # without the second reference
    with pytest.raises(ValueError, match="'gpt_oss'.*does not reproduce"):
        LLM(model, block_size=16)


def test_a_bf16_model_with_positions_wrong_after_cached_context_is_still_refused(monkeypatch, one_torch_thread):
    model = tiny_biogpt().to(torch.bfloat16)
    LLM(model)  # served as it is
    model.__dict__.pop("_hf_paged_probe", None)
    references = []
    real = probe._float32_reference
    monkeypatch.setattr(probe, "_float32_reference", lambda *args: references.append(real(*args)) or references[-1])
    monkeypatch.setattr(paged_forward, "sequence_positions", chunk_blind(paged_forward.sequence_positions))
    with pytest.raises(ValueError, match="'biogpt'.*does not reproduce"):
        LLM(model)
    # asked on the check's tokens and on other random tokens (the second draw), and disagreed on both
    assert len(references) == 2 and min(references) > probe.TOLERANCE.get(torch.bfloat16, 3e-2)


def test_a_bf16_model_that_parts_on_one_draw_only_is_served(monkeypatch, caplog, one_torch_thread):
    """A near tie that rounding flips shows on some tokens only: one logit of the check's first draw put off by a
    flip's worth (its float32-attention reference parts as well) is served, on the other draw's agreement, with a
    warning; refused without that second draw; in fp32 there is none."""
    real = probe._paged_logits
    calls = []

    def flipped_once(model, spec, backends, sequences):
        paged, windows = real(model, spec, backends, sequences)
        calls.append(sequences)
        if len(calls) == 1:  # the first draw: the last step of the last sequence flipped
            paged[-1][-1] = paged[-1][-1].clone()
            paged[-1][-1][0] += paged[-1][-1].abs().max()
        return paged, windows

    monkeypatch.setattr(probe, "_paged_logits", flipped_once)
    model = tiny_model("llama").to(torch.bfloat16)
    LLM(model)
    assert "agree with it on other random tokens" in caplog.text
    assert len(calls) == 2 and calls[0] != calls[1]
    for dtype, second in ((torch.bfloat16, lambda *args: float("inf")), (torch.float32, None)):
        model = tiny_model("llama").to(dtype)
        calls.clear()
        if second is not None:
            monkeypatch.setattr(probe, "_another_draw", second)
        with pytest.raises(ValueError, match="'llama'.*does not reproduce"):
            LLM(model)
        assert len(calls) == 1


@pytest.mark.parametrize("where", ["_float32_reference", "_another_draw"])
def test_an_interrupt_in_a_second_opinion_keeps_no_verdict(monkeypatch, where, one_torch_thread):
    """A bf16 model over the tolerance on the check's first draw, interrupted while a second opinion is computed:
    nothing is kept as its verdict, so the next engine checks again (and here refuses it) instead of serving it."""
    real = probe._paged_logits

    def flipped(model, spec, backends, sequences):
        paged, windows = real(model, spec, backends, sequences)
        paged[-1][-1] = paged[-1][-1].clone()
        paged[-1][-1][0] += paged[-1][-1].abs().max()
        return paged, windows

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(probe, "_paged_logits", flipped)
    model = tiny_model("llama").to(torch.bfloat16)
    with monkeypatch.context() as patch:
        patch.setattr(probe, where, interrupted)
        with pytest.raises(KeyboardInterrupt):
            LLM(model)
    with pytest.raises(ValueError, match="'llama'.*does not reproduce"):
        LLM(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_nan_the_paged_path_alone_gives_is_refused_at_any_step(monkeypatch, dtype, one_torch_thread):
    """A NaN in the paged logits where the model's own forward has none, at the check's last step (not its first):
    refused, in bf16 too (a NaN is no near tie: no second draw forgives it)."""
    real = probe._paged_logits
    draws = []

    def nan_once(model, spec, backends, sequences):
        paged, windows = real(model, spec, backends, sequences)
        draws.append(sequences)
        if len(draws) == 1:
            paged[-1][-1] = paged[-1][-1].clone()
            paged[-1][-1][0] = float("nan")
        return paged, windows

    monkeypatch.setattr(probe, "_paged_logits", nan_once)
    with pytest.raises(ValueError, match="'llama'.*does not reproduce"):
        LLM(tiny_model("llama").to(dtype))
    assert len(draws) == 1
