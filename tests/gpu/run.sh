#!/usr/bin/env bash
# The GPU check, one command, on a GPU machine from a fresh checkout: the GPU tests, the headline command as the
# documentation writes it, and benchmarks/gpu_bench.py (which writes benchmarks/RESULTS-gpu.md naming its commit).
#   bash tests/gpu/run.sh
# Offline, on a machine whose python3 already has a CUDA build of torch (the lent H200's image): fill the wheel
# folder here first (bash scripts/gpu_wheels.sh), carry wheels/gpu along, and this script installs hydraddp's few
# pure-Python dependencies from it with no network, beside the machine's own torch.
# Online, without a CUDA torch: a venv, TORCH_SPEC (default torch==2.13.0, PyPI's CUDA build on Linux), e.g.
#   TORCH_SPEC="torch==2.13.0 --index-url <a CUDA wheel index matching the driver>" bash tests/gpu/run.sh
# NO_INSTALL=1 skips installing (everything is there already). WHEELS names another wheel folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
WHEELS=${WHEELS:-wheels/gpu}

# Before touching any venv: on a machine without a GPU driver this script has nothing to test.
if ! nvidia-smi -L; then
    echo "run.sh: nvidia-smi failed: no NVIDIA driver here; run this on a GPU machine" >&2
    exit 1
fi

cuda_torch() { "$1" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; }

if [ "${NO_INSTALL:-0}" != 1 ] && cuda_torch python3 && [ -d "$WHEELS" ]; then
    # The machine's torch, and the rest from the wheel folder into a directory of our own: no network, and nothing
    # of the image's own packages replaced.
    echo "run.sh: the machine's torch, and hydraddp's dependencies from $WHEELS"
    python3 -m pip install -q --no-index --no-deps --target .gpu-site "$WHEELS"/*.whl
    export PYTHONPATH="$PWD:$PWD/.gpu-site${PYTHONPATH:+:$PYTHONPATH}"
    PYTHON=python3
else
    # Use the project's venv when there is one; otherwise a GPU one of our own.
    if [ -d .venv ]; then
        VENV=.venv
    else
        VENV=.venv-gpu
        [ -d "$VENV" ] || python3 -m venv "$VENV"
    fi
    # shellcheck disable=SC1091
    . "$VENV/bin/activate"
    PYTHON=python
    if [ "${NO_INSTALL:-0}" != 1 ]; then
        TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
        python -m pip install -q --upgrade pip
        # torch first and pinned: a bare "torch" in the project's requirements could pull another build.
        # A CPU-only build already satisfies "torch==2.13.0" (2.13.0+cpu), so replace it instead.
        # shellcheck disable=SC2086  # TORCH_SPEC may carry pip options
        if ! cuda_torch python; then
            python -m pip install -q --force-reinstall $TORCH_SPEC
        else
            python -m pip install -q $TORCH_SPEC
        fi
        # The GPU machine's Python may be one CI cannot run (the lent one's is 3.12): this run is its test.
        python -m pip install -q --ignore-requires-python -e '.[test]'
    fi
fi

"$PYTHON" -c 'import torch; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, available: {torch.cuda.is_available()}, devices: {torch.cuda.device_count()}")'
# Without CUDA every test would skip and pytest would pass: on a GPU machine that is a failure.
if ! "$PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    echo "run.sh: torch sees no CUDA device; set TORCH_SPEC to a CUDA build matching this driver" >&2
    exit 1
fi

status=0
"$PYTHON" -m pytest tests/gpu -m gpu -v --timeout 300 -p no:cacheprovider || status=$?

# The headline command, as the README writes it (one rank per GPU). Without mlflow (the offline image), untracked.
headline=(backend=nccl wrap=fsdp2 precision=bf16)
if ! "$PYTHON" -c 'import mlflow' 2>/dev/null; then
    echo "run.sh: mlflow is not installed here: the headline command runs with tracking.enabled=false"
    headline+=(tracking.enabled=false)
fi
echo "run.sh: python -m hydraddp ${headline[*]}"
"$PYTHON" -m hydraddp "${headline[@]}" hydra.run.dir=outputs/gpu-headline || status=$?

"$PYTHON" benchmarks/gpu_bench.py || { echo "run.sh: benchmarks/gpu_bench.py failed" >&2; status=1; }
exit "$status"
