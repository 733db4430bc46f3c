"""`hf-paged bench NAME --help` without importing hf_paged (loading torch and transformers takes seconds)."""
import importlib
import importlib.util
import sys
import types
from pathlib import Path


def bench_help(name: str, options: list) -> int:
    """Benchmark `name`'s --help: its module and bench/common.py import only the standard library at the top, so
    they load as a package of their own, without hf_paged's __init__."""
    package = types.ModuleType("hf_paged_cli_bench")
    package.__path__ = [str(Path(next(iter(importlib.util.find_spec("hf_paged").submodule_search_locations)))
                            / "bench")]
    sys.modules.setdefault(package.__name__, package)
    try:
        return int(importlib.import_module(f"{package.__name__}.{name}").main(list(options)) or 0)
    except SystemExit as e:  # argparse's exit after printing the help
        return int(e.code or 0)
