"""engine/host_allocator.py: the process-wide allocator tuning is skipped when turned off or without glibc, and
applied at most once."""
import pytest

from hf_paged.engine import host_allocator


@pytest.fixture
def fresh(monkeypatch):
    host_allocator.tune_host_allocator.cache_clear()
    yield host_allocator
    host_allocator.tune_host_allocator.cache_clear()


def test_turned_off_by_the_environment(fresh, monkeypatch):
    monkeypatch.setenv("HF_PAGED_TUNE_MALLOC", "0")
    assert fresh.tune_host_allocator() == "disabled by HF_PAGED_TUNE_MALLOC=0"


def test_left_alone_without_glibc(fresh, monkeypatch):
    monkeypatch.delenv("HF_PAGED_TUNE_MALLOC", raising=False)
    monkeypatch.setattr(fresh.platform, "libc_ver", lambda: ("musl", "1.2"))
    assert fresh.tune_host_allocator() == "not glibc: left as is"


def test_applied_once_per_process(fresh, monkeypatch):
    monkeypatch.delenv("HF_PAGED_TUNE_MALLOC", raising=False)
    calls = []

    class Libc:
        def mallopt(self, param, value):
            calls.append((param, value))
            return 1

    monkeypatch.setattr(fresh.platform, "system", lambda: "Linux")
    monkeypatch.setattr(fresh.platform, "libc_ver", lambda: ("glibc", "2.35"))
    monkeypatch.setattr(fresh.ctypes, "CDLL", lambda name: Libc())
    assert fresh.tune_host_allocator().startswith("tuned")
    fresh.tune_host_allocator()
    assert calls == [(fresh.M_MMAP_THRESHOLD, 32 << 20), (fresh.M_TRIM_THRESHOLD, 1 << 30)]
