"""bench/gpu_engine.py: the GPU check's engine step by step, run on the CPU (its dry-run path): it drives the
engine's four calls itself, so a change of their signatures must show here, not in the next GPU session."""
from hf_paged.bench.gpu_engine import engine_phases
from hf_paged.tiny import tiny_model


def test_engine_phases_time_each_call_of_a_step_and_profile_decodes(tmp_path, one_torch_thread):
    model = tiny_model("llama")
    prompts = [[5 + i, 6, 7, 8, 9][:2 + i % 3] for i in range(4)]
    result = engine_phases(model, prompts, 6, tmp_path, kv_cache_memory=2**22)
    assert set(result) == {"graphs=True", "graphs=False"}
    for summary in result.values():
        assert summary["prefill"]["steps"] >= 1 and summary["decode"]["steps"] >= 4
        assert all(summary["decode"][name] >= 0 for name in ("schedule", "moves", "run", "update"))
    for graphs in (True, False):
        text = (tmp_path / f"profile_graphs_{graphs}.txt").read_text()
        assert "aten::" in text
