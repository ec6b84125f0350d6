#!/usr/bin/env bash
# Set up everything from nothing (a venv with torch pinned, hydraddp editable), then run.
#   bash scripts/dev.sh run  [overrides]    # python -m hydraddp: the default experiment, 2 CPU processes
#   bash scripts/dev.sh test [pytest args]  # the test suite, then tests/vision in a venv of its own (made once)
#                                           # (HYDRADDP_VISION_TESTS=0 skips that second venv)
#   bash scripts/dev.sh docs [serve]        # the documentation site: built into site/ (--strict), or served
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
  docs) extras="[docs]" ;;
  *) echo "usage: bash scripts/dev.sh run|test|docs [args]" >&2; exit 2 ;;
esac


# torchvision must be the build made for its torch, and the registry has none for the CPU torch above (its
# torchvision 0.28.0 is a CUDA build: "operator torchvision::nms does not exist"). A second venv holds a pair
# that runs on the CPU, for the torchvision tests (tests/vision) alone. It is several GB, so it is made once per
# machine, in the cache beside Horovod's wheel, and shared by every clone: it holds hydraddp's dependencies but not
# hydraddp, which the tests import from the checkout they run in (pytest's pythonpath).
VISION_SPEC=${VISION_SPEC:-torch==2.14.1 torchvision==0.29.1}
# Keyed by what it holds: hydraddp's dependencies, the vision extra and the pair (not the rest of pyproject.toml).
vision_key=$( (sed -n '/^dependencies = \[/,/^\]/p; /^vision = /p' pyproject.toml; echo "$VISION_SPEC") | cksum | cut -d' ' -f1)
VISION_VENV=${VISION_VENV:-${HYDRADDP_CACHE:-$HOME/.cache/hydraddp}/venv-vision-$vision_key}
vision_tests() {
  if [ ! -f "$VISION_VENV/.hydraddp-ready" ]; then
    rm -rf "$VISION_VENV"
    "${PYTHON:-python3}" -m venv "$VISION_VENV"
    # shellcheck disable=SC2086
    "$VISION_VENV/bin/python" -m pip install -q ".[vision]" "pytest>=8" "pytest-timeout>=2.3" $VISION_SPEC
    "$VISION_VENV/bin/python" -m pip uninstall -q -y hydraddp
    touch "$VISION_VENV/.hydraddp-ready"
  fi
  "$VISION_VENV/bin/python" -m pytest -q -p no:cacheprovider tests/vision
}

# tests/vision runs beside everything else (its own venv, its own processes), and is waited for at the end. It starts
# first, at low priority: its venv is downloads and unpacking, which the main setup's Horovod build leaves room for.
if [ "$command" = test ] && [ "${HYDRADDP_VISION_TESTS:-1}" = 1 ]; then
  vision_log=$(mktemp)
  vision_tests > "$vision_log" 2>&1 &
  vision_pid=$!
  renice -n 10 -p "$vision_pid" > /dev/null
  trap 'kill "$vision_pid" 2> /dev/null || true' EXIT  # a setup that fails leaves nothing running
fi

# The UI tests drive Debian's Chromium (Playwright cannot download a browser here): installed where it is missing
# and this is root, beside the setup below. One apt at a time: CI's compose test installs Docker under the same lock.
if [ "$command" = test ] && [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
  chromium_log=$(mktemp)
  flock /tmp/hydraddp-apt.lock bash -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq chromium' > "$chromium_log" 2>&1 &
  chromium_install=$!
fi

if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
stamp="$VENV/.hydraddp-setup-$(cksum pyproject.toml | cut -d' ' -f1)-${command}"
if [ ! -f "$stamp" ]; then
  if [ "$command" = test ] && ! "$VENV/bin/python" -c 'import horovod.torch' 2> /dev/null; then
    # Horovod compiles against torch for minutes: its build starts once torch (and what its setup.py imports) is in,
    # and runs beside the second pip call, which is mostly downloads. It only fills the wheel cache; the install
    # itself (a pip call too) comes after, below.
    # (numpy too: torch imports it when it can, and the build imports torch while the second call installs things.)
    horovod_deps=$(sed -n 's/^HOROVOD_BUILD_DEPS="\(.*\)"$/\1/p' scripts/install_horovod.sh)
    command -v cmake > /dev/null || horovod_deps="$horovod_deps cmake"
    # shellcheck disable=SC2086
    "$VENV/bin/python" -m pip install -q --no-compile "$TORCH_SPEC" numpy $horovod_deps
    horovod_log=$(mktemp)
    HOROVOD_BUILD_ONLY=1 PYTHON="$VENV/bin/python" bash scripts/install_horovod.sh > "$horovod_log" 2>&1 &
    horovod_build=$!
  else
    "$VENV/bin/python" -m pip install -q --no-compile "$TORCH_SPEC"
  fi
  # torch again, so that no extra's dependency (a torchvision, say) can move it to another build.
  "$VENV/bin/python" -m pip install -q --no-compile -e ".${extras}" "$TORCH_SPEC"
  # Bytecode: pip compiles one file at a time (about 65 s of the setup here), so it is left to the first imports,
  # which write what they import. Where PYTHONDONTWRITEBYTECODE is set they would not, and every process would compile
  # what it imports again: there all of it is compiled once, on every core (20,000 files, about 80 CPU-seconds here).
  # (Like pip, a file that does not compile is skipped.)
  if [ -n "${PYTHONDONTWRITEBYTECODE:-}" ]; then
    "$VENV/bin/python" -m compileall -q -j 0 \
      "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" > /dev/null || true
  fi
  touch "$stamp"
fi

case "$command" in
  run) exec "$VENV/bin/python" -m hydraddp "$@" ;;
  docs)
    export NO_MKDOCS_2_WARNING=1  # Material's notice about its successor, printed at every build
    if [ "${1:-}" = serve ]; then
      exec "$VENV/bin/python" -m mkdocs serve
    fi
    exec "$VENV/bin/python" -m mkdocs build --strict ;;
  test)
    # The Horovod tests run for real: build it (once; later calls find it, or its cached wheel).
    if [ -n "${horovod_build:-}" ]; then
      wait "$horovod_build" || { cat "$horovod_log" >&2; exit 1; }
      cat "$horovod_log"
    fi
    PYTHON="$VENV/bin/python" bash scripts/install_horovod.sh
    if [ -n "${chromium_install:-}" ]; then
      wait "$chromium_install" || { cat "$chromium_log" >&2; echo "Chromium was not installed: the UI tests skip" >&2; }
    fi
    # The checkout's own bytecode too, at each run (it changes): under PYTHONDONTWRITEBYTECODE=1 every launched
    # process would compile again what it imports of hydraddp/ and tests/.
    "$VENV/bin/python" -m compileall -q -j 0 hydraddp hydra_plugins tests benchmarks > /dev/null || true
    status=0
    # Two pytest-xdist workers (this machine's cores), a file each at a time (a file's launches share its module
    # fixtures), the longest files first (tests/conftest.py; --no-loadscope-reorder keeps that order); the 25
    # slowest tests are printed. HYDRADDP_TEST_WORKERS=1 runs one file at a time.
    main_log=$(mktemp)
    set +e
    "$VENV/bin/python" -m pytest -n "${HYDRADDP_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder \
      --durations=25 "$@" 2>&1 \
      | tee "$main_log"
    status=${PIPESTATUS[0]}
    set -e
    if [ "${HYDRADDP_VISION_TESTS:-1}" = 1 ]; then
      echo "tests/vision (in $VISION_VENV):"
      wait "$vision_pid" || status=$?
      cat "$vision_log"
      rm -f "$vision_log"
      echo "the main suite (above):"
      tail -n 1 "$main_log"  # its summary last again, after the vision tests'
    fi
    rm -f "$main_log"
    exit "$status" ;;
esac
