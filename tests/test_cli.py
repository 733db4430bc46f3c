"""The README's main job: `hf-paged demo` runs offline and its outputs equal HF generate's."""
from hf_paged.cli import main


def test_demo_runs_and_matches_hf(capsys):
    assert main(["demo", "--requests", "6", "--max-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "outputs identical to HF for 6/6 prompts" in out
    assert "hf_paged LLM.generate" in out and "HF generate (padded batch)" in out
