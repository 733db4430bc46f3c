"""The benchmarks and the checks that run beside them, all runnable from an installed package.

`hf-paged bench NAME [options]` runs the benchmarks of `NAMES`: each is a module of this package with
`main(argv: list[str] | None = None) -> int` (argv: its options, without the name) that runs its measurements in worker
processes (`python -m hf_paged.bench.NAME --worker ...`; shared helpers in common.py). Results go to `--json`
(default: a file in the current folder). The others run as `python -m hf_paged.bench.NAME`: pipeline and
hybrid_prefix (benchmarks), soak (the soak test, with soak_*.py), models_census (every transformers architecture,
with census_layers.py) and gpu_check (the GPU session's measurements, with gpu_engine.py and gpu_parity.py; the
source repository's benchmarks/gpu_check.sh runs each of its steps under a time limit). Recorded results live in
benchmarks/results/ of the source repository.
"""
from __future__ import annotations

import importlib

NAMES = ("throughput", "prefix", "chunked", "memory", "swap", "beam", "window", "serve", "calls", "first_call", "archs")


def load(name: str):
    """The module of benchmark `name`: `hf_paged.bench.NAME`."""
    if name not in NAMES:
        raise ValueError(f"unknown benchmark {name!r}; choose from {', '.join(NAMES)}")
    return importlib.import_module(f"{__name__}.{name}")


def run(name: str, argv: list[str]) -> int:
    """Run benchmark `name` with its own options `argv`; returns its exit status."""
    return int(load(name).main(list(argv)) or 0)
