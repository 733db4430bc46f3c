"""The package's layers (import-linter contracts in pyproject.toml) and its file-size rule."""
import subprocess
import sys
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
