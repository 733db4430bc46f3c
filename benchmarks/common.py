"""Shared helpers for the benchmark scripts: worker subprocesses, peak RSS, matmul roofline, tables, JSON.

Import from a script in this folder with `sys.path.insert(0, str(Path(__file__).parent))`. Nothing here
imports torch at module level, so a parent process that only spawns workers stays small.
"""
from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

RESULT_PREFIX = "@@BENCH_RESULT "  # the line a worker prints to hand its JSON result back


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MB (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def emit_result(result: dict) -> None:
    """Worker side: print the result as one JSON line the parent picks out of stdout."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def run_worker(args: list[str], timeout: float | None = None) -> dict:
    """Run `python <args>` in a fresh process and return the JSON it emitted.

    The parent should not have imported torch or built tensors: on Linux a child's ru_maxrss can inherit
    the spawning process's high-water mark across fork/exec, so a light parent keeps per-worker peaks honest.
    """
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
    raise RuntimeError(f"worker {' '.join(args)} exited {proc.returncode} without a result:\n{tail}")


def set_threads(threads: int | None) -> int:
    """Apply --threads (None keeps torch's default); returns the thread count in effect."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def matmul_gflops(size: int = 1024, repeats: int = 10) -> float:
    """Best-of-`repeats` fp32 GFLOP/s of a size^3 torch.matmul (the CPU's practical dense-math ceiling)."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    out = torch.empty(size, size)
    for _ in range(2):
        torch.matmul(a, b, out=out)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(a, b, out=out)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def machine_info() -> dict:
    info = {"python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "processor": platform.processor() or platform.machine()}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu_model"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return info


def format_table(headers: list[str], rows: list[list]) -> str:
    """Plain-text table: first column left-aligned, the rest right-aligned; floats get 2 decimals."""
    def cell(value) -> str:
        if value is None:
            return "-"
        return f"{value:.2f}" if isinstance(value, float) else str(value)

    body = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    for r in body:
        lines.append("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))))
    return "\n".join(lines)


def write_json(path: str | Path, data: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None (with a message) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot: matplotlib is not installed (pip install matplotlib); no plot written")
        return None
    return plt


def save_figure(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def add_common_args(parser, name: str, workers, plot_help: str | None = None, timeout: float = 1800) -> None:
    """The flags every benchmark shares: --json, --plot (when it draws one), --threads, --small, --timeout and the
    hidden --worker that marks a subprocess."""
    import argparse

    parser.add_argument("--json", default=str(Path(__file__).resolve().parent / "results" / f"{name}.json"))
    if plot_help is not None:
        parser.add_argument("--plot", nargs="?", const="", default=None,
                            help=f"write a PNG of {plot_help} (default: next to the JSON)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: torch's)")
    parser.add_argument("--small", action="store_true", help="tiny model and sizes, for a quick smoke test")
    parser.add_argument("--timeout", type=float, default=timeout, help="seconds allowed per worker")
    parser.add_argument("--worker", choices=tuple(workers), help=argparse.SUPPRESS)
