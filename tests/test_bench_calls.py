"""bench/calls.py: the per-call benchmark times both systems on the same calls and checks they gave the same tokens."""
import torch

from hf_paged.bench import calls


def test_a_case_times_both_systems_and_compares_their_tokens(one_torch_thread):
    model = calls.build("llama")
    result = calls.time_case(model, rows=2, new_tokens=3, calls=2)
    assert result["same_tokens"] is True
    assert result["hf_ms"] > 0 and result["paged_ms"] > 0
    assert abs(result["ratio"] - result["paged_ms"] / result["hf_ms"]) < 1e-9


def test_tokens_that_differ_are_reported(one_torch_thread, monkeypatch):
    model = calls.build("llama")
    original = model.generate

    def off_by_one(*args, **kwargs):
        out = original(*args, **kwargs)
        return out + 1 if kwargs.get("cache_implementation") == "paged" else out

    monkeypatch.setattr(model, "generate", off_by_one)
    assert calls.time_case(model, rows=2, new_tokens=2, calls=1)["same_tokens"] is False


def test_the_models_are_what_the_doc_says():
    qwen = calls.MODELS["qwen"][1]
    assert (qwen["hidden_size"], qwen["vocab_size"], qwen["num_hidden_layers"]) == (16, 151665, 2)
    assert calls.parse_args(["--small"]).small and calls.parse_args([]).rows == [4, 16]
    assert isinstance(torch.get_num_threads(), int)
