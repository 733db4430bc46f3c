"""Native CPU code built on first use with the system C compiler, cached on disk and loaded with ctypes.

The C sources ship with the package (`attention/cpu/paged_decode.c`, `model/cpu/small_gemm.c`). Each is compiled
once per (source, compiler, flags) into `$HF_PAGED_CACHE_DIR` (default `~/.cache/hf_paged`); with
`-march=native` the build is for the machine it runs on. `-fopenmp` binds the library to the libgomp torch
already loaded (same soname), so torch and our kernels share one thread pool and `torch.set_num_threads` applies.
Without a compiler `build()` raises and callers fall back to plain torch.

Loading a library runs its code, so the cache is trusted only when no other user can change it: the folder and every
folder above it owned by this user or root, the folder itself writable by no one else (a folder above it may be, with
the sticky bit, like /tmp), and each cached file a regular file of this user or root that no one else can write
(write permission for the owner's user-private group, under Debian's umask 002, counts as the owner's).
An unsafe folder raises `UnsafeCacheError` (callers fall back to torch, with a warning naming the folder and the fix);
an untrusted file is never loaded but rebuilt over. Folders are created 0700 and files 0600.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")
logger = logging.getLogger("hf_paged")
_warned: set[str] = set()


class UnsafeCacheError(RuntimeError):
    """The build cache (or a folder above it) can be changed by another user: code loaded from it could be theirs."""

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math", "-shared", "-fPIC")
EXACT_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-shared", "-fPIC")


def cache_dir() -> Path:
    return Path(os.environ.get("HF_PAGED_CACHE_DIR") or Path.home() / ".cache" / "hf_paged")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _trusted_owner(uid: int) -> bool:
    return not hasattr(os, "geteuid") or uid in (os.geteuid(), 0)  # no POSIX owners (Windows): not checked


def _private_group(uid: int, gid: int) -> bool:
    """Whether `gid` is the user-private group of `uid`: named after the user, with no other members (Debian and
    Ubuntu give each user one and a umask of 002, so their folders are group-writable by the user alone)."""
    try:
        import grp
        import pwd

        user, group = pwd.getpwuid(uid).pw_name, grp.getgrgid(gid)
    except (ImportError, KeyError):
        return False
    return group.gr_name == user and set(group.gr_mem) <= {user}


def _others_can_write(info: os.stat_result) -> bool:
    return bool(info.st_mode & stat.S_IWOTH or info.st_mode & stat.S_IWGRP
                and not _private_group(info.st_uid, info.st_gid))


def check_folder(folder: Path) -> None:
    """Raise UnsafeCacheError unless only this user (or root) can change what `folder` holds: it and every folder
    above it (as given and with links resolved) owned by this user or root, `folder` writable by no one else and a
    folder above it only with the sticky bit (/tmp)."""
    folder = Path(os.path.abspath(folder))
    real = Path(os.path.realpath(folder))
    fix = ("other users could replace the compiled code in it. Fix: make it yours and private (chmod 700) or set "
           "HF_PAGED_CACHE_DIR to a folder only you can write, such as ~/.cache/hf_paged; meanwhile torch is used")
    for path in dict.fromkeys([folder, real, *folder.parents, *real.parents]):
        info = os.stat(path)
        is_cache = path in (folder, real)
        where = f"the native-code cache {path}" if is_cache else f"the native-code cache {folder}: its parent {path}"
        if not _trusted_owner(info.st_uid):
            raise UnsafeCacheError(f"hf_paged: not using {where}, owned by uid {info.st_uid} (not you): {fix}")
        if _others_can_write(info) and (is_cache or not info.st_mode & stat.S_ISVTX):
            raise UnsafeCacheError(f"hf_paged: not using {where}, writable by other users "
                                   f"(mode {stat.filemode(info.st_mode)}): {fix}")


def private_folder(folder: Path) -> Path:
    """`folder` after `check_folder`, created (with any missing parents) with mode 0700 first where missing."""
    folder = Path(os.path.abspath(folder))
    for path in reversed([p for p in (folder, *folder.parents) if not p.exists()]):
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:  # a concurrent builder made it: checked below like any other
            pass
    check_folder(folder)
    return folder


def trusted_file(path: Path) -> bool:
    """A regular file (not a link) of this user or root that no one else can write."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and _trusted_owner(info.st_uid) and not _others_can_write(info)


def write_stamp(library: Path, stamp: Path) -> None:
    """Write `library`'s size + hash stamp to `stamp` (a new file, mode 0600)."""
    with os.fdopen(os.open(stamp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(f"{library.stat().st_size} {_digest(library)}")


def is_complete(target: Path) -> bool:
    """A cached build is loaded only when its size and hash match what the builder wrote after a complete build:
    a truncated or damaged .so (an interrupted copy, a full disk) would crash the process when mapped. Both files
    must be `trusted_file`s: one another user could have written is never loaded (it is rebuilt over)."""
    stamp = target.with_suffix(".sha256")
    if not (trusted_file(target) and trusted_file(stamp)):
        return False
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


def _compiler() -> list[str]:
    compiler = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or ""]
    if not compiler[0]:
        raise RuntimeError("no C compiler (cc / gcc) on PATH")
    return compiler


def target_path(source: Path, flags: tuple[str, ...] = FLAGS) -> Path:
    """Where the build of `source` with this compiler, `flags` and CPU is cached (the folder is not checked)."""
    key = hashlib.sha256(source.read_bytes() + " ".join([*_compiler(), *flags, cpu_identity()]).encode()).hexdigest()
    return cache_dir() / f"{source.stem}_{key[:16]}.so"


def build(source: Path, flags: tuple[str, ...] = FLAGS) -> Path:
    """The shared library of `source`, compiled now unless a complete build of the same source, compiler, flags and
    CPU is cached. Raises RuntimeError without a compiler, subprocess.CalledProcessError when compilation fails,
    UnsafeCacheError when another user could change the cache folder. `CC` may carry arguments (`CC="ccache gcc"`)."""
    compiler, target = _compiler(), target_path(source, flags)
    private_folder(target.parent)
    if not is_complete(target):
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # mode 0700
            built = Path(tmp) / target.name
            subprocess.run([*compiler, *flags, str(source), "-o", str(built), "-lm"], check=True,
                           capture_output=True, timeout=120)
            os.chmod(built, 0o600)
            stamp = Path(tmp) / "stamp"
            write_stamp(built, stamp)
            os.replace(built, target)  # atomic: concurrent builders never see a partial file
            os.replace(stamp, target.with_suffix(".sha256"))  # written last: the build is complete
    return target


def load(source: Path, switch: str, wrap: Callable[[Path], T],
         flags: tuple[str, ...] = FLAGS) -> tuple[T | None, str]:
    """`wrap(the built library's path)` and "loaded", or None and why not: the environment variable `switch` set to
    0, no compiler, a failed build, an unsafe cache folder or a library that does not load or lacks the kernel's
    function (`wrap` raising OSError or AttributeError). The last three are logged as a one-line warning. `flags`:
    EXACT_FLAGS for code whose every rounding must be the one written (no reassociation)."""
    if os.environ.get(switch, "1") == "0":
        return None, f"disabled by {switch}=0"
    try:
        path = build(source, flags)
    except UnsafeCacheError as error:
        if str(error) not in _warned:  # once per process, not once per kernel
            _warned.add(str(error))
            logger.warning("%s", error)
        return None, str(error)
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", b"") or b""  # the compiler's own message
        return None, f"{type(error).__name__}: {error} {detail.decode(errors='replace')[:500]}".strip()
    try:
        return wrap(path), "loaded"
    except (OSError, AttributeError) as error:  # ctypes: not a loadable library, or the function is missing
        reason = f"cannot use {path} ({type(error).__name__}: {error}); using torch instead"
        logger.warning("hf_paged: %s", reason)
        return None, reason
