"""bench/archs.py: each model type built at the benchmark's sizes in its own process, the two systems alternating;
wrong tokens or hf_paged's failures make the exit status 1, HF's own failures do not."""
import json

from hf_paged.bench import archs


def test_a_worker_times_both_systems_on_a_type_built_at_the_benchmarks_sizes(one_torch_thread):
    result = archs.measure("gpt2", requests=2, new_tokens=2, rounds=1)
    assert result["same_tokens"] is True and result["hf_s"] > 0 and result["paged_s"] > 0
    assert result["speedup"] == result["hf_s"] / result["paged_s"]
    from hf_paged.bench.models_census import tiny

    model = tiny("gpt2", archs.SIZES)
    assert model.config.n_embd == 256 and model.config.vocab_size == 8000 and model.config.n_layer == 2
    # the census's own sizes left alone:
    assert tiny("gpt2").config.n_embd == 64


def test_a_failure_is_reported_with_its_phase(one_torch_thread, monkeypatch):
    from hf_paged.bench import models_census

    def broken(model_type, sizes=None):
        raise TypeError("cannot be built")
    monkeypatch.setattr(models_census, "tiny", broken)
    failed = {"type": "llama", "failed": "build", "error": "TypeError: cannot be built"}
    assert archs.measure("llama", 2, 2, 1) == failed


def test_main_counts_only_hf_pageds_failures_and_wrong_tokens(monkeypatch, tmp_path):
    outcomes = {"a": {"hf_s": 2.0, "paged_s": 1.0, "speedup": 2.0, "same_tokens": True, "rows_same": 16},
                "b": {"failed": "hf", "error": "HF fails"}, "c": {"failed": "build", "error": "no"},
                "d": {"hf_s": 1.0, "paged_s": 2.0, "speedup": 0.5, "same_tokens": True, "rows_same": 16}}
    seen = []

    def fake(command, timeout=None):
        name = command[command.index("--worker") + 1]
        seen.append(command)
        return {"type": name, **outcomes[name]}
    monkeypatch.setattr(archs, "run_worker", fake)
    out = tmp_path / "r.json"
    assert archs.main(["--only", *outcomes, "--json", str(out)]) == 0  # slower is reported, not a failure
    assert [c[c.index("--worker") + 1] for c in seen] == list(outcomes)
    assert json.loads(out.read_text())["results"][3]["speedup"] == 0.5
    flipped = {"hf_s": 1.0, "paged_s": 1.0, "speedup": 1.0, "same_tokens": False, "rows_same": 15}
    for bad in ({"failed": "paged", "error": "ValueError"}, flipped):
        outcomes["a"] = bad
        assert archs.main(["--only", "a", "b", "--json", str(out)]) == 1
    assert archs.main(["--only", "a", "b", "--dtype", "bfloat16", "--json", str(out)]) == 0  # bf16: flips allowed
    assert seen[-1][seen[-1].index("--dtype") + 1] == "bfloat16"


def test_a_bf16_worker_casts_the_model_and_counts_the_rows_that_stayed(one_torch_thread):
    result = archs.measure("llama", requests=3, new_tokens=2, rounds=1, dtype="bfloat16")
    assert result["dtype"] == "bfloat16" and 0 <= result["rows_same"] <= 3 and result["paged_s"] > 0
