#!/usr/bin/env bash
# Set up everything from nothing (a venv with torch pinned, hydraddp editable), then run.
#   bash scripts/dev.sh run  [overrides]    # python -m hydraddp: the default experiment, 2 CPU processes
#   bash scripts/dev.sh test [pytest args]  # the test suite, then tests/vision in a venv of its own (made once)
#                                           # (HYDRADDP_VISION_TESTS=0 skips that second venv)
#   bash scripts/dev.sh docs [serve]        # the documentation site: built into site/ (--strict), or served
# Setup runs once per pyproject.toml version (the dependencies once per machine); later calls go straight to the
# command.
set -euo pipefail
cd "$(dirname "$0")/.."

command=${1:-run}
shift || true
VENV=${VENV:-.venv}
# A bare "torch" can pull a multi-GB CUDA build; 2.13.0 is the CPU build these machines hold.
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
case "$command" in
  run | test | docs) ;;
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

# The venv: a copy, by hard links, of one with hydraddp's dependencies (torch pinned, the command's extras; for the
# tests Horovod too, built against that torch), made once per machine under ~/.cache/hydraddp and shared by every
# clone, as the vision venv is; then hydraddp, editable. Made anew in each clone it was most of the setup's 110
# CPU-seconds (pip unpacks and writes one file at a time), at every CI run on a clean clone. Keyed by what it holds:
# pyproject.toml's dependencies and extras, the torch pin, the Python, and Horovod's build script. A change of any of
# them makes a new one, and the clone's venv is copied again (what was pip-installed into it by hand goes with it).
CACHE=${HYDRADDP_CACHE:-$HOME/.cache/hydraddp}
BASE_PYTHON=${PYTHON:-python3}
dependencies_key() {  # $1: run or test
  (sed -n '/^dependencies = \[/,/^\]/p; /^\[project.optional-dependencies\]/,/^\[tool/p' pyproject.toml
   echo "$1 $TORCH_SPEC"; "$BASE_PYTHON" -c 'import sys; print(sys.version, sys.base_prefix)'
   [ "$1" = run ] || cat scripts/install_horovod.sh) | cksum | cut -d' ' -f1
}
make_dependencies() {  # $1: run or test; the venv $deps (made here, under a lock, unless ready)
  local kind=$1 extras=""
  [ "$kind" = run ] || extras="[test]"
  mkdir -p "$CACHE"
  exec {deps_lock}> "$deps.lock"
  flock "$deps_lock"  # one clone makes it; the others, waiting here, find it ready
  if [ ! -f "$deps/.hydraddp-ready" ]; then
    echo "dev.sh: making the $kind dependencies' venv (once per machine): $deps"
    rm -rf "$deps"
    "$BASE_PYTHON" -m venv "$deps"
    if [ "$kind" = test ]; then
      # Horovod compiles against torch for minutes: its build starts once torch (and what its setup.py imports) is
      # in, and runs beside the second pip call, which is mostly downloads. It only fills the wheel cache; the
      # install itself (a pip call too) comes after. (numpy too: torch imports it when it can, and the build imports
      # torch while the second call installs things.)
      horovod_deps=$(sed -n 's/^HOROVOD_BUILD_DEPS="\(.*\)"$/\1/p' scripts/install_horovod.sh)
      command -v cmake > /dev/null || horovod_deps="$horovod_deps cmake"
      # shellcheck disable=SC2086
      "$deps/bin/python" -m pip install -q --no-compile "$TORCH_SPEC" numpy $horovod_deps
      horovod_log=$(mktemp)
      HOROVOD_BUILD_ONLY=1 PYTHON="$deps/bin/python" bash scripts/install_horovod.sh > "$horovod_log" 2>&1 &
      horovod_build=$!
    else
      "$deps/bin/python" -m pip install -q --no-compile "$TORCH_SPEC"
    fi
    # torch again, so that no extra's dependency (a torchvision, say) can move it to another build. hydraddp itself
    # is installed with its dependencies, then taken out: each clone installs its own checkout, editable.
    "$deps/bin/python" -m pip install -q --no-compile ".${extras}" "$TORCH_SPEC"
    "$deps/bin/python" -m pip uninstall -q -y hydraddp
    if [ "$kind" = test ]; then
      wait "$horovod_build" || { cat "$horovod_log" >&2; exit 1; }
      PYTHON="$deps/bin/python" bash scripts/install_horovod.sh
    fi
    # Bytecode, once, on every core: pip compiles one file at a time (about 65 s here), and where
    # PYTHONDONTWRITEBYTECODE is set every process would compile what it imports again. (Like pip, a file that does
    # not compile is skipped.)
    "$deps/bin/python" -m compileall -q -j 0 "$deps/lib" > /dev/null || true
    # The files that name the venv's own path (scripts' shebangs, activate, pyvenv.cfg): a copy rewrites them.
    grep -rlIF "$deps" "$deps/bin" "$deps/pyvenv.cfg" > "$deps/.hydraddp-paths" || true
    touch "$deps/.hydraddp-ready"
  fi
  exec {deps_lock}>&-  # unlocked: the command this script becomes does not hold it
  # Older keys' venvs (gigabytes each) that no clone has copied for three days.
  find "$CACHE" -maxdepth 1 -name "venv-$kind-*" -type d ! -path "$deps" -mtime +3 -exec rm -rf {} + 2> /dev/null \
    || true
}
copy_dependencies() {  # the clone's venv: $deps, hard-linked (copied across file systems), with its own paths
  local venv_path file
  if [ -e "$VENV" ] && [ ! -f "$VENV/pyvenv.cfg" ]; then
    echo "dev.sh: $VENV is there and is no venv: move it away, or set VENV to another path" >&2
    exit 2
  fi
  rm -rf "$VENV"
  cp -al "$deps" "$VENV" 2> /dev/null || { rm -rf "$VENV"; cp -a "$deps" "$VENV"; }
  venv_path=$(cd "$VENV" && pwd)
  rm -f "$VENV/.hydraddp-ready" "$VENV/.hydraddp-paths"
  while IFS= read -r file; do  # a new file each, not an edit: the old one is a link to the cache's
    file=$VENV${file#"$deps"}
    sed "s|$deps|$venv_path|g" "$file" > "$file.new" && chmod --reference="$file" "$file.new" && mv "$file.new" "$file"
  done < "$deps/.hydraddp-paths"
  touch "$deps"  # copied: not pruned for three days
  "$VENV/bin/python" -m pip install -q --no-deps --no-compile -e .
  echo "$deps" > "$VENV/.hydraddp-dependencies"
}

# run: its own dependencies, or the tests' where the venv has those (they hold run's); docs: those, and its extra.
kind=run
[ "$command" = test ] && kind=test
copied=$(cat "$VENV/.hydraddp-dependencies" 2> /dev/null || true)
if [ "$kind" = run ] && [ "$copied" = "$CACHE/venv-test-$(dependencies_key test)" ]; then
  kind=test
fi
deps=$CACHE/venv-$kind-$(dependencies_key "$kind")
if [ "$copied" != "$deps" ] || [ ! -x "$VENV/bin/python" ]; then
  make_dependencies "$kind"
  copy_dependencies
fi
if [ "$command" = docs ] && [ ! -f "$VENV/.hydraddp-docs-$(cksum pyproject.toml | cut -d' ' -f1)" ]; then
  "$VENV/bin/python" -m pip install -q -e ".[docs]" "$TORCH_SPEC"
  touch "$VENV/.hydraddp-docs-$(cksum pyproject.toml | cut -d' ' -f1)"
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
    # The Horovod tests run for real: it is in the dependencies' venv (this checks that it loads and runs).
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
