"""Thin wrapper: the beam-search memory benchmark lives in hf_paged/bench/beam.py (also `hf-paged bench beam`).

    python benchmarks/beam.py --help
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's hf_paged, installed or not
from hf_paged.bench.beam import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
