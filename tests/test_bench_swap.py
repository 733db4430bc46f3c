"""bench/swap.py: its prompts and peak need, where two runs' tokens first differ, the swap / recompute break-even, the
option check, and a whole run (parent and the four workers in this process) on a workload far smaller than --small's:
a pool of half the peak need preempts, and every mode gives the reference's tokens."""
import json

import pytest

from hf_paged.bench import swap

TINY = dict(model=dict(vocab_size=300, hidden=32, layers=1, heads=2, kv_heads=1, max_len=512, intermediate_size=64),
            requests=6, prompt_len=(10, 30), max_tokens=12)


def test_prompts_and_peak_need():
    prompts = swap.make_prompts(TINY, 6)
    assert prompts == swap.make_prompts(TINY, 6) and prompts != swap.make_prompts(TINY, 6, seed=1)
    assert all(10 <= len(p) <= 30 and all(3 <= t < 300 for t in p) for p in prompts)
    assert swap.peak_blocks([[1] * 4, [1] * 20], 12) == 1 + 2  # 16 tokens: one block; 32: two
    assert swap.peak_blocks([[1] * 5], 12) == 2


@pytest.mark.parametrize("a, b, expected", [
    ([[1, 2], [3, 4]], [[1, 2], [3, 4]], None),
    ([[1, 2], [3, 4], [5]], [[1, 2], [3, 9], [6]], (2, 1, 1)),
    ([[1, 2, 3]], [[1, 2]], (1, 0, 2)),  # one is a prefix of the other: they part where the shorter ends
])
def test_first_difference(a, b, expected):
    assert swap.first_difference(a, b) == expected


def test_breakeven():
    b = swap.breakeven(bandwidth=1e9, bpt=1000.0, prefill=1000.0)
    assert b["swap_s_per_token"] == pytest.approx(2e-6)  # out and back in
    assert b["recompute_s_per_token"] == pytest.approx(1e-3)
    assert b["swap_cheaper_x"] == pytest.approx(500.0)


@pytest.mark.parametrize("fraction", ["0", "1.5", "-0.2"])
def test_pool_fraction_must_be_a_share(fraction, capsys):
    with pytest.raises(SystemExit) as stop:
        swap.main(["--small", "--pool-fraction", fraction])
    assert stop.value.code == 2 and "--pool-fraction must be in (0, 1]" in capsys.readouterr().err


def test_whole_run(monkeypatch, tmp_path, capsys, one_torch_thread):
    emitted, argvs = [], []
    monkeypatch.setattr(swap, "SMALL", TINY)
    monkeypatch.setattr(swap, "emit_result", emitted.append)
    monkeypatch.setattr(swap, "BUDGET", 256)

    def run_worker(argv, timeout=None):
        argvs.append(argv[2:])
        assert swap.main(argv[2:]) == 0
        return emitted.pop()

    monkeypatch.setattr(swap, "run_worker", run_worker)
    out = tmp_path / "s.json"
    assert swap.main(["--small", "--json", str(out)]) == 0
    assert [a[a.index("--worker") + 1] for a in argvs] == list(swap.MODES)
    report = json.loads(out.read_text())
    need = swap.peak_blocks(swap.make_prompts(TINY, 6), 12)
    assert report["peak_need_blocks"] == need and report["pool_fraction"] == 0.5
    modes = report["modes"]
    assert modes["reference"]["num_blocks"] == need and modes["reference"]["stats"]["num_preemptions"] == 0
    for mode in ("recompute", "swap", "auto"):
        r = modes[mode]
        assert r["num_blocks"] == need // 2 and r["stats"]["num_preemptions"] > 0, mode
        assert r["same_as_reference"] == 6 and "first_difference" not in r
        assert r["output_tokens"] == 6 * 12 and r["tok_per_s"] == pytest.approx(r["output_tokens"] / r["seconds"])
        assert r["work_over_ideal"] == pytest.approx(r["stats"]["num_batched_tokens"] / report["ideal_batched_tokens"])
        assert "tokens" not in r
    assert modes["swap"]["stats"]["num_swap_outs"] > 0 and modes["recompute"]["stats"]["num_swap_outs"] == 0
    assert modes["recompute"]["swap_space"] == 0 and modes["swap"]["swap_space"] == 2 * (need // 2) * \
        modes["swap"]["bytes_per_block"]
    assert report["ideal_batched_tokens"] == report["prompt_tokens"] + 6 * 11
    assert "swap vs recompute per token" in capsys.readouterr().out


def test_a_failed_mode_is_reported_and_the_others_compare_to_the_first_that_ran(monkeypatch, tmp_path, capsys):
    def result(tokens):
        return {"num_blocks": 4, "seconds": 2.0, "warmup_seconds": 0.1, "tokens": tokens, "bytes_per_token": 64.0,
                "stats": dict.fromkeys(("num_batched_tokens", "num_steps", "num_preemptions", "num_swap_outs",
                                        "num_swap_ins", "num_blocks_swapped", "num_recomputed_tokens",
                                        "prefix_cache_hit_tokens"), 1),
                "costs_at_startup": {"measured_at_startup": False, "copy_bytes_per_s": None},
                "costs_after_run": {"prefill_tokens_per_s": 1000.0}, "observed_prefill_tokens_per_s": None,
                "copy_bandwidth_remeasured": {"8": {"median": 1e9, "samples": [1e9]}}}

    answers = {"reference": None, "recompute": [[5] * 8] * 24, "swap": [[5] * 8] * 23 + [[5, 6] + [5] * 6]}

    def run_worker(argv, timeout=None):
        mode = argv[argv.index("--worker") + 1]
        if answers[mode] is None:
            raise RuntimeError("no memory")
        return result(answers[mode])

    monkeypatch.setattr(swap, "run_worker", run_worker)
    out = tmp_path / "s.json"
    assert swap.main(["--small", "--modes", "reference", "recompute", "swap", "--json", str(out)]) == 1
    modes = json.loads(out.read_text())["modes"]
    assert modes["reference"] == {"error": "no memory"}
    assert modes["recompute"]["same_as_recompute"] == 24
    assert modes["swap"]["same_as_recompute"] == 23
    assert modes["swap"]["first_difference"] == {"requests_differing": 1, "request": 23, "position": 1}
    assert modes["swap"]["breakeven"]["re-measured, 8 blocks"]["swap_cheaper_x"] == pytest.approx(1e9 / 128 / 1000)
    printed = capsys.readouterr().out
    assert "reference: FAILED" in printed and "NOTE swap: 1/24 requests differ from recompute" in printed
    assert "WARNING recompute: 192 output tokens, expected 1536" in printed
