"""The native-code build cache runs whatever library it holds, so it is used only when no other user can change it:
a folder (or a parent) others can write, or one of another user, is refused and torch is used; a cached file of
another user or writable by others is rebuilt, never loaded; the CUDA build loads only stamped libraries; what the
cache creates is 0700 / 0600; a library without the kernel's function falls back to torch and the model is served."""
import ctypes
import logging
import os
import shutil
import stat
import subprocess

import pytest
import torch

from hf_paged import native
from hf_paged.attention import cpu_kernel, cuda_backend
from hf_paged.model import small_linear

pytestmark = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="needs a C compiler")
ROOT = os.geteuid() == 0 if hasattr(os, "geteuid") else False
OTHER_UID = 54321


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("HF_PAGED_CACHE_DIR", str(folder))
    return folder


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "twice.c"
    path.write_text("long twice(long x) { return 2 * x; }\n")
    return path


@pytest.fixture
def fresh_kernels():
    """The kernels' loaders forget what they found before and after (the next test loads from its own cache)."""
    loaders = (cpu_kernel.load_cpu_kernel, small_linear.load_small_gemm, cuda_backend.load_extension)
    for loader in loaders:
        loader.cache_clear()
    yield
    for loader in loaders:
        loader.cache_clear()


def compile_to(code: str, path, tmp_path) -> None:
    """Compile `code` into the library `path` (the way someone planting a library would)."""
    c = tmp_path / f"planted_{abs(hash(code))}.c"
    c.write_text(code)
    subprocess.run([shutil.which("cc") or shutil.which("gcc"), "-shared", "-fPIC", str(c), "-o", str(path)], check=True)


def plant(code: str, target, tmp_path, uid: int | None = None, mode: int = 0o600) -> None:
    """A library at `target` with a matching size + hash stamp, owned by `uid`, with `mode`."""
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    compile_to(code, target, tmp_path)
    stamp = target.with_suffix(".sha256")
    stamp.write_text(f"{target.stat().st_size} {native._digest(target)}")
    for path in (target, stamp):
        os.chmod(path, mode)
        if uid is not None:
            os.chown(path, uid, uid)


def twice(path) -> int:
    lib = ctypes.CDLL(str(path))
    lib.twice.restype, lib.twice.argtypes = ctypes.c_long, [ctypes.c_long]
    return lib.twice(21)


@pytest.mark.parametrize("layout", ["cache open to all", "cache open to a group", "parent open, not sticky"])
def test_a_folder_others_can_write_is_refused_with_the_fix(layout, cache, source, caplog, monkeypatch):
    cache.mkdir(mode=0o700)
    if layout == "cache open to all":
        os.chmod(cache, 0o777)
    elif layout == "cache open to a group":
        if not ROOT:
            pytest.skip("gives the folder to another group: needs root")
        os.chown(cache, -1, OTHER_UID)  # a group that is not the user's private one
        os.chmod(cache, 0o770)
    else:
        os.chmod(cache.parent, 0o777)
    with pytest.raises(native.UnsafeCacheError) as error:
        native.build(source)
    message = str(error.value)
    assert str(cache) in message and "writable by other users" in message and "HF_PAGED_CACHE_DIR" in message
    assert not list(cache.glob("*.so"))
    monkeypatch.setattr(native, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="hf_paged"):
        for _ in range(2):  # two kernels: one warning
            lib, reason = native.load(source, "HF_PAGED_TEST_SWITCH", ctypes.CDLL)
            assert lib is None and reason == message
    assert [r.getMessage() for r in caplog.records] == [message] and "\n" not in message


def test_a_sticky_parent_like_tmp_is_accepted(cache, source):
    os.chmod(cache.parent, 0o1777)
    assert twice(native.build(source)) == 42


def test_a_folder_open_to_the_users_private_group_is_accepted(cache, source):
    """Debian / Ubuntu: umask 002 and a group of one's own (named after the user, no other members)."""
    import grp
    import pwd

    user = pwd.getpwuid(os.geteuid()).pw_name
    private = [g.gr_gid for g in grp.getgrall() if g.gr_name == user and set(g.gr_mem) <= {user}]
    if not private or (private[0] != os.getegid() and not ROOT):
        pytest.skip("this user has no private group to give the folder to")
    cache.mkdir(mode=0o770)
    os.chown(cache, -1, private[0])
    os.chmod(cache, 0o770)
    native.build(source)


@pytest.mark.skipif(not ROOT, reason="gives files to another user: needs root")
def test_a_folder_of_another_user_is_refused(cache, source):
    cache.mkdir(mode=0o700)
    os.chown(cache, OTHER_UID, OTHER_UID)
    with pytest.raises(native.UnsafeCacheError, match=f"{cache}, owned by uid {OTHER_UID}"):
        native.build(source)


@pytest.mark.skipif(not ROOT, reason="gives files to another user: needs root")
@pytest.mark.parametrize("owner", ["another user", "writable by others"])
def test_a_planted_library_with_a_matching_stamp_is_rebuilt_not_loaded(owner, cache, source, tmp_path):
    target = native.target_path(source)
    evil = "long twice(long x) { return 3 * x; }\n"
    if owner == "another user":
        plant(evil, target, tmp_path, uid=OTHER_UID)
    else:
        plant(evil, target, tmp_path, mode=0o666)
    assert native.build(source) == target
    assert twice(target) == 42  # our build, not the planted one (63)
    info = os.stat(target)
    assert info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) == 0o600


def test_created_folders_and_files_are_private(cache, source, monkeypatch):
    nested = cache / "a" / "b"
    monkeypatch.setenv("HF_PAGED_CACHE_DIR", str(nested))
    umask = os.umask(0)  # what we create must not depend on the umask
    try:
        target = native.build(source)
    finally:
        os.umask(umask)
    for folder in (cache, cache / "a", nested):
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700, folder
    assert sorted(p.name for p in nested.iterdir()) == sorted([target.name, target.with_suffix(".sha256").name])
    for path in nested.iterdir():
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path


def test_a_library_without_the_kernels_function_falls_back_to_torch(cache, tmp_path, caplog, fresh_kernels,
                                                                     monkeypatch):
    from hf_paged import LLM, SamplingParams
    from hf_paged.tiny import tiny_chat_model

    for source in (cpu_kernel.SOURCE, small_linear.SOURCE):  # stamped, ours, but not the kernel
        plant("long unrelated(long x) { return x; }\n", native.target_path(source), tmp_path)
    model, tok = tiny_chat_model()
    params = SamplingParams(max_tokens=4, temperature=0)
    with caplog.at_level(logging.WARNING, logger="hf_paged"):
        outputs = LLM(model, tokenizer=tok).generate(["Hello there", "Hi"], params, use_tqdm=False)
        assert cpu_kernel.load_cpu_kernel() is None and "paged_decode_f32" in cpu_kernel.cpu_kernel_status()
        assert small_linear.small_linear_status().startswith("W @ x^T") and "small_gemm_f32" in \
            small_linear.small_linear_status()
    warnings = [r.getMessage() for r in caplog.records if "cannot use" in r.getMessage()]
    assert len(warnings) == 2 and all("\n" not in w for w in warnings)
    monkeypatch.setenv("HF_PAGED_CPU_KERNEL", "0")
    monkeypatch.setenv("HF_PAGED_SMALL_GEMM", "0")
    cpu_kernel.load_cpu_kernel.cache_clear()
    small_linear.load_small_gemm.cache_clear()
    reference = LLM(model, tokenizer=tok).generate(["Hello there", "Hi"], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [list(o.outputs[0].token_ids) for o in reference]
    assert all(len(o.outputs[0].token_ids) == 4 for o in outputs)


# --- the CUDA extension's build (run here without CUDA: the compilers are stand-ins) ---------------------------
@pytest.fixture
def fake_toolkit(tmp_path, monkeypatch):
    """nvcc / c++ stand-ins writing `-o` files, and torch.ops.load_library recording what it would load."""
    calls, loaded = [], []

    def run(command, **kwargs):
        calls.append(command)
        output = command[command.index("-o") + 1]
        with open(output, "wb") as f:
            f.write(b"built " + os.path.basename(output).encode())
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setattr(cuda_backend, "cuda_home", lambda: tmp_path)
    monkeypatch.setattr(cuda_backend, "_nvcc", lambda: "nvcc")
    monkeypatch.setattr(cuda_backend, "_arch_flags", lambda: [])
    monkeypatch.setattr(torch.ops, "load_library", lambda path: loaded.append((path, open(path, "rb").read())))
    return calls, loaded


def test_the_direct_cuda_build_never_loads_an_unstamped_library(tmp_path, fake_toolkit):
    calls, loaded = fake_toolkit
    build_dir = tmp_path / "direct"
    build_dir.mkdir(mode=0o700)
    planted = build_dir / "hf_paged_cuda_k.so"
    planted.write_bytes(b"planted, no stamp")
    cuda_backend._build_direct("hf_paged_cuda_k", build_dir)
    assert len(calls) == 3 and loaded == [(str(planted), b"built hf_paged_cuda_k.tmp.so")]
    assert native.is_complete(planted) and stat.S_IMODE(os.stat(planted).st_mode) == 0o600
    cuda_backend._build_direct("hf_paged_cuda_k", build_dir)  # stamped now: loaded without building again
    assert len(calls) == 3 and len(loaded) == 2


def fake_builds(monkeypatch) -> list:
    """load_extension with its prerequisites met and a torch build that only records its folder."""
    builds = []

    def _build_with_torch(name, where):
        builds.append(where)

    monkeypatch.setattr(cuda_backend, "prerequisites_missing", lambda: None)
    monkeypatch.setattr(cuda_backend, "_source_hash", lambda: "k")
    monkeypatch.setattr(cuda_backend, "_build_with_torch", _build_with_torch)
    return builds


def test_the_cuda_build_refuses_a_folder_others_can_write(cache, monkeypatch, caplog, fresh_kernels):
    builds = fake_builds(monkeypatch)
    cache.mkdir()
    os.chmod(cache, 0o777)
    with caplog.at_level(logging.WARNING, logger="hf_paged"):
        assert cuda_backend.load_extension() is False
    assert builds == [] and str(cache) in cuda_backend.extension_status() and len(caplog.records) == 1


def test_the_cuda_build_makes_private_folders_and_refuses_a_library_without_its_ops(cache, monkeypatch, caplog,
                                                                                     fresh_kernels):
    builds = fake_builds(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="hf_paged"):
        assert cuda_backend.load_extension() is False  # "built" without registering torch.ops.hf_paged
    assert builds == [cache / "cuda" / "k" / "with_torch"] and "lacks the ops" in cuda_backend.extension_status()
    assert [stat.S_IMODE(os.stat(p).st_mode) for p in (cache, cache / "cuda", cache / "cuda" / "k", builds[0])] == \
        [0o700] * 4
    assert len(caplog.records) == 1
