"""Thin wrapper: the throughput benchmark lives in hf_paged/bench/throughput.py (also `hf-paged bench throughput`).

    python benchmarks/throughput.py --help
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's hf_paged, installed or not
from hf_paged.bench.throughput import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
