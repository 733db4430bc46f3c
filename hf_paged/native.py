"""Native CPU code built on first use with the system C compiler, cached on disk and loaded with ctypes.

The C sources ship with the package (`attention/cpu/paged_decode.c`, `model/cpu/small_gemm.c`). Each is compiled
once per (source, compiler, flags) into `$HF_PAGED_CACHE_DIR` (default `~/.cache/hf_paged`); with
`-march=native` the build is for the machine it runs on. `-fopenmp` binds the library to the libgomp torch
already loaded (same soname), so torch and our kernels share one thread pool and `torch.set_num_threads` applies.
Without a compiler `build()` raises and callers fall back to plain torch.
"""
from __future__ import annotations

import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math", "-shared", "-fPIC")


def cache_dir() -> Path:
    return Path(os.environ.get("HF_PAGED_CACHE_DIR") or Path.home() / ".cache" / "hf_paged")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def is_complete(target: Path) -> bool:
    """A cached build is loaded only when its size and hash match what the builder wrote after a complete build:
    a truncated or damaged .so (an interrupted copy, a full disk) would crash the process when mapped."""
    stamp = target.with_suffix(".sha256")
    try:
        size, digest = stamp.read_text().split()
        return target.stat().st_size == int(size) and _digest(target) == digest
    except (OSError, ValueError):
        return False


def cpu_identity() -> str:
    """What `-march=native` compiles for: the CPU model and its instruction-set flags (Linux), else the platform's
    names. Part of the cache key, so a cache directory shared by different machines (a network home, a baked image)
    never hands one machine a build that uses instructions it lacks."""
    try:
        with open("/proc/cpuinfo") as info:
            fields = {}
            for line in info:
                name, _, value = line.partition(":")
                if name.strip() in ("model name", "flags", "Features", "CPU part") and name.strip() not in fields:
                    fields[name.strip()] = value.strip()
                if not line.strip() and fields:
                    break  # the first processor's entry is enough
            if fields:
                return repr(sorted(fields.items()))
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def build(source: Path, flags: tuple[str, ...] = FLAGS) -> Path:
    """The shared library of `source`, compiled now unless a complete build of the same source, compiler, flags and
    CPU is cached. Raises RuntimeError without a compiler, subprocess.CalledProcessError when compilation fails.
    `CC` may carry arguments (`CC="ccache gcc"`)."""
    compiler = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or ""]
    if not compiler[0]:
        raise RuntimeError("no C compiler (cc / gcc) on PATH")
    key = hashlib.sha256(source.read_bytes() + " ".join([*compiler, *flags, cpu_identity()]).encode()).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}_{key}.so"
    if not is_complete(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            subprocess.run([*compiler, *flags, str(source), "-o", str(built), "-lm"], check=True,
                           capture_output=True, timeout=120)
            stamp = Path(tmp) / "stamp"
            stamp.write_text(f"{built.stat().st_size} {_digest(built)}")
            os.replace(built, target)  # atomic: concurrent builders never see a partial file
            os.replace(stamp, target.with_suffix(".sha256"))  # written last: the build is complete
    return target


def load(source: Path, switch: str, wrap: Callable[[Path], T]) -> tuple[T | None, str]:
    """`wrap(the built library's path)` and "loaded", or None and why not: the environment variable `switch` set to
    0, no compiler, a failed build or load."""
    if os.environ.get(switch, "1") == "0":
        return None, f"disabled by {switch}=0"
    try:
        return wrap(build(source)), "loaded"
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", b"") or b""  # the compiler's own message
        return None, f"{type(error).__name__}: {error} {detail.decode(errors='replace')[:500]}".strip()
