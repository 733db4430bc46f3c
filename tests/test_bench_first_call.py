"""bench/first_call.py: a fresh process per measurement; the fresh paged system runs with the disk answers off."""
import json

from hf_paged.bench import common, first_call


def test_a_worker_times_two_calls_and_hands_back_the_tokens(capsys, one_torch_thread):
    args = first_call.parse_args(["--worker", "paged", "--small", "--new-tokens", "3", "--prompt-len", "5"])
    first_call.worker(args)
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(common.RESULT_PREFIX))
    result = json.loads(line[len(common.RESULT_PREFIX):])
    assert result["first_s"] > 0 and result["second_s"] > 0
    assert len(result["tokens"]) == 1 and len(result["tokens"][0]) == 3


def test_main_runs_each_system_in_its_own_process_with_its_switch(monkeypatch, tmp_path):
    seen = []

    def fake_worker(argv, timeout=None):
        import os

        system = argv[argv.index("--worker") + 1]
        seen.append((system, os.environ["HF_PAGED_CHECK_CACHE"]))
        first = {"hf": 1.0, "paged_fresh": 3.0, "paged": 0.5}[system]
        return {"first_s": first, "second_s": first / 2, "tokens": [[1, 2]] if system != "paged" else [[1, 3]]}
    monkeypatch.setattr(first_call, "run_worker", fake_worker)
    monkeypatch.setenv("HF_PAGED_CHECK_CACHE", "untouched")
    assert first_call.main(["--rounds", "2", "--json", str(tmp_path / "r.json")]) == 1  # tokens differ: exit 1
    assert seen[0] == ("paged", "1")  # the untimed process that keeps the answers
    assert seen[1:] == [("hf", "1"), ("paged_fresh", "0"), ("paged", "1")] * 2
    results = {r["system"]: r for r in json.loads((tmp_path / "r.json").read_text())["results"]}
    assert results["paged_fresh"]["first_vs_hf"] == 3.0 and results["paged"]["second_vs_hf"] == 0.5
    assert results["hf"]["same_tokens"] and not results["paged"]["same_tokens"]
    import os

    assert os.environ["HF_PAGED_CHECK_CACHE"] == "untouched"  # put back
