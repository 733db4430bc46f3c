"""Thin wrapper: the benchmarks' shared helpers live in hf_paged/bench/common.py (kept importable as `common` for the
scripts in this folder that do `sys.path.insert(0, <this folder>); from common import ...`)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's hf_paged, installed or not
from hf_paged.bench.common import (RESULT_PREFIX, add_common_args, default_json, emit_result,  # noqa: E402,F401
                                   format_table, machine_info, matmul_gflops, peak_rss_mb, percentile, plot_path,
                                   pyplot, run_worker, save_figure, set_threads, write_json)
