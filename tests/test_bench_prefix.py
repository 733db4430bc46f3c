"""bench/prefix.py: its shared-prefix prompts, the two scenarios on an engine (burst: all at once; warm: the rest
once the first prompt is computed), the summary's two prefill counts, and a whole run (parent and workers in this
process) on a workload far smaller than --small's: reuse computes the shared prefix once and gives the same tokens."""
import json

import pytest

import hf_paged
from hf_paged.bench import prefix
from hf_paged.tiny import tiny_model

TINY = dict(model=dict(vocab_size=300, hidden=32, layers=1, heads=2, kv_heads=1, max_len=512, intermediate_size=64),
            requests=4, system_prompt=48, question=(3, 6), max_tokens=3, budget=512)


def test_prompts_share_the_system_prompt():
    prompts = prefix.make_prompts(TINY, 5)
    assert prompts == prefix.make_prompts(TINY, 5) and prompts != prefix.make_prompts(TINY, 5, seed=1)
    system = prompts[0][:48]
    assert all(p[:48] == system and 3 <= len(p) - 48 <= 6 for p in prompts)
    assert prefix.make_prompts(TINY, 5, seed=1)[0][:48] != system  # another seed, another system prompt


@pytest.fixture
def llm(one_torch_thread):
    model = tiny_model("llama", seed=0, sharpen=1.0, **TINY["model"])
    return hf_paged.LLM(model, block_size=16, num_blocks=40, max_num_seqs=4, max_num_batched_tokens=512,
                        enable_chunked_prefill=True, enable_prefix_caching=True)


def test_warm_adds_the_rest_after_the_first_prompt_and_they_hit_the_cache(llm):
    prompts = prefix.make_prompts(TINY, 4)
    r = prefix.scenario(llm, hf_paged, prompts, 3, "warm")
    assert r["num_cached_tokens"][0] == 0 and r["num_cached_tokens"][1:] == [48, 48, 48]  # 3 whole blocks of 16
    first_token = r["added"][0] + r["ttft"][0]
    assert all(a >= first_token for a in r["added"][1:])  # the rest arrive once the first prompt is computed
    assert r["output_lens"] == [3] * 4 and r["prompt_tokens"] == sum(len(p) for p in prompts)
    assert r["stats"]["prefix_cache_hit_tokens"] == 3 * 48
    assert all(t > 0 for t in r["ttft"]) and r["total_s"] == max(r["finished"])


def test_burst_adds_everything_at_once(llm):
    r = prefix.scenario(llm, hf_paged, prefix.make_prompts(TINY, 4, seed=5), 3, "burst")
    assert len(set(r["added"])) == 4 and max(r["added"]) < min(r["ttft"][0], r["finished"][0])
    assert r["stats"]["num_generated_tokens"] == 12 and len(r["tokens"]) == 4


def record(scenario, ttft, hit_tokens, batched, cached, output_lens=(3, 3, 3, 3)):
    return {"scenario": scenario, "ttft": ttft, "num_cached_tokens": cached, "output_lens": list(output_lens),
            "prompt_tokens": 200, "total_s": 2.0,
            "stats": {"num_batched_tokens": batched, "prefix_cache_hit_tokens": hit_tokens, "num_steps": 9,
                      "num_preemptions": 0}}


def test_summary():
    s = prefix.summarise(record("warm", [0.5, 0.1, 0.2, 0.3], 144, 64, [0, 48, 48, 48]))
    assert s["decode_tokens"] == 8 and s["prefill_computed_from_batched"] == 56
    assert s["prefill_computed_from_hits"] == 56 and s["hit_tokens"] == 144 and s["requests_with_hit"] == 3
    assert s["ttft_count"] == 3 and s["ttft_p50_ms"] == pytest.approx(200.0)  # warm: the first request left out
    assert s["first_request_ttft_ms"] == pytest.approx(500.0) and s["ttft_max_ms"] == pytest.approx(300.0)
    burst = prefix.summarise(record("burst", [0.5, 0.1, 0.2, 0.3], 0, 208, [0, 0, 0, 0]))
    assert burst["ttft_count"] == 4 and burst["ttft_max_ms"] == pytest.approx(500.0)
    assert burst["prefill_computed_from_batched"] == burst["prefill_computed_from_hits"] == 200


def test_whole_run(monkeypatch, tmp_path, capsys, one_torch_thread):
    emitted, argvs = [], []
    monkeypatch.setattr(prefix, "SMALL", TINY)
    monkeypatch.setattr(prefix, "REHEARSAL", dict(requests=2, max_tokens=2))
    monkeypatch.setattr(prefix, "emit_result", emitted.append)

    def run_worker(argv, timeout=None):
        argvs.append(argv[2:])
        assert prefix.main(argv[2:]) == 0
        return emitted.pop()

    monkeypatch.setattr(prefix, "run_worker", run_worker)
    out = tmp_path / "p.json"
    assert prefix.main(["--small", "--scenarios", "warm", "--json", str(out)]) == 0
    assert [(a[a.index("--worker") + 1], a[a.index("--scenario") + 1]) for a in argvs] == [("reuse", "warm"),
                                                                                         ("no_reuse", "warm")]
    report = json.loads(out.read_text())
    reuse, no_reuse = report["runs"]["warm/reuse"], report["runs"]["warm/no_reuse"]
    assert "tokens" not in reuse and "tokens" not in no_reuse  # compared, then dropped from the report
    assert reuse["summary"]["vs_other_same_tokens"] == 4 and no_reuse["summary"]["vs_other_same_tokens"] == 4
    assert reuse["summary"]["hit_tokens"] == 3 * 48 and no_reuse["summary"]["hit_tokens"] == 0
    ratio = no_reuse["summary"]["prefill_computed_from_batched"] / reuse["summary"]["prefill_computed_from_batched"]
    assert reuse["ratios"]["prefill_tokens"] == pytest.approx(ratio) and ratio > 2
    printed = capsys.readouterr().out
    assert "no_reuse / reuse" in printed and ">= 10x" not in printed  # a smoke run gives no verdict


def test_a_failed_worker_fails_the_run(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(prefix, "run_worker", lambda argv, timeout=None: (_ for _ in ()).throw(OSError("gone")))
    out = tmp_path / "p.json"
    assert prefix.main(["--small", "--scenarios", "burst", "--modes", "reuse", "--json", str(out)]) == 1
    assert json.loads(out.read_text())["runs"] == {"burst/reuse": {"mode": "reuse", "scenario": "burst",
                                                                   "error": "gone"}}
    assert "burst/reuse: FAILED" in capsys.readouterr().out
