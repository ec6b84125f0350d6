#!/usr/bin/env bash
# Run the GPU-only tests (and the GPU benchmark, once it exists) on a GPU machine, from a fresh checkout.
#   bash tests/gpu/run.sh
# TORCH_SPEC picks the torch build (default torch==2.13.0, PyPI's CUDA build on Linux), e.g.
#   TORCH_SPEC="torch==2.13.0 --index-url <a CUDA wheel index matching the driver>" bash tests/gpu/run.sh
# NO_INSTALL=1 skips pip (an offline machine whose venv already has everything).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1

# Before touching any venv: on a machine without a GPU driver this script has nothing to test.
if ! nvidia-smi -L; then
    echo "run.sh: nvidia-smi failed: no NVIDIA driver here; run this on a GPU machine" >&2
    exit 1
fi

# Use the project's venv when there is one; otherwise a GPU one of our own.
if [ -d .venv ]; then
    VENV=.venv
else
    VENV=.venv-gpu
    [ -d "$VENV" ] || python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"

if [ "${NO_INSTALL:-0}" != 1 ]; then
    TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
    python -m pip install -q --upgrade pip
    # torch first and pinned: a bare "torch" in the project's requirements could pull another build.
    # A CPU-only build already satisfies "torch==2.13.0" (2.13.0+cpu), so replace it instead.
    # shellcheck disable=SC2086  # TORCH_SPEC may carry pip options
    if python -c 'import sys, torch; sys.exit(0 if torch.version.cuda is None else 1)' 2>/dev/null; then
        python -m pip install -q --force-reinstall $TORCH_SPEC
    else
        python -m pip install -q $TORCH_SPEC
    fi
    python -m pip install -q -e '.[test]'
fi

python -c 'import torch; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, available: {torch.cuda.is_available()}, devices: {torch.cuda.device_count()}")'
# Without CUDA every test would skip and pytest would pass: on a GPU machine that is a failure.
if ! python -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    echo "run.sh: torch sees no CUDA device; set TORCH_SPEC to a CUDA build matching this driver" >&2
    exit 1
fi

status=0
python -m pytest tests/gpu -m gpu -v --timeout 300 || status=$?

if [ -f benchmarks/gpu_bench.py ]; then
    python benchmarks/gpu_bench.py || echo "run.sh: benchmarks/gpu_bench.py failed (exit $?)" >&2
fi
exit "$status"
