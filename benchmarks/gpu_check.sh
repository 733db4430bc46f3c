#!/usr/bin/env bash
# One GPU session's checks and measurements, about 8 minutes on an H200:
#
#     bash benchmarks/gpu_check.sh OUTDIR
#
# 1. versions (nvidia-smi, torch, triton, transformers, flash libraries); transformers >= 5.24 is needed: wheels
#    carried in $GPU_CHECK_WHEELS (default .whl/: transformers and what it needs that the machine lacks) are
#    installed first into a separate folder put in front on PYTHONPATH (pip --no-index --no-deps --target)
# 2. ceilings: device copy GB/s, pinned host<->device GB/s, bf16 matmul TFLOP/s      (hf_paged/bench/gpu_check.py)
# 3. the csrc/ CUDA extension: the torch build (timed) and the ptxas report (tests/test_cuda_build.py)
# 4. pytest -m gpu (tests/test_gpu.py: every available backend vs the float64 reference, the CUDA kernels)
# 5. decode attention per backend as achieved GB/s vs the copy ceiling
# 6. swap bandwidth: one copy per block vs contiguous runs vs the copy_blocks kernel
# 7. engine vs transformers' generate_batch on a random ~1.1B Llama (bf16), and the swap/recompute break-even;
#    parity with HF; the engine's step phase by phase, graphs on and off (OUTDIR/profile_graphs_*.txt)
# 8. a short summary table (also in OUTDIR/summary.txt)
#
# Wheels for a machine whose transformers is older than 5.24 and which has no network (2026-12-04, an H200 image
# with transformers 5.17 and huggingface_hub 1.33): transformers itself plus what it needs that such an image lacks,
# fetched for its python (3.12, manylinux x86_64) with `pip download --no-deps --only-binary=:all: -d .whl NAME==V`:
#     transformers huggingface_hub httpx2 httpcore2 truststore click hf-xet regex kernels tomlkit
# (the versions this checkout's own environment has). flashinfer-python's wheel (~100 MB) is too large to carry.
#
# Every step has its own time limit and log (OUTDIR/<step>.log); a failing step does not stop the others. All steps
# share one deadline (GPU_CHECK_BUDGET seconds, default 480): a step gets at most what is left of it, and is skipped
# when nothing is. GPU_CHECK_STEPS="build decode ..." runs only the steps named (default: all; wheels and versions
# always run). Without CUDA the python steps print "skipped: no CUDA" (a CPU dry run).
set -u
OUTDIR=${1:?usage: bash benchmarks/gpu_check.sh OUTDIR}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export HF_PAGED_CACHE_DIR=${HF_PAGED_CACHE_DIR:-${TMPDIR:-/tmp}/hf_paged_cache}
export PYTHONUNBUFFERED=1
BUDGET=${GPU_CHECK_BUDGET:-480}
STATUS=()

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to OUTDIR/NAME.log, remember the outcome
    local name=$1 limit=$2
    shift 2
    case " wheels versions ${GPU_CHECK_STEPS:-$name} " in *" $name "*) ;; *) return ;; esac
    local start=$SECONDS left=$((BUDGET - SECONDS - 5))
    if [ $left -lt 10 ]; then
        STATUS+=("$(printf '%-10s %-10s' "$name" "no time left")")
        echo "=== $name: skipped, the ${BUDGET}s budget is spent"
        return
    fi
    [ $limit -gt $left ] && limit=$left
    echo "=== $name (limit ${limit}s)"
    timeout --kill-after=10 "$limit" "$@" > "$OUTDIR/$name.log" 2>&1
    local rc=$?
    tail -n 40 "$OUTDIR/$name.log"
    local outcome=ok
    [ $rc -eq 124 ] && outcome="timed out"
    [ $rc -ne 0 ] && [ $rc -ne 124 ] && outcome="exit $rc"
    STATUS+=("$(printf '%-10s %-10s %4ds' "$name" "$outcome" $((SECONDS - start)))")
}

# 1. versions, and transformers from carried wheels if there are any
WHEELS=${GPU_CHECK_WHEELS:-.whl}
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    SITE=${TMPDIR:-/tmp}/hf_paged_site
    rm -rf "$SITE"  # no package left from an earlier run
    step wheels 120 $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$WHEELS"/*.whl
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi
step versions 30 bash -c "
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 || echo 'nvidia-smi: not available'
    command -v nvcc >/dev/null && nvcc --version | tail -n 2 || echo 'nvcc: not found'
    $PY - <<'EOF'
import importlib, platform
import torch
print('python', platform.python_version(), '| torch', torch.__version__, '| torch CUDA', torch.version.cuda,
      '| device', torch.cuda.get_device_name() if torch.cuda.is_available() else 'none')
for name in ('transformers', 'triton', 'flash_attn', 'flash_attn_interface', 'flashinfer', 'ninja'):
    try:
        module = importlib.import_module(name)
        print(f'{name:<22}', getattr(module, '__version__', 'installed'))
    except Exception as e:
        print(f'{name:<22} not available ({type(e).__name__})')
import transformers
major, minor = (int(x) for x in transformers.__version__.split('.')[:2])
print('transformers >= 5.24:', (major, minor) >= (5, 24))
EOF"

# 2. ceilings
step ceilings 60 $PY -m hf_paged.bench.gpu_check ceilings "$OUTDIR"

# 3. the CUDA extension (the ptxas report needs no GPU: tests/test_cuda_build.py runs it wherever nvcc is)
step build 180 bash -c "time $PY -m hf_paged.attention.cuda_backend"

# 4. GPU tests: the engine-level ones (short); the kernel matrix runs last
# -o addopts=: the project's "-n 2" needs pytest-xdist, which a device image may lack (and GPU tests run in one process)
GPU_PYTEST="$PY -m pytest -q -s -m gpu tests/test_gpu.py -p no:cacheprovider -o addopts= -rs --durations=8"
step pytest_engine 150 $GPU_PYTEST -k "not matches_float64 and not decode_kernel_variants" --maxfail=10

# 5-8. measurements, then the kernel matrix with what time is left
step decode 60 $PY -m hf_paged.bench.gpu_check decode "$OUTDIR"
step swap 45 $PY -m hf_paged.bench.gpu_check swap "$OUTDIR"
step engine 150 $PY -m hf_paged.bench.gpu_check engine "$OUTDIR"
step parity 90 $PY -m hf_paged.bench.gpu_check parity "$OUTDIR"
step profile 120 $PY -m hf_paged.bench.gpu_check profile "$OUTDIR"
step pytest_kernels 150 $GPU_PYTEST -k "matches_float64 or decode_kernel_variants" --maxfail=20

# 9. summary
echo
echo "=== summary"
{
    $PY -m hf_paged.bench.gpu_check table "$OUTDIR"
    echo
    echo "steps (OUTDIR/<step>.log):"
    printf '  %s\n' "${STATUS[@]}"
} | tee "$OUTDIR/summary.txt"
