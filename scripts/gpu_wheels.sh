#!/usr/bin/env bash
# Fill a wheel folder, here (with the package registries), for tests/gpu/run.sh on an offline GPU machine whose
# preinstalled torch is a CUDA build: hydraddp's pure-Python dependencies that such an image lacks.
#   bash scripts/gpu_wheels.sh [DIR]            # default wheels/gpu (git-ignored; carry it to the GPU machine)
# PYTHON_VERSION picks the GPU machine's Python for the wheels' tags (default 3.12, as on the lent H200).
#
# What goes in: hydra-core, omegaconf, antlr4-python3-runtime (an sdist only on the index: its wheel is built here)
# and torchdata, at the versions the tests run with (pyproject.toml's test venv), plus PyYAML for that Python and
# pytest-timeout (run.sh gives each GPU test a timeout).
# What does not: torch (the machine's own CUDA build), transformers, numpy, pytest (preinstalled there), and mlflow:
# mlflow 3.17.2 with its dependencies is 87 wheels and 182 MB for Python 3.12 (pyarrow, scipy, pandas, scikit-learn,
# matplotlib...), past the 64 MiB that travels to the lent machine, so GPU runs go untracked (run.sh says so).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-wheels/gpu}
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
PY=${PY:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python

PURE=(hydra-core==1.3.8 omegaconf==2.3.1 torchdata==0.11.0 pytest-timeout==2.4.0)
rm -rf "$DIR"
mkdir -p "$DIR"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$DIR" "${PURE[@]}" 'PyYAML>=6'
# antlr4's runtime is pure Python, published as an sdist: build the wheel it would install.
"$PY" -m pip wheel -q --no-deps -w "$DIR" antlr4-python3-runtime==4.9.3
ls -l "$DIR"
du -sh "$DIR"
