"""bench/memory.py: the bytes a token costs, its workloads, the analytical HF padded baseline (largest static batch
within the budget and its slot use), the measured DynamicCache against that formula, the paged worker's trace and
its summary, and a whole run (parent and workers in this process) on a workload far smaller than --small's."""
import json

import pytest

import hf_paged
from hf_paged.bench import memory
from hf_paged.tiny import tiny_model

TINY = dict(model=dict(vocab_size=300, hidden=32, layers=1, heads=2, kv_heads=1, max_len=512, intermediate_size=64),
            prompt_len=(4, 40), gen_len=(2, 6), max_new_tokens=6, requests=6, budget_mb=0.03, block_size=16)


def test_bytes_per_token():
    assert memory.bytes_per_token(memory.SMALL["model"]) == 2 * 2 * 2 * 32 * 4
    assert memory.bytes_per_token(TINY["model"], itemsize=2) == 2 * 1 * 1 * 16 * 2


@pytest.mark.parametrize("dist", memory.DISTS)
def test_workloads_are_seeded_per_distribution(dist):
    prompts, gens = memory.make_workload(TINY, 50, dist)
    assert (prompts, gens) == memory.make_workload(TINY, 50, dist)
    assert all(4 <= len(p) <= 40 for p in prompts) and all(2 <= g <= 6 for g in gens)
    assert all(3 <= t < 300 for p in prompts for t in p)
    other = "uniform" if dist == "loguniform" else "loguniform"
    assert memory.make_workload(TINY, 50, other)[0] != prompts


def test_loguniform_favours_short_prompts():
    lo = [len(p) for p in memory.make_workload(memory.SMALL, 400, "loguniform")[0]]
    uni = [len(p) for p in memory.make_workload(memory.SMALL, 400, "uniform")[0]]
    assert sorted(lo)[200] < sorted(uni)[200] / 2  # median of 8..256: ~45 vs ~132


def test_batches_partition_in_order():
    assert memory.batches(7, 3) == [range(0, 3), range(3, 6), range(6, 7)]
    assert memory.batches(2, 5) == [range(0, 2)]


def test_padded_reservation_pads_every_row_to_the_longest():
    assert memory.padded_reservation([4, 9, 2], range(0, 3), 5, 10) == 3 * (9 + 5) * 10
    assert memory.padded_reservation([4, 9, 2], range(2, 3), 5, 10) == (2 + 5) * 10


def test_hf_padded_analysis_by_hand():
    """lens 4, 8, 2; gens 2, 3, 1; max_new 4; 1 byte per token; budget 24: batches of 2 fit (2 x 12 = 24), of 3 do
    not (3 x 12 = 36). The worst batch [0, 2) at its end holds 2 x (8 + 3 - 1) = 20 slots, 16 of them real."""
    a = memory.hf_padded_analysis([4, 8, 2], [2, 3, 1], 4, 1, 24)
    assert a["concurrent_seqs"] == 2 and a["worst_batch"] == [0, 2] and a["reserved_bytes"] == 24
    assert (a["worst_batch_max_prompt"], a["worst_batch_max_gen"]) == (8, 3)
    assert a["predicted_cache_bytes"] == 20 and a["slot_utilisation_at_peak"] == pytest.approx(16 / 20)
    # after decode steps 1 and 2: batch [0, 2) holds real 5 + 9, 6 + 10 of 2 x 9, 2 x 10 slots; batch [2, 3) none
    assert a["slot_utilisation_mean"] == pytest.approx((14 + 16) / (18 + 20))
    assert a["next_size_reserved_bytes"] == 36
    assert memory.hf_padded_analysis([4, 8, 2], [2, 3, 1], 4, 1, 5) == {
        "concurrent_seqs": 0, "note": "not even one padded sequence fits the budget"}
    assert memory.hf_padded_analysis([4, 8], [2, 3], 4, 1, 1000)["next_size_reserved_bytes"] is None


@pytest.fixture
def unpatched():
    hf_paged.disable()  # as the hf_padded worker runs: on unpatched transformers
    try:
        yield
    finally:
        hf_paged.enable()


def test_hf_padded_worker_measures_what_the_formula_predicts(unpatched, one_torch_thread):
    model = tiny_model("llama", seed=0, sharpen=1.0, **TINY["model"])
    prompts, gens = memory.make_workload(TINY, 6, "uniform")
    lens = [len(p) for p in prompts]
    bpt = memory.bytes_per_token(TINY["model"])
    m = memory.hf_padded_worker(model, prompts, gens, [1, 4])
    width, g = max(lens[1:4]), max(gens[1:4])
    assert m["measured"] and m["batch"] == 3 and m["max_prompt"] == width and m["max_gen"] == g
    assert m["num_layers"] == 1 and m["kv_shape"] == [3, 1, width + g - 1, 16]
    assert m["cache_bytes"] == 3 * (width + g - 1) * bpt  # the analysis' predicted_cache_bytes formula


def test_paged_worker_finishes_everything_and_keeps_its_block_accounting(one_torch_thread):
    prompts, gens = memory.make_workload(TINY, 6, "loguniform")
    model = tiny_model("llama", seed=0, sharpen=1.0, **TINY["model"])
    budget = 20 * 16 * memory.bytes_per_token(TINY["model"])  # about 20 blocks
    r = memory.paged_worker(model, prompts, gens, budget, 16)
    assert r["finished"] == 6 and r["generated_tokens"] == r["expected_tokens"] == sum(gens)
    assert r["block_accounting_mismatches"] == 0 and r["kv_cache_bytes"] <= budget
    trace = r["trace"]
    assert len(trace["running"]) == r["steps"] and max(trace["used_blocks"]) <= r["num_blocks"] <= 20
    assert all(s == b * 16 for s, b in zip(trace["slots"], trace["used_blocks"]))
    assert all(c <= s for c, s in zip(trace["computed_tokens"], trace["slots"]))


def test_summarise_paged():
    r = {"num_blocks": 10, "trace": {"running": [1, 3, 3, 2], "waiting": [2, 1, 0, 0],
                                     "computed_tokens": [10, 40, 44, 20], "slots": [16, 48, 48, 32],
                                     "used_blocks": [1, 3, 3, 2]}}
    s = memory.summarise_paged(r)
    assert s["concurrent_seqs"] == 3 and s["peak_step"] == 1  # the first step at the peak
    assert s["slot_utilisation_at_peak"] == pytest.approx(40 / 48) and s["pool_use_at_peak"] == pytest.approx(0.3)
    assert s["saturated_steps"] == 2 and s["mean_concurrent_seqs_saturated"] == 2  # steps 0 and 1 had a queue
    assert s["slot_utilisation_mean"] == pytest.approx((10 / 16 + 40 / 48) / 2)
    assert s["slot_utilisation_min"] == pytest.approx(10 / 16) and s["pool_use_mean"] == pytest.approx(0.2)
    r["trace"]["waiting"] = [0, 0, 0, 0]
    unsaturated = memory.summarise_paged(r)
    assert unsaturated["saturated_steps"] == 0 and unsaturated["slot_utilisation_mean"] is None


def test_whole_run(monkeypatch, tmp_path, capsys, one_torch_thread):
    emitted, argvs = [], []
    monkeypatch.setattr(memory, "SMALL", TINY)
    monkeypatch.setattr(memory, "emit_result", emitted.append)

    def run_worker(argv, timeout=None):
        argvs.append(argv[2:])
        try:
            assert memory.main(argv[2:]) == 0
        finally:
            hf_paged.enable()  # the hf_padded worker disables hf_paged
        return emitted.pop()

    monkeypatch.setattr(memory, "run_worker", run_worker)
    out = tmp_path / "m.json"
    assert memory.main(["--small", "--dists", "uniform", "--json", str(out)]) == 0
    assert [a[a.index("--worker") + 1] for a in argvs] == ["hf_padded", "hf_paged"]
    report = json.loads(out.read_text())
    entry = report["runs"]["uniform"]
    hf, paged = entry["hf_padded"], entry["hf_paged"]
    assert hf["measured"]["measured"] and hf["measured_matches_formula"] is True
    assert paged["finished"] == 6 and paged["block_accounting_mismatches"] == 0
    assert entry["ratio_peak"] == paged["concurrent_seqs"] / hf["concurrent_seqs"]
    assert report["bytes_per_token"] == memory.bytes_per_token(TINY["model"]) and report["requests"] == 6
    printed = capsys.readouterr().out
    assert "uniform: hf_paged holds" in printed and "targets" not in printed.split("results written")[1]


def test_a_failed_paged_worker_fails_the_run(monkeypatch, tmp_path):
    monkeypatch.setattr(memory, "SMALL", TINY)

    def run_worker(argv, timeout=None):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(memory, "run_worker", run_worker)
    out = tmp_path / "m.json"
    assert memory.main(["--small", "--dists", "uniform", "--json", str(out)]) == 1
    entry = json.loads(out.read_text())["runs"]["uniform"]
    assert entry["hf_paged"] == {"error": "out of memory"} and "ratio_peak" not in entry
    assert entry["hf_padded"]["measured"] == {"measured": False, "reason": "out of memory"}
    assert entry["hf_padded"]["concurrent_seqs"] > 0  # the analytical number still stands
