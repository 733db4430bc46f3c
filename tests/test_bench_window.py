"""bench/window.py: its options and --small sizes, the two workers (the engine giving back the blocks behind the
window vs keeping them) on the --small workload, what the parent hands its workers (never --plot), and its exit code
(1 when the two systems' tokens differ)."""
import json

import pytest

from hf_paged.bench import window


def test_options_and_small_sizes(monkeypatch):
    args = window.parse_args([])
    assert (args.arch, args.window, args.requests, args.max_tokens, args.num_blocks) == ("mistral", 128, 32, None, None)
    with pytest.raises(SystemExit) as stop:
        window.parse_args(["--arch", "llama"])
    assert stop.value.code == 2
    seen = []
    monkeypatch.setattr(window, "worker", lambda args: seen.append(args) or {})
    monkeypatch.setattr(window, "emit_result", lambda result: None)
    for argv, expected in ((["--worker", "keep"], (128, 32, 512, 160)),
                           (["--worker", "keep", "--arch", "gemma3"], (128, 32, 1024, 640)),
                           (["--worker", "keep", "--small", "--requests", "3"], (16, 8, 64, 24)),  # --small wins
                           (["--worker", "keep", "--max-tokens", "9", "--num-blocks", "7"], (128, 32, 9, 7))):
        assert window.main(argv) == 0
        a = seen[-1]
        assert (a.window, a.requests, a.max_tokens, a.num_blocks) == expected, argv


def test_workload_is_seeded():
    args = window.parse_args(["--requests", "5"])
    prompts = window.workload(args)
    assert prompts == window.workload(args) and len(prompts) == 5
    assert all(32 <= len(p) <= 64 and all(3 <= t < 1000 for t in p) for p in prompts)


def test_models():
    small = window.build_model(window.parse_args(["--small", "--window", "16"]))
    assert small.config.sliding_window == 16 and small.config.num_hidden_layers == 2
    assert small.config.hidden_size == 64


@pytest.fixture(scope="module")
def runs():
    """Both workers on the --small workload (8 requests x 64 tokens, window 16, 24 blocks)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        for system in window.SYSTEMS:
            args = window.parse_args(["--small", "--worker", system])
            args.window, args.requests, args.max_tokens, args.num_blocks = 16, 8, 64, 24
            out[system] = window.worker(args)
        return out
    finally:
        torch.set_num_threads(threads)


def test_release_gives_back_the_blocks_behind_the_window(runs):
    release, keep = runs["release"], runs["keep"]
    assert release["tokens"] == keep["tokens"] and all(len(t) == 64 for t in release["tokens"])
    assert release["window"] == 16 and keep["window"] is None
    assert release["num_blocks_released"] > 0 and keep["num_blocks_released"] == 0
    # a request of up to 64 + 64 tokens: all 8 of its blocks kept, vs at most its prompt's 4 (once computed, only
    # the blocks that reach into the window stay)
    assert keep["peak_blocks_per_request"] == 8 and release["peak_blocks_per_request"] <= 4
    assert release["peak_running"] == 8 > keep["peak_running"]  # kept blocks leave room for fewer requests
    assert keep["num_preemptions"] > 0 and release["num_preemptions"] == 0
    assert release["pool_blocks"] == keep["pool_blocks"] == 24 and release["kv_groups"] == 1


def test_worker_series(runs):
    r = runs["release"]
    assert r["steps"] == len(r["series"]) and r["output_tokens"] == 8 * 64
    assert [s[1] for s in r["series"]] and max(s[1] for s in r["series"]) == r["peak_running"]
    assert max(s[2] for s in r["series"]) == r["peak_blocks_in_use"] <= 24
    assert all(a[0] <= b[0] for a, b in zip(r["series"], r["series"][1:]))


@pytest.mark.parametrize("argv, passed", [
    (["--small", "--plot"], ["--small"]),
    (["--plot", "x.png", "--small"], ["--small"]),
    (["--plot", "--small"], ["--small"]),
    (["--small"], ["--small"]),
])
def test_workers_get_the_options_but_not_plot(monkeypatch, tmp_path, argv, passed, runs):
    handed = []

    def run_worker(worker_argv, timeout=None):
        handed.append(worker_argv)
        system = worker_argv[-1]
        return dict(runs[system])

    monkeypatch.setattr(window, "run_worker", run_worker)
    monkeypatch.setattr(window, "plot", lambda path, results, args: None)
    out = str(tmp_path / "w.json")
    assert window.main([*argv, "--json", out]) == 0
    assert handed == [["-m", "hf_paged.bench.window", *passed, "--json", out, "--worker", system]
                      for system in window.SYSTEMS]
    report = json.loads((tmp_path / "w.json").read_text())
    assert report["identical"] is True and all("tokens" not in r for r in report["results"])


def test_different_tokens_fail_the_run(monkeypatch, tmp_path, runs, capsys):
    def run_worker(worker_argv, timeout=None):
        r = dict(runs[worker_argv[-1]])
        if worker_argv[-1] == "keep":
            r["tokens"] = [t[:-1] + [0] for t in r["tokens"]]
        return r

    monkeypatch.setattr(window, "run_worker", run_worker)
    assert window.main(["--small", "--json", str(tmp_path / "w.json")]) == 1
    assert "identical outputs: False" in capsys.readouterr().out


def test_plot(tmp_path, runs):
    pytest.importorskip("matplotlib")
    args = window.parse_args(["--small"])
    window.plot(tmp_path / "w.png", [dict(r) for r in runs.values()], args)
    assert (tmp_path / "w.png").read_bytes()[:4] == b"\x89PNG"
