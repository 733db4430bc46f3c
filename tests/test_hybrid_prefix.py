"""The hybrid prefix-reuse benchmark (hf_paged/bench/hybrid_prefix.py) in miniature: the hits skip the shared
prefix's prefill on a Gated DeltaNet + attention model, and both runs give the same tokens."""
import json

from hf_paged.bench import hybrid_prefix


def test_prefix_hits_on_a_hybrid_model_compute_fewer_tokens_and_the_same_output(tmp_path, capsys, one_torch_thread):
    out = tmp_path / "hybrid.json"
    assert hybrid_prefix.main(["--requests", "3", "--prefix", "272", "--hidden", "32", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result == json.loads(capsys.readouterr().out)
    assert result["same_tokens"]
    plain, cached = result["no prefix caching"], result["prefix caching"]
    assert plain["prompt_tokens"] == cached["prompt_tokens"] == plain["prefill_tokens_computed"]
    # the first prompt computes the prefix; the other two hit it up to the state checkpoint at block 16 (token 256)
    assert cached["prefill_tokens_computed"] <= plain["prompt_tokens"] - 2 * 256
    assert result["fewer_prefill_tokens"] > 1.5
