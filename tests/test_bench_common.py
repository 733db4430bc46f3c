"""The benchmarks' shared helpers (hf_paged/bench/common.py): worker processes hand back their JSON through one
marked line, tables, percentiles, the default and plot paths, and the flags every benchmark shares."""
import argparse
import os
import sys
from pathlib import Path

import pytest

from hf_paged.bench import common

ROOT = Path(__file__).resolve().parent.parent


def test_a_worker_hands_back_the_last_marked_line_and_a_silent_one_is_an_error(tmp_path):
    code = ("from hf_paged.bench.common import emit_result, peak_rss_mb; print('noise'); emit_result({'n': 1}); "
            "emit_result({'n': 2, 'rss': peak_rss_mb()})")
    result = common.run_worker(["-c", code], timeout=120)
    assert result["n"] == 2 and result["rss"] > 0
    with pytest.raises(RuntimeError, match="exited 3 without a result:\nlast words"):
        common.run_worker(["-c", "import sys; print('last words'); sys.exit(3)"], timeout=60)


def test_workers_import_this_checkout_first():
    path = common.worker_env()["PYTHONPATH"].split(os.pathsep)
    assert path[0] == str(ROOT)


def test_percentile_interpolates_between_ranks():
    assert common.percentile([], 50) is None
    assert common.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert common.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)
    assert common.percentile([7.0], 99) == 7.0


def test_format_table_aligns_columns_and_rounds_floats():
    table = common.format_table(["system", "tok/s"], [["hf_paged", 12.345], ["hf", None]])
    assert table.splitlines() == ["system    tok/s", "--------  -----", "hf_paged  12.35", "hf            -"]


def test_default_and_plot_paths(tmp_path):
    assert common.default_json("swap") == "hf-paged-bench-swap.json"
    json_path = tmp_path / "r.json"
    assert common.plot_path(argparse.Namespace(plot=None), json_path) is None
    assert common.plot_path(argparse.Namespace(plot=""), json_path) == tmp_path / "r.png"
    assert common.plot_path(argparse.Namespace(plot="x.png"), json_path) == Path("x.png")
    written = common.write_json(tmp_path / "deep" / "out.json", {"a": 1})
    assert written.read_text() == '{\n  "a": 1\n}\n'


def test_the_shared_flags():
    parser = argparse.ArgumentParser()
    common.add_common_args(parser, "demo", workers=("one",), plot_help="the demo")
    args = parser.parse_args(["--small", "--plot", "--worker", "one"])
    assert (args.json, args.plot, args.small, args.worker, args.threads) == ("hf-paged-bench-demo.json", "", True,
                                                                           "one", None)
    bare = argparse.ArgumentParser()
    common.add_common_args(bare, "demo", workers=())
    assert "--plot" not in bare.format_help()
    with pytest.raises(SystemExit):
        bare.parse_args(["--worker", "two"])


def test_machine_info_names_the_python_and_cpus():
    info = common.machine_info()
    assert info["python"] == ".".join(map(str, sys.version_info[:3])) and info["cpu_count"] == os.cpu_count()
    if os.path.exists("/proc/cpuinfo"):  # the flags that decide which products are fast, as /proc/cpuinfo lists them
        text = open("/proc/cpuinfo").read()
        listed = set(next(line.split(":", 1)[1].split() for line in text.splitlines()
                          if line.split(":", 1)[0].strip() in ("flags", "Features")))
        assert info["cpu_flags"] == [flag for flag in common.SPEED_FLAGS if flag in listed]
        assert info["cpu_flags"] or not listed & set(common.SPEED_FLAGS)
