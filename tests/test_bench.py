"""`hf-paged bench NAME`: runs from the package (any folder), passes every option through, writes its JSON where
--json says (default: the current folder, never the package or a tracked file), and --plot draws PNGs."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hf_paged import bench
from hf_paged.bench import common

ROOT = Path(__file__).resolve().parent.parent


def test_every_name_has_a_main_and_defaults_to_the_current_folder():
    for name in bench.NAMES:
        assert callable(bench.load(name).main)
    assert Path(common.default_json("throughput")).parent == Path(".")
    with pytest.raises(ValueError, match="unknown benchmark"):
        bench.load("nope")


def test_options_pass_through(capsys):
    with pytest.raises(SystemExit) as stop:
        bench.run("chunked", ["--help"])
    assert stop.value.code == 0
    assert "--budget" in capsys.readouterr().out


def test_throughput_smoke_from_another_folder(tmp_path):
    """--small runs in the CLI's own process; no --json: the file lands in the current folder."""
    proc = subprocess.run([sys.executable, "-m", "hf_paged.cli", "bench", "throughput", "--small", "--systems",
                           "hf_paged", "--requests", "2", "--max-tokens", "2", "--threads", "1"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / common.default_json("throughput")).read_text())
    assert report["small"] and report["requests"] == [2] and report["max_tokens"] == 2
    assert [r["output_tokens"] for r in report["results"]] == [4]
    assert "target" not in proc.stdout


def test_throughput_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from hf_paged.bench.throughput import plot

    report = {"systems": ["hf_paged", "hf_padded"], "requests": [4, 8], "max_tokens": 8, "threads": 1,
              "model": {"hidden": 128, "layers": 2},
              "results": [{"system": s, "requests": n, "tok_per_s": 10.0 * n} for s in ("hf_paged", "hf_padded")
                          for n in (4, 8)]}
    plot(tmp_path / "t.png", report)
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_throughput_rounds_keep_the_fastest_and_pair_rounds():
    """--repeats: each system reports its fastest round; speed-ups are paired round by round; a failed round is not
    hidden behind a fast one, rounds that disagree on tokens are counted row by row."""
    from hf_paged.bench.throughput import _best_of
    from hf_paged.bench.throughput_report import _paired_ratios

    def run(system, seconds, tokens=((1, 2),)):
        return {"system": system, "requests": 1, "seconds": seconds, "peak_rss_mb": seconds * 100,
                "tokens": [list(t) for t in tokens]}

    paged = _best_of("hf_paged", 1, [run("hf_paged", 3.0), run("hf_paged", 2.0), run("hf_paged", 4.0)])
    padded = _best_of("hf_padded", 1, [run("hf_padded", 6.0), run("hf_padded", 5.0), run("hf_padded", 4.0)])
    assert paged["seconds"] == 2.0 and paged["round_seconds"] == [3.0, 2.0, 4.0] and paged["peak_rss_mb"] == 400
    assert _paired_ratios([paged, padded], 1, "hf_paged", "hf_padded") == [2.0, 2.5, 1.0]
    assert _paired_ratios([paged], 1, "hf_paged", "hf_padded") is None
    failed = {"system": "hf_paged", "requests": 1, "error": "boom"}
    assert _best_of("hf_paged", 1, [run("hf_paged", 1.0), failed]) is failed
    assert "round_rows_differ" not in paged
    differing = _best_of("hf_paged", 1, [run("hf_paged", 1.0, tokens=((1, 2), (5, 6))),
                                         run("hf_paged", 2.0, tokens=((1, 3), (5, 6)))])
    assert differing["round_rows_differ"] == [0, 1] and differing["tokens"] == [[1, 2], [5, 6]]



def test_throughput_hybrid_smoke(tmp_path, monkeypatch):
    """--arch qwen3_5_text: a Qwen3.5-shaped hybrid (3 Gated DeltaNet : 1 full attention); hf_paged and HF padded
    generate give the same tokens; the report names the arch, the CPU model, the thread count and the load. The
    workers run in this process (each subprocess would spend its time importing torch and transformers)."""
    import torch

    import hf_paged
    from hf_paged.bench import throughput, throughput_models

    emitted, argvs = [], []
    monkeypatch.setattr(throughput, "emit_result", emitted.append)

    def in_process(argv, timeout=None):
        assert argv[:2] == ["-m", throughput.MODULE]
        argvs.append(argv[2:])
        try:
            assert throughput.main(argv[2:]) == 0
        finally:
            hf_paged.enable()  # the hf_padded worker disables hf_paged
        return emitted.pop()

    monkeypatch.setattr(throughput, "run_worker", in_process)
    # the full run's path (a worker per system and round) on the --small sizes (--small itself runs in-process)
    hybrids = throughput_models.HYBRID_SETUPS
    monkeypatch.setitem(hybrids, "qwen3_5_text", (hybrids["qwen3_5_text"][1],) * 2)
    threads = torch.get_num_threads()
    try:
        assert throughput.main(["--arch", "qwen3_5_text", "--requests", "3", "--max-tokens", "3",
                                "--threads", "1", "--repeats", "2", "--json", str(tmp_path / "t.json")]) == 0
    finally:
        torch.set_num_threads(threads)
    assert all(argv[argv.index("--arch") + 1] == "qwen3_5_text" for argv in argvs)
    assert [argv[argv.index("--worker") + 1] for argv in argvs] == ["matmul"] + ["hf_paged", "hf_padded"] * 2
    report = json.loads((tmp_path / "t.json").read_text())
    assert report["arch"] == "qwen3_5_text" and report["systems"] == ["hf_paged", "hf_padded"]
    assert report["model"]["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert report["threads"] == 1 and "cpu_model" in report["machine"] and "before" in report["load_average"]
    paged, padded = report["results"]
    assert paged["output_tokens"] == padded["output_tokens"] == 9
    assert paged["same_as_hf_padded"] == 3 and paged["vs_hf_padded"] > 0 and paged["vs_hf_padded_cpu"] > 0
    assert len(paged["vs_hf_padded_cpu_per_round"]) == 2 and all(s > 0 for s in paged["round_cpu_seconds"])


def test_throughput_cpu_seconds_pair_rounds():
    """Speed-ups in worker CPU seconds are paired round by round, for hf_paged over hf_padded only."""
    from hf_paged.bench.throughput_report import _paired_cpu_ratios

    paged = {"system": "hf_paged", "requests": 1, "round_cpu_seconds": [2.0, 4.0]}
    padded = {"system": "hf_padded", "requests": 1, "round_cpu_seconds": [4.0, 4.0]}
    assert _paired_cpu_ratios([paged, padded], paged) == [2.0, 1.0]
    assert _paired_cpu_ratios([paged], paged) is None and _paired_cpu_ratios([paged, padded], padded) is None
