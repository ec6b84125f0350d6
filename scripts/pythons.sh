#!/usr/bin/env bash
# Every Python that pyproject.toml's requires-python claims, beside the CI machine's own: the checkpoint tests (stop,
# resume, reshard, export, the index), and on 3.13 the fast tests of what leans on the interpreter too, under each
# Debian's own system Python, in a root made by debootstrap (chroot, in a mount namespace of its own: nothing it mounts
# outlives it).
#   sudo bash scripts/pythons.sh                 # all of them (.ci/run)
#   sudo bash scripts/pythons.sh debian13        # one: debian12 (Python 3.11.2), debian13 (Python 3.13)
#   sudo bash scripts/pythons.sh debian13 -- tests/train/test_checkpoint_index.py   # other tests
#   sudo bash scripts/pythons.sh prepare         # only make the roots (.ci/run: beside the suite, at low priority)
#   HYDRADDP_PYTHONS_TEST=0 ...                   # skips it (where there is no root)
# Why Debian's Pythons: what a checkpoint index holds depends on the Python that pickled it (3.11.2 pickles enum
# members through getattr, 3.13 names pathlib._local), and users run the compose image (Debian 12's 3.11.2) and
# Debian 13's. Each root, with a venv of hydraddp's dependencies (not hydraddp: the tests import the checkout they run
# in), is made once per machine under ~/.cache/hydraddp and shared by every clone; made again when they change.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

if [ "${HYDRADDP_PYTHONS_TEST:-1}" = 0 ]; then
  echo "pythons: skipped (HYDRADDP_PYTHONS_TEST=0)"
  exit 0
fi
[ "$(id -u)" = 0 ] || { echo "pythons: needs root (debootstrap, chroot); HYDRADDP_PYTHONS_TEST=0 skips it" >&2; exit 2; }

targets=() tests=() only_prepare=0
while [ $# -gt 0 ]; do
  case "$1" in
    --) shift; tests=("$@"); break ;;
    prepare) only_prepare=1; shift ;;
    debian12 | debian13) targets+=("$1"); shift ;;
    *) echo "usage: bash scripts/pythons.sh [prepare] [debian12] [debian13] [-- pytest args]" >&2; exit 2 ;;
  esac
done
[ ${#targets[@]} -gt 0 ] || targets=(debian12 debian13)
# What each Python runs, unless told (-- pytest args):
# - debian12 (Python 3.11.2, the compose image's: CI's own minor, a patch level apart): the tests marked every_python.
#   What differs between patch levels of one minor is what a pickle holds (3.11.2 pickles enum members through
#   getattr); the rest of the fast tier runs on 3.11.7, and the compose test and the Slurm test run the whole program
#   on 3.11.2 besides, in the image. (Its fast tier here was 234 CPU-s of CI's two cores, and found nothing 3.11.7's
#   did not.)
# - debian13 (Python 3.13, another minor than CI's 3.11.7): the tests marked every_python, and the fast tests of what
#   leans on the interpreter itself rather than on torch: the config's composition and types (tests/config,
#   tests/preflight), signals and exits (tests/test_exit_codes.py), file locks and leases (tests/test_lease.py), and
#   MLflow's stores (tests/tracking). A third of the fast tier's test time, in one run (the checkpoints' launches
#   beside the rest: the longest files first, tests/conftest.py). The rest of the fast tier (meshes, plans, wraps,
#   the docs' checks: torch's numerics and the repository's text, the same on every Python) ran here for 190 of its
#   300 CPU-s of CI's two cores, and found nothing 3.11.7's did not.
PYTHON_SENSITIVE=(tests/train/test_checkpoint.py tests/train/test_checkpoint_index.py
                  tests/train/test_checkpoint_lineage.py tests/distributed/test_init_and_copies.py tests/config
                  tests/preflight tests/test_exit_codes.py tests/test_lease.py tests/tracking)
tests_of() {
  if [ ${#tests[@]} -gt 0 ]; then
    printf '%s\n' "${tests[@]}"
  else
    case "$1" in
      debian12) printf '%s\n' -m every_python tests ;;
      *) printf '%s\n' -m "not slow or every_python" "${PYTHON_SENSITIVE[@]}" ;;
    esac
  fi
}

CACHE=${HYDRADDP_CACHE:-$HOME/.cache/hydraddp}
MIRROR=$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -n 1)
MIRROR=${MIRROR:-http://deb.debian.org/debian}
started=$(date +%s)
say() { echo "pythons: [$(( $(date +%s) - started )) s] $*"; }

# Debian's python3, with venv; g++ and the headers for inductor (trainer.compile); git for the tests that ask it.
PACKAGES=python3,python3-venv,python3-dev,g++,git,ca-certificates
suite_of() { case "$1" in debian12) echo bookworm ;; debian13) echo trixie ;; esac; }
# torch for each: 2.13.0 is the CPU build on this machine's disk for Python 3.11; for 3.13 PyPI has the CUDA build,
# whose CUDA libraries (2.14.1's) also lie on disk here, so only torch itself is downloaded (cached by pip after).
torch_of() { case "$1" in debian12) echo "torch==2.13.0" ;; debian13) echo "torch==2.14.1" ;; esac; }

# hydraddp's dependencies and its test extra, as pyproject.toml lists them.
requirements=$(python3 - <<'EOF'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(project["dependencies"] + project["optional-dependencies"]["test"]))
EOF
)

# Runs "$@" inside root $1, with this checkout at its own path, the machine's package index and CA certificates
# (HTTPS goes through a re-signing proxy here) and pip's cache: all bind mounts of a private mount namespace.
in_root() {
  local root=$1
  shift
  unshare --mount --propagation private bash -euo pipefail -c '
    root=$1 repo=$2; shift 2
    mount -t proc proc "$root/proc"
    mount --rbind /dev "$root/dev"
    mount --rbind /sys "$root/sys"
    mkdir -p "$root$repo" "$root/root/.cache/pip" "$HOME/.cache/pip"
    mount --bind "$repo" "$root$repo"
    mount --bind "$HOME/.cache/pip" "$root/root/.cache/pip"
    for path in /opt/wheels /opt/pypi /opt/pypi-more /etc/xdg/pip; do
      [ -d "$path" ] || continue
      mkdir -p "$root$path"
      mount --bind -o ro "$path" "$root$path"
    done
    for file in /etc/resolv.conf /etc/hosts /etc/ssl/certs/ca-certificates.crt; do
      [ -f "$file" ] && mkdir -p "$(dirname "$root$file")" && touch "$root$file" && mount --bind -o ro "$file" "$root$file"
    done
    exec chroot "$root" env HOME=/root PATH=/opt/venv/bin:/usr/sbin:/usr/bin:/sbin:/bin "$@"
  ' in_root "$root" "$REPO" "$@"
}

prepare() {  # sets root
  local name=$1 suite torch key
  suite=$(suite_of "$name") torch=$(torch_of "$name")
  key=$( (echo "$suite $torch $PACKAGES"; echo "$requirements") | cksum | cut -d' ' -f1)
  root="$CACHE/python-$name-$key"
  if [ ! -f "$root/.hydraddp-ready" ]; then
    if ! command -v debootstrap > /dev/null; then
      say "installing debootstrap"
      # One apt at a time: CI's test setup and compose test install under the same lock.
      flock /tmp/hydraddp-apt.lock bash -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends debootstrap > /dev/null'
    fi
    rm -rf "$root" "$CACHE/python-$name-"*  # an older key's root is gigabytes: one per Debian
    say "$name: debootstrap $suite ($PACKAGES)"
    debootstrap --variant=minbase --include="$PACKAGES" \
      "$suite" "$root" "$MIRROR" > "$root.log" 2>&1 || { tail -n 20 "$root.log" >&2; exit 1; }
    say "$name: a venv with $torch and hydraddp's dependencies"
    printf '%s\n' "$requirements" > "$root/requirements.txt"
    in_root "$root" python3 -m venv /opt/venv
    in_root "$root" /opt/venv/bin/python -m pip install -q --no-compile "$torch" -r /requirements.txt "$torch"
    rm -f "$root.log"
    touch "$root/.hydraddp-ready"
  fi
  # Bytecode, once, on every core (as scripts/dev.sh does for the suite's venv): PYTHONDONTWRITEBYTECODE=1, which CI
  # sets, would otherwise make every process compile what it imports again (measured in the Debian 12 root: import
  # torch 2.2 CPU-s, import mlflow 2.8, against 1.3 and 1.2 compiled). A file that does not compile is skipped.
  if [ ! -f "$root/.hydraddp-compiled" ]; then
    say "$name: compiling the venv's bytecode"
    in_root "$root" /opt/venv/bin/python -m compileall -q -j 0 /opt/venv/lib > /dev/null || true
    touch "$root/.hydraddp-compiled"
  fi
}

mkdir -p "$CACHE"
exec 9> "$CACHE/pythons.lock"
status=0
for name in "${targets[@]}"; do
  flock 9  # one preparation at a time on this machine: every clone shares the roots; the tests run beside others
  prepare "$name"
  flock -u 9
  [ "$only_prepare" = 0 ] || continue
  version=$(in_root "$root" python3 -c 'import platform; print(platform.python_version())')
  say "$name: Python $version"
  mapfile -t selected < <(tests_of "$name")
  say "$name (Python $version): pytest ${selected[*]}"
  # Horovod is not built in these roots: without CI set, its tests and matrix rows skip (in CI's own venv they
  # must run, and CI=true says so there).
  # The checkout's bytecode for this Python as well (each Python has its own files in __pycache__).
  in_root "$root" env -u CI bash -c 'cd "$1" && shift && { python -m compileall -q -j 0 hydraddp hydra_plugins tests \
    > /dev/null || true; } && PYTHONPATH="$PWD" python -m pytest -q -p no:cacheprovider \
    -n 2 --dist loadfile --no-loadscope-reorder "$@"' run "$REPO" "${selected[@]}" || status=1
done
[ "$only_prepare" = 1 ] && say "prepared" || say "$([ "$status" = 0 ] && echo passed || echo FAILED)"
exit "$status"
