"""Shared helpers of the benchmarks: worker subprocesses, peak RSS, matmul roofline, tables, JSON, plots.

Nothing here imports torch at module level. Each measurement runs in a fresh worker process
(`python -m hf_paged.bench.<name> --worker ...`), so systems never share allocator state or warm caches.
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
    """Peak resident set size of this process in MB.

    Linux: VmHWM of /proc/self/status, which starts afresh at exec (ru_maxrss can inherit the high-water mark of
    the process that spawned this one). Elsewhere ru_maxrss (KiB on Linux, bytes on macOS)."""
    try:
        with open("/proc/self/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        return kib / 1024
    except (OSError, StopIteration, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def emit_result(result: dict) -> None:
    """Worker side: print the result as one JSON line the parent picks out of stdout."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def worker_env() -> dict:
    """The environment of a worker process: this one's, with the folder holding this hf_paged first on PYTHONPATH."""
    root = str(Path(__file__).resolve().parents[2])
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))


def run_worker(args: list[str], timeout: float | None = None) -> dict:
    """Run `python <args>` (e.g. `["-m", "hf_paged.bench.swap", "--worker", ...]`) in a fresh process and return
    the JSON it emitted. The folder holding this hf_paged goes first on the child's PYTHONPATH, so a source
    checkout that is not installed works too."""
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=worker_env())
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


def matmul_gflops(size: int = 1024, repeats: int = 10, dtype: str = "float32") -> float:
    """The CPU's practical dense-math ceiling: the best of `matmul_rates` (GFLOP/s)."""
    return max(matmul_rates(size, repeats, dtype).values())


def matmul_rates(size: int = 1024, repeats: int = 10, dtype: str = "float32") -> dict[str, float]:
    """Best-of-`repeats` GFLOP/s of a size^3 product in `dtype` by each library torch offers on this CPU:
    torch.matmul (MKL's GEMM for fp32 in torch's x86 builds) and, where torch has it, oneDNN's (what hf_paged's
    measured linears may choose: on an AMD EPYC it ran fp32 at twice MKL's rate)."""
    import torch

    kind = getattr(torch, dtype)
    a, b = torch.randn(size, size, dtype=kind), torch.randn(size, size, dtype=kind)
    out = torch.empty(size, size, dtype=kind)
    products = {"torch.matmul": lambda: torch.matmul(a, b, out=out)}
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        products["oneDNN"] = lambda: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")
    rates = {}
    for name, run in products.items():
        for _ in range(2):
            run()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - start)
        rates[name] = 2 * size**3 / best / 1e9
    return rates


# instruction-set flags that decide which products are fast (/proc/cpuinfo's names): reported with every figure
SPEED_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
               "amx_int8", "amx_fp16", "asimd", "sve", "sve2", "bf16", "i8mm")


def machine_info() -> dict:
    """Python, OS, CPU count, the CPU model (/proc/cpuinfo's "model name", else lscpu's "Model name") and its
    `SPEED_FLAGS` (where /proc/cpuinfo lists flags: "flags" on x86, "Features" on ARM)."""
    info = {"python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "processor": platform.processor() or platform.machine()}
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        listed = next((line.split(":", 1)[1].split() for line in lines
                       if line.split(":", 1)[0].strip() in ("flags", "Features")), [])
        info["cpu_flags"] = [flag for flag in SPEED_FLAGS if flag in listed]
        info["cpu_model"] = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        try:
            out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
            info["cpu_model"] = next(line.split(":", 1)[1].strip() for line in out.splitlines()
                                     if line.startswith("Model name"))
        except (OSError, subprocess.SubprocessError, StopIteration):
            pass
    return info


def machine_load() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the OS has none): other work on the machine skews timings."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (OSError, AttributeError):
        return None


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


def default_json(name: str) -> str:
    """The results file a benchmark writes when --json is not given: in the current folder, never in the package."""
    return f"hf-paged-bench-{name}.json"


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def plot_path(args, json_path: Path) -> Path | None:
    """Where --plot asked for a PNG (None: no plot): the given path, or the JSON's path ending .png."""
    if args.plot is None:
        return None
    return Path(args.plot) if args.plot else json_path.with_suffix(".png")


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

    parser.add_argument("--json", default=default_json(name),
                        help="where to write the results (default: %(default)s in the current folder)")
    if plot_help is not None:
        parser.add_argument("--plot", nargs="?", const="", default=None, metavar="PNG",
                            help=f"write a PNG of {plot_help} (needs matplotlib: pip install 'hf-paged[plot]'; "
                                 f"default path: the JSON's, ending .png)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: torch's)")
    parser.add_argument("--small", action="store_true", help="tiny model and sizes, for a quick smoke test")
    parser.add_argument("--timeout", type=float, default=timeout, help="seconds allowed per worker")
    parser.add_argument("--worker", choices=tuple(workers), help=argparse.SUPPRESS)
