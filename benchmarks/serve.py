"""Thin wrapper: the serving load test lives in hf_paged/bench/serve.py (also `hf-paged bench serve`).

    python benchmarks/serve.py --help
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's hf_paged, installed or not
from hf_paged.bench.serve import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
