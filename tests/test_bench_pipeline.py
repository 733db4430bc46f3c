"""The pipeline benchmark (hf_paged/bench/pipeline.py) in its smoke size: HF's pipeline and the paged one give the
same texts, and the report says what ran."""
import json

from hf_paged.bench import pipeline


def test_small_run_gives_the_same_texts_and_writes_its_report(tmp_path, capsys, one_torch_thread):
    out = tmp_path / "pipeline.json"
    assert pipeline.main(["--small", "--threads", "1", "--prompts", "5", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["same_outputs"] is True
    assert result["workload"]["prompts"] == 8 and result["workload"]["max_new_tokens"] == 8  # --small's sizes
    assert result["workload"]["threads"] == 1 and result["hf_s"] > 0 and result["hf_paged_s"] > 0
    assert result["speedup"] == result["hf_s"] / result["hf_paged_s"]
    printed = capsys.readouterr().out
    assert "same outputs:    True" in printed and "target" not in printed  # no verdict on a smoke run


def test_prompts_are_random_characters_of_the_asked_lengths():
    prompts = pipeline.make_prompts(20, 8, 12, seed=1)
    assert prompts == pipeline.make_prompts(20, 8, 12, seed=1) and prompts != pipeline.make_prompts(20, 8, 12, seed=2)
    assert all(8 <= len(p) <= 12 and p.isalnum() for p in prompts)
