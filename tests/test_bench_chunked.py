"""bench/chunked.py: its prompts, the ITL statistics and the summary of a run (which gaps fall in the long prompt's
interference window), the option check, and a whole run (parent and both workers, in this process) on a model and
workload far smaller than --small's."""
import json

import pytest

from hf_paged.bench import chunked

TINY = dict(model=dict(vocab_size=300, hidden=32, layers=1, heads=2, kv_heads=1, max_len=512, intermediate_size=64),
            decoders=3, decoder_prompt=(4, 9), decode_tokens=8, long_prompt=100, long_tokens=3, budget=16,
            unchunked_budget=512)


def test_prompts_are_seeded_and_sized():
    short, long = chunked.make_prompts(TINY)
    assert (short, long) == chunked.make_prompts(TINY) and (short, long) != chunked.make_prompts(TINY, seed=1)
    assert len(short) == 3 and all(4 <= len(p) <= 9 for p in short) and len(long) == 100
    assert all(3 <= t < 300 for p in short + [long] for t in p)
    many, _ = chunked.make_prompts(dict(TINY, decoders=60))
    assert {len(p) for p in many} == set(range(4, 10))  # every length of the range, both ends included


def test_itl_stats():
    stats = chunked.itl_stats([0.01, 0.02, 0.03, 0.04, 1.0])
    assert stats["count"] == 5 and stats["median_ms"] == pytest.approx(30.0)
    assert stats["max_ms"] == pytest.approx(1000.0) and stats["mean_ms"] == pytest.approx(220.0)
    assert stats["p99_ms"] == pytest.approx(1e3 * (0.04 + 0.96 * 0.96))
    assert stats["p99_over_median"] == pytest.approx(stats["p99_ms"] / stats["median_ms"])
    assert chunked.itl_stats([]) == {"count": 0, "median_ms": None, "p99_ms": None, "max_ms": None,
                                     "mean_ms": None, "p99_over_median": None}


def run_record(times, arrival, long_first, steps=(), preemptions=0, hits=0):
    return {"times": times, "arrival": arrival, "long_first_token": long_first, "long_done": None,
            "steps": list(steps), "preemptions": preemptions, "prefix_cache_hit_tokens": hits}


def test_summarise_counts_the_gaps_that_end_inside_the_window():
    """The window is (arrival, long prompt's first token]: a gap belongs to it when its later token falls inside."""
    run = run_record([[1.0, 2.0, 3.0, 4.0], [1.5, 2.5, 3.5, 4.5]], arrival=2.2, long_first=3.5,
                     steps=[(2.0, 0.1, 4, 2), (3.0, 0.1, 4, 2), (3.5, 0.5, 100, 1), (4.5, 0.1, 2, 2)], preemptions=1)
    s = chunked.summarise([run])
    assert s["itl"]["count"] == 6
    assert s["itl_in_window"]["count"] == 3  # those ending at 3.0, 2.5 and 3.5 (not 2.0, 4.0, 4.5)
    assert s["long_ttft_s"] == [pytest.approx(1.3)] and s["total_s"] == [4.5] and s["steps_in_window"] == [2]
    assert s["runs_where_decoders_finished_before_long_first_token"] == 0 and s["preemptions"] == 1


def test_summarise_flags_runs_where_the_long_prompt_came_too_late():
    late = run_record([[1.0, 2.0]], arrival=1.5, long_first=3.0)
    never = run_record([[1.0, 2.0]], arrival=1.5, long_first=None, hits=16)
    s = chunked.summarise([late, never])
    assert s["runs_where_decoders_finished_before_long_first_token"] == 2
    assert s["long_ttft_s"] == [pytest.approx(1.5), None] and s["prefix_cache_hit_tokens"] == 16
    assert s["itl_in_window"]["count"] == 2  # with no first token the window never closes


def test_decoders_must_outlast_the_settle_steps(capsys):
    with pytest.raises(SystemExit) as stop:
        chunked.main(["--small", "--decode-tokens", "5", "--settle", "4"])
    assert stop.value.code == 2 and "--decode-tokens must exceed --settle + 1" in capsys.readouterr().err


@pytest.fixture
def in_process(monkeypatch):
    """Workers run in this process on TINY's sizes; returns the argv each worker got."""
    emitted, argvs = [], []
    monkeypatch.setattr(chunked, "SMALL", TINY)
    monkeypatch.setattr(chunked, "emit_result", emitted.append)

    def run_worker(argv, timeout=None):
        assert argv[:2] == ["-m", chunked.MODULE]
        argvs.append(argv[2:])
        assert chunked.main(argv[2:]) == 0
        return emitted.pop()

    monkeypatch.setattr(chunked, "run_worker", run_worker)
    return argvs


def test_whole_run(in_process, tmp_path, capsys, one_torch_thread):
    out = tmp_path / "c.json"
    assert chunked.main(["--small", "--settle", "2", "--json", str(out)]) == 0
    assert [a[a.index("--worker") + 1] for a in in_process] == ["chunked", "unchunked"]
    assert all(a[a.index("--budget") + 1] == "16" and "--small" in a for a in in_process)
    report = json.loads(out.read_text())
    assert report["decoders"] == 3 and report["long_prompt"] == 100 and report["settle"] == 2
    for mode, budget in (("chunked", 16), ("unchunked", 512)):
        entry = report["modes"][mode]
        assert entry["max_num_batched_tokens"] == budget and len(entry["runs"]) == 1
        run = entry["runs"][0]
        assert [len(t) for t in run["times"]] == [8, 8, 8]  # every decoder's every token has a time
        assert run["arrival"] is not None and run["long_first_token"] > run["arrival"]
        assert entry["preemptions"] == 0 and entry["prefix_cache_hit_tokens"] == 0
        assert entry["itl"]["count"] == 3 * 7
    # chunks of 16 tokens (the decoders' tokens included) take the long prompt over several steps; unchunked: one
    assert report["modes"]["chunked"]["steps_in_window"][0] >= 100 // 16
    assert report["modes"]["unchunked"]["steps_in_window"] == [1]
    printed = capsys.readouterr().out
    assert "chunked: p99/median =" in printed and "target" not in printed.split("results written")[1]


def test_a_failed_worker_is_reported_and_fails_the_run(monkeypatch, tmp_path, capsys):
    def run_worker(argv, timeout=None):
        raise RuntimeError("worker crashed")

    monkeypatch.setattr(chunked, "run_worker", run_worker)
    out = tmp_path / "c.json"
    assert chunked.main(["--small", "--modes", "unchunked", "--json", str(out)]) == 1
    report = json.loads(out.read_text())
    assert report["modes"] == {"unchunked": {"runs": [], "error": "worker crashed"}}
    assert "unchunked: FAILED" in capsys.readouterr().out
