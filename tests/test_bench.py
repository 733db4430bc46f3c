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
        try:
            module = bench.load(name)
        except LookupError:
            assert name == "beam"  # written separately: hf_paged/bench/beam.py or benchmarks/beam.py
            continue
        assert callable(module.main)
    assert Path(common.default_json("throughput")).parent == Path(".")
    with pytest.raises(ValueError, match="unknown benchmark"):
        bench.load("nope")


def test_options_pass_through(capsys):
    with pytest.raises(SystemExit) as stop:
        bench.run("chunked", ["--help"])
    assert stop.value.code == 0
    assert "--budget" in capsys.readouterr().out


def test_throughput_smoke_from_another_folder(tmp_path):
    """Workers run as `python -m hf_paged.bench.throughput`; no --json: the file lands in the current folder."""
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
    """--repeats: each system reports its fastest round; speed-ups are paired round by round; a failed round or
    rounds that disagree on tokens are not hidden behind a fast one."""
    from hf_paged.bench.throughput import _best_of, _paired_ratios

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
    with pytest.raises(RuntimeError, match="different tokens"):
        _best_of("hf_paged", 1, [run("hf_paged", 1.0), run("hf_paged", 2.0, tokens=((1, 3),))])
