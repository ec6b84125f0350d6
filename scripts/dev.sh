#!/usr/bin/env bash
# Set up everything from nothing (a venv with torch pinned, hydraddp editable), then run.
#   bash scripts/dev.sh run  [overrides]    # python -m hydraddp: the default experiment, 2 CPU processes
#   bash scripts/dev.sh test [pytest args]  # the test suite
# Setup runs once per pyproject.toml version; later calls go straight to the command.
set -euo pipefail
cd "$(dirname "$0")/.."

command=${1:-run}
shift || true
VENV=${VENV:-.venv}
# A bare "torch" can pull a multi-GB CUDA build; 2.13.0 is the CPU build these machines hold.
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
case "$command" in
  run) extras="" ;;
  test) extras="[test]" ;;
  *) echo "usage: bash scripts/dev.sh run|test [args]" >&2; exit 2 ;;
esac

if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
stamp="$VENV/.hydraddp-setup-$(cksum pyproject.toml | cut -d' ' -f1)-${command}"
if [ ! -f "$stamp" ]; then
  "$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
  "$VENV/bin/python" -m pip install -q -e ".${extras}"
  touch "$stamp"
fi

case "$command" in
  run) exec "$VENV/bin/python" -m hydraddp "$@" ;;
  test)
    # The Horovod tests run for real: build it (once; later calls find it, or its cached wheel).
    PYTHON="$VENV/bin/python" bash scripts/install_horovod.sh
    exec "$VENV/bin/python" -m pytest "$@" ;;
esac
