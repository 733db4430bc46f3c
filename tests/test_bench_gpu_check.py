"""bench/gpu_check.py and benchmarks/gpu_check.sh on a machine without CUDA: the GPU session's one-shot check must
run there as it was carried, so what can fail without a GPU is checked here (imports, the dry run, the summary of
recorded results, the script's pytest steps in an environment without pytest-xdist)."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_paged.bench import gpu_check

ROOT = Path(__file__).resolve().parents[1]
RECORDED = ROOT / "benchmarks" / "results" / "gpu-h200-2026-12-04-run1"

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is what a machine without CUDA does")


@pytest.mark.parametrize("step", ["ceilings", "decode", "swap", "engine", "parity", "profile"])
def test_each_step_without_cuda_records_that_it_was_skipped(step, tmp_path, capsys):
    assert gpu_check.main([step, str(tmp_path)]) == 0
    assert f"{step}: skipped: no CUDA" in capsys.readouterr().out
    assert json.loads((tmp_path / f"{step}.json").read_text()) == {"skipped": "no CUDA"}


def test_the_summary_of_a_recorded_gpu_session():
    """The table step reads the JSON an H200 session wrote (benchmarks/results): every section is there."""
    text = gpu_check.table(RECORDED)
    assert "ceilings (NVIDIA H200)" in text and "4132 GB/s" in text
    assert "b64 ctx2048 block16" in text and "copy_blocks kernel" in text
    assert "parity with HF" in text
    assert "skipped (no CUDA)" not in text
    assert gpu_check.table(RECORDED.parent / "no-such-session") == "no results"


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")
def test_the_script_runs_its_pytest_steps_without_pytest_xdist(tmp_path):
    """The project's pytest options ask for two xdist workers; a device image may lack pytest-xdist (simulated here
    with `-p no:xdist`), where pytest would stop at the command line (exit 4) before collecting the GPU tests. Without
    CUDA every GPU test is deselected: exit 5, no test collected."""
    env = {**os.environ, "PYTEST_ADDOPTS": "-p no:xdist", "GPU_CHECK_STEPS": "ceilings pytest_engine",
           "GPU_CHECK_BUDGET": "200", "GPU_CHECK_WHEELS": str(tmp_path / "no-wheels"), "PYTHON": sys.executable}
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(out)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = (out / "summary.txt").read_text()
    steps = {line.split()[0]: line.split()[1:] for line in summary.splitlines() if line.startswith("  ")}
    assert steps["versions"][0] == "ok" and steps["ceilings"][0] == "ok", summary
    assert steps["pytest_engine"][:2] == ["exit", "5"], (summary, (out / "pytest_engine.log").read_text())
    assert "GPU-only tests not collected" in (out / "pytest_engine.log").read_text()
    assert "skipped (no CUDA): ceilings" in summary
