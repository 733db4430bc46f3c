"""The CUDA C++ extension: the kernels in csrc/, built, loaded and called (the `cuda` backend,
attention/backends/cuda.py, holds its support rules and calls `paged_attention`).

The extension is built on first use with `torch.utils.cpp_extension.load` (nvcc + ninja; without ninja, or when
cpp_extension refuses the toolkit, nvcc and c++ are called directly) into `$HF_PAGED_CACHE_DIR/cuda/<hash of the
sources>` (default ~/.cache/hf_paged/cuda), so later processes only load the built library. Those folders are
created 0700 and checked like the CPU kernels' (hf_paged/native.py: refused, with a warning, where another user
could change them); the direct build's library is loaded only with its size + hash stamp, and one missing the ops
is not used. The sources are read from `HF_PAGED_CSRC`, else the copy a wheel carries (`hf_paged/_csrc`), else
the repository's csrc/ folder. The decode kernel serves decode-only steps (`metadata.max_query_len == 1`).

Building ahead of time: `HF_PAGED_BUILD_CUDA=1 pip install --no-build-isolation .` compiles the extension into
the installed package (`hf_paged/_prebuilt`, see setup.py); at run time `HF_PAGED_BUILD_CUDA=1` builds (or loads)
it when this module is imported instead of on the first attention call, and
`python -m hf_paged.attention.cuda_backend` does the same and prints the status.

Besides `paged_attention` (the decode kernel): `copy_blocks` (copy-on-write block copies on the device, and host <->
device swaps from pinned host memory in one launch; the GPU check (bench/gpu_check.py swap) measures it against
kv/swap.py's copies) and `decode_plan` (the partition plan the decode kernel would use).
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
from pathlib import Path

import torch

from .. import native
from .metadata import AttentionMetadata

PACKAGE = Path(__file__).resolve().parents[1]
# the sources: HF_PAGED_CSRC, else the copy an installed wheel carries, else the repository's csrc/
CSRC = Path(os.environ.get("HF_PAGED_CSRC") or next(
    (p for p in (PACKAGE / "_csrc", PACKAGE.parent / "csrc") if (p / "paged_attention.cu").is_file()),
    PACKAGE.parent / "csrc"))
PREBUILT = PACKAGE / "_prebuilt"  # filled at install time by HF_PAGED_BUILD_CUDA=1 (see setup.py)
SOURCES = ("bindings.cpp", "paged_attention.cu")
HEADERS = ("paged_attention.h",)
HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CUDA_FLAGS = ["-O3", "-lineinfo"]
OPS = ("paged_decode", "copy_blocks", "plan_decode")  # what csrc/bindings.cpp registers in torch.ops.hf_paged
_status: dict[str, str] = {}


def cache_dir() -> Path:
    """Where builds live: HF_PAGED_CACHE_DIR, else the install-time build shipped in the package when it
    matches these sources and this torch, else ~/.cache/hf_paged."""
    if os.environ.get("HF_PAGED_CACHE_DIR"):
        return Path(os.environ["HF_PAGED_CACHE_DIR"]) / "cuda"
    if (PREBUILT / "cuda" / _source_hash()).is_dir():
        return PREBUILT / "cuda"
    return Path.home() / ".cache" / "hf_paged" / "cuda"


def cuda_home() -> Path | None:
    """The CUDA toolkit folder (with include/cuda_runtime_api.h): CUDA_HOME, torch's guess, or next to nvcc."""
    from torch.utils import cpp_extension

    nvcc = shutil.which("nvcc")
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), cpp_extension.CUDA_HOME,
                  Path(nvcc).resolve().parents[1] if nvcc else None, "/usr/local/cuda"]
    for home in candidates:
        if home and (Path(home) / "include" / "cuda_runtime_api.h").is_file():
            return Path(home)
    return None


def prerequisites_missing() -> str | None:
    """Why the extension cannot even be built here (None: it can be tried)."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} was built without CUDA"
    if not torch.cuda.is_available():
        return "no CUDA device is visible (torch.cuda.is_available() is False)"
    if _nvcc() is None:
        return "nvcc was not found (install the CUDA toolkit or set CUDA_HOME)"
    if cuda_home() is None:
        return "the CUDA toolkit headers (include/cuda_runtime_api.h) were not found; set CUDA_HOME"
    missing = [name for name in (*SOURCES, *HEADERS) if not (CSRC / name).is_file()]
    if missing:
        return f"the CUDA sources are missing from {CSRC}: {missing} (set HF_PAGED_CSRC to the csrc folder)"
    return None


def _nvcc() -> str | None:
    home = cuda_home()
    if home is not None and (home / "bin" / "nvcc").exists():
        return str(home / "bin" / "nvcc")
    return shutil.which("nvcc")


def _source_hash() -> str:
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        digest.update((CSRC / name).read_bytes())
    digest.update(" ".join([torch.__version__, str(torch.version.cuda), *CUDA_FLAGS,
                            os.environ.get("TORCH_CUDA_ARCH_LIST", "")]).encode())
    return digest.hexdigest()[:16]


def _build_with_torch(name: str, build_dir: Path) -> None:
    """torch.utils.cpp_extension.load: ninja, torch's flags, the library registered on load."""
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        raise RuntimeError("ninja is not installed (pip install ninja)")
    library = build_dir / f"{name}.so"
    if library.exists() and not native.trusted_file(library):  # another user's: never loaded, linked again
        library.unlink()
    home = cuda_home()  # also passed explicitly: torch's guess can be a wrapper script's folder (/usr/local)
    cpp_extension.load(name=name, sources=[str(CSRC / s) for s in SOURCES],
                       extra_include_paths=[str(CSRC), str(home / "include")], extra_cuda_cflags=CUDA_FLAGS,
                       extra_cflags=["-O3"], extra_ldflags=[f"-L{home / 'lib64'}"], build_directory=str(build_dir),
                       is_python_module=False, verbose=os.environ.get("HF_PAGED_BUILD_VERBOSE") == "1")


def _arch_flags() -> list[str]:
    from torch.utils import cpp_extension

    try:
        return cpp_extension._get_cuda_arch_flags()  # honours TORCH_CUDA_ARCH_LIST; private, hence the fallback
    except Exception:  # noqa: BLE001
        major, minor = torch.cuda.get_device_capability()
        return [f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"]


def _build_direct(name: str, build_dir: Path) -> None:
    """Without ninja (or when cpp_extension refuses the toolkit): nvcc and the host compiler called directly,
    the shared library loaded with torch.ops.load_library."""
    import subprocess

    from torch.utils import cpp_extension

    home, nvcc = cuda_home(), _nvcc()
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise RuntimeError("no host C++ compiler (c++ / g++)")
    target, partial = build_dir / f"{name}.so", build_dir / f"{name}.tmp.so"
    if not native.is_complete(target):  # a library without its size + hash stamp is built again, never loaded
        abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
        includes = [f"-I{d}" for d in (*cpp_extension.include_paths(), str(CSRC), str(home / "include"))]
        kernels, bindings = build_dir / "paged_attention.o", build_dir / "bindings.o"
        torch_lib = cpp_extension.library_paths()[0]
        commands = [
            [nvcc, "-c", str(CSRC / "paged_attention.cu"), "-o", str(kernels), "-std=c++17", "--compiler-options",
             "-fPIC", *CUDA_FLAGS, *_arch_flags(), f"-I{CSRC}"],
            [cxx, "-c", str(CSRC / "bindings.cpp"), "-o", str(bindings), "-O3", "-fPIC", "-std=c++20", abi, *includes],
            [cxx, "-shared", str(bindings), str(kernels), "-o", str(partial), f"-L{torch_lib}",
             "-lc10", "-lc10_cuda", "-ltorch_cpu", f"-L{home / 'lib64'}", "-lcudart", f"-Wl,-rpath,{torch_lib}"],
        ]
        for command in commands:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
            if proc.returncode:
                raise RuntimeError(f"{' '.join(command[:3])} ... failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
        os.chmod(partial, 0o600)
        stamp = build_dir / f"{name}.tmp.sha256"
        stamp.unlink(missing_ok=True)
        native.write_stamp(partial, stamp)
        os.replace(partial, target)
        os.replace(stamp, target.with_suffix(".sha256"))  # last: the build is complete
    torch.ops.load_library(str(target))


class _MissingOps(RuntimeError):
    """The library loaded but does not register what the backend calls."""


def _has_op(name: str) -> bool:
    try:
        getattr(torch.ops.hf_paged, name)
        return True
    except (AttributeError, RuntimeError):
        return False


@functools.lru_cache(maxsize=1)
def load_extension() -> bool:
    """Build or load the extension once per process; True when torch.ops.hf_paged is registered."""
    reason = prerequisites_missing()
    if reason is not None:
        _status["reason"] = reason
        return False
    key = _source_hash()
    name = f"hf_paged_cuda_{key}"
    errors = []
    for build in (_build_with_torch, _build_direct):
        build_dir = cache_dir() / key / build.__name__.removeprefix("_build_")
        try:
            native.private_folder(build_dir)  # created 0700; refused when another user could change it
            build(name, build_dir)
            missing = [op for op in OPS if not _has_op(op)]
            if missing:
                raise _MissingOps(f"hf_paged: the CUDA library in {build_dir} lacks the ops {missing}: not used")
        except (native.UnsafeCacheError, _MissingOps) as e:
            native.logger.warning("%s", e)
            _status["reason"] = str(e)
            return False
        except Exception as e:  # noqa: BLE001 - a failed build makes the backend unavailable, with the compiler's words
            tail = "\n".join(str(e).splitlines()[-25:])
            errors.append(f"{build.__name__} in {build_dir}: {type(e).__name__}: {tail}")
            continue
        _status["reason"] = "loaded"
        return True
    _status["reason"] = "building the CUDA extension failed:\n" + "\n".join(errors)
    return False


def extension_status() -> str:
    """'loaded', or why the CUDA extension is not available."""
    load_extension()
    return _status.get("reason", "not tried")


def _ops():
    if not load_extension():
        raise RuntimeError(f"hf_paged CUDA extension unavailable: {extension_status()}")
    return torch.ops.hf_paged


# ---- the kernels ------------------------------------------------------------------------------------------
def unavailable_reason(device: torch.device) -> str | None:
    """Why the kernels cannot run on `device` (None: the extension is loaded and the device is a CUDA one)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"the CUDA kernels run on CUDA tensors only (tensors are on {device.type})"
    status = extension_status()
    return None if status == "loaded" else status


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    metadata: AttentionMetadata, scale: float, sliding_window: int | None = None,
                    softcap: float | None = None, partition_size: int = 0) -> torch.Tensor:
    """query [B, H, D] (one token per sequence) -> [B, H, D]. partition_size: 0 auto, -1 one pass, > 0 forced."""
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    _ops().paged_decode(out, query, key_cache, value_cache, _int32(metadata.block_tables),
                        _int32(metadata.context_lens), int(metadata.max_context_len), float(scale),
                        int(sliding_window or 0), float(softcap or 0.0), int(partition_size))
    return out


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, src_ids, dst_ids, block_dim: int = 2) -> None:
    """dst[:, :, d] = src[:, :, s] for every pair, in one launch. src and dst may be one device storage
    (copy-on-write) or a pinned host storage and a device storage (swap; the kernel reads / writes host memory
    directly, however scattered the blocks). The copy is ordered on the current stream."""
    pairs = torch.tensor([list(src_ids), list(dst_ids)], dtype=torch.int64).t().contiguous()
    if len(pairs) == 0:
        return
    device = src.device if src.is_cuda else dst.device
    _ops().copy_blocks(src, dst, pairs.pin_memory().to(device, non_blocking=True), block_dim)


def decode_plan(num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, max_context_len: int,
                sliding_window: int | None = None, partition_size: int = 0) -> tuple[int, int]:
    """(partition size, partitions) the decode kernel would use; partition size 0 means one pass."""
    size, count = _ops().plan_decode(num_seqs, num_heads, num_kv_heads, head_dim, max_context_len,
                                     int(sliding_window or 0), partition_size)
    return int(size), int(count)


if os.environ.get("HF_PAGED_BUILD_CUDA") == "1":
    load_extension()


if __name__ == "__main__":
    print(f"hf_paged CUDA extension: {extension_status()}")
