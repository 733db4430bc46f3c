"""Thin wrapper: the memory benchmark lives in hf_paged/bench/memory.py (also `hf-paged bench memory`).

    python benchmarks/memory.py --help
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's hf_paged, installed or not
from hf_paged.bench.memory import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
