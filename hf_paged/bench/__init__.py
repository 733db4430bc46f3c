"""The benchmarks, runnable from an installed package: `hf-paged bench NAME [options]`.

Each benchmark is a module of this package with `main(argv: list[str] | None = None) -> int` (argv: its options,
without the name) and runs its measurements in worker processes (`python -m hf_paged.bench.NAME --worker ...`).
Results go to `--json` (default: a file in the current folder). `benchmarks/NAME.py` in a source checkout are thin
wrappers around these modules.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path

NAMES = ("throughput", "prefix", "chunked", "memory", "swap", "beam", "window", "serve")


def load(name: str):
    """The module of benchmark `name`: `hf_paged.bench.NAME`, or else (a source checkout) `benchmarks/NAME.py`."""
    if name not in NAMES:
        raise ValueError(f"unknown benchmark {name!r}; choose from {', '.join(NAMES)}")
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    script = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
    if not script.is_file():
        raise LookupError(f"benchmark {name!r} is not part of this installation")
    spec = importlib.util.spec_from_file_location(f"hf_paged_benchmark_{name}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(name: str, argv: list[str]) -> int:
    """Run benchmark `name` with its own options `argv`; returns its exit status."""
    main = load(name).main
    if inspect.signature(main).parameters:
        return int(main(list(argv)) or 0)
    saved = sys.argv  # a main() that reads sys.argv itself
    sys.argv = [f"hf-paged bench {name}", *argv]
    try:
        return int(main() or 0)
    finally:
        sys.argv = saved
