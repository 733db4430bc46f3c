"""Thin wrapper: the sliding-window memory benchmark lives in hf_paged/bench/window.py (also `hf-paged bench window`).

    python benchmarks/window.py --help
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's hf_paged, installed or not
from hf_paged.bench.window import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
