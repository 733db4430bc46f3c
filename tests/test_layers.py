"""The package's layers (import-linter contracts in pyproject.toml) and its file-size rule."""
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_import_linter_contracts_hold(capsys):
    pytest.importorskip("importlinter")
    from importlinter.cli import lint_imports

    code = lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True)
    out = capsys.readouterr().out
    assert "BROKEN" not in out and code == 0, out[-3000:]
    assert "Contracts: 4 kept" in out, out[-3000:]  # every contract was read and checked


def test_no_source_file_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "hf_paged").rglob("*.py")
            if (n := p.read_text().count("\n")) > 400}
    assert not long, f"split these by concept: {long}"
