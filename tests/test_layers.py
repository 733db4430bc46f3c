"""The package's layers (import-linter contracts in pyproject.toml), its file-size rule and its tests' names."""
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_import_linter_contracts_hold():
    pytest.importorskip("importlinter")
    # its own process: import-linter reconfigures logging (it would silence hf_paged's logger for later tests)
    code = ("import sys; from importlinter.cli import lint_imports; "
            f"sys.exit(lint_imports(config_filename={str(ROOT / 'pyproject.toml')!r}, no_cache=True))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert "BROKEN" not in out and proc.returncode == 0, out[-3000:]
    assert "Contracts: 4 kept" in out, out[-3000:]  # every contract was read and checked


def test_no_source_file_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "hf_paged").rglob("*.py")
            if (n := p.read_text().count("\n")) > 400}
    assert not long, f"split these by concept: {long}"


# Modules that have no test file named after them yet. This list may only shrink: a new module comes with its own
# test file, and a module that gets one leaves the list (the test below fails until it does).
NO_TEST_FILE_YET: set[str] = set()


def modules_without_a_test_file() -> set[str]:
    """Modules of hf_paged/ (as "pkg/name") with no tests/test_<pkg>_<name>.py nor tests/test_<name>.py. The short
    form names a module only when no other module shares its name, or for the one module outside bench/ of that name
    (bench/swap is test_bench_swap.py; kv/swap is test_swap.py)."""
    tests = {p.stem for p in (ROOT / "tests").glob("test_*.py")}
    modules = [p.relative_to(ROOT / "hf_paged").with_suffix("").parts
               for p in sorted((ROOT / "hf_paged").rglob("*.py")) if p.name != "__init__.py"]
    everywhere = Counter(parts[-1] for parts in modules)
    outside_bench = Counter(parts[-1] for parts in modules if parts[0] != "bench")
    missing = set()
    for parts in modules:
        names = {"test_" + "_".join(parts)}
        if everywhere[parts[-1]] == 1 or (parts[0] != "bench" and outside_bench[parts[-1]] == 1):
            names.add("test_" + parts[-1])
        if not names & tests:
            missing.add("/".join(parts))
    return missing


def test_every_module_has_a_test_file_named_after_it():
    missing = modules_without_a_test_file()
    new, done = sorted(missing - NO_TEST_FILE_YET), sorted(NO_TEST_FILE_YET - missing)
    assert not new, (f"give these modules a test file named after them (tests/test_<name>.py, or "
                     f"tests/test_<package>_<name>.py where the short name is shared): {new}; still allowed without "
                     f"one (NO_TEST_FILE_YET): {sorted(NO_TEST_FILE_YET)}")
    assert not done, (f"these modules now have a test file (or are gone): take them off NO_TEST_FILE_YET: {done}; "
                      f"still without one: {sorted(missing)}")
