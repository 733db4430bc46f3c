"""Build hook (everything else is in pyproject.toml).

Wheels carry the CUDA sources from csrc/ as `hf_paged/_csrc`, so an installed package can build its CUDA
extension on first use. With `HF_PAGED_BUILD_CUDA=1` the extension is also compiled now, into
`hf_paged/_prebuilt` inside the wheel; that needs the target torch (with CUDA), nvcc and a visible GPU in the
build environment, i.e. `HF_PAGED_BUILD_CUDA=1 pip install --no-build-isolation .`. A failed build is reported
and the package still installs (the extension is then built lazily, or the backend says why it is unavailable).
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
CSRC_FILES = ("bindings.cpp", "paged_attention.cu", "paged_attention.h")


class BuildPyWithCsrc(build_py):
    def run(self):
        super().run()
        package = Path(self.build_lib) / "hf_paged"
        target = package / "_csrc"
        target.mkdir(parents=True, exist_ok=True)
        for name in CSRC_FILES:
            shutil.copy2(ROOT / "csrc" / name, target / name)
        if os.environ.get("HF_PAGED_BUILD_CUDA") == "1":
            self._build_extension(package)

    def _build_extension(self, package: Path) -> None:
        env = dict(os.environ, HF_PAGED_CSRC=str(package / "_csrc"), HF_PAGED_CACHE_DIR=str(package / "_prebuilt"),
                   PYTHONPATH=self.build_lib + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("HF_PAGED_BUILD_CUDA")  # the module would otherwise build on import as well
        code = ("from hf_paged.attention import cuda_backend as c; s = c.extension_status(); print(s); "
                "raise SystemExit(s != 'loaded')")
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
        print(f"hf_paged: install-time CUDA build: {(proc.stdout + proc.stderr).strip()[-2000:]}")


setup(cmdclass={"build_py": BuildPyWithCsrc})
