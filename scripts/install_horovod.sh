#!/usr/bin/env bash
# Build and install Horovod 0.28.1 (PyTorch + Gloo, CPU) into $PYTHON, then check it really works.
#   bash scripts/install_horovod.sh                  # into .venv (else python3)
#   PYTHON=/path/to/python bash scripts/install_horovod.sh
# Built wheels are kept in $HYDRADDP_WHEEL_CACHE (per horovod/torch/python version): reruns take seconds.
#   HOROVOD_BUILD_ONLY=1 ...   # build the wheel into that cache, install nothing (scripts/dev.sh: beside its pip)
set -euo pipefail
cd "$(dirname "$0")/.."

HOROVOD_VERSION=0.28.1
HOROVOD_BUILD_DEPS="setuptools wheel packaging psutil pyyaml cloudpickle cffi>=1.4.0"
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=$PWD/.venv/bin/python; else PYTHON=python3; fi
fi
die() { echo "install_horovod: $*" >&2; exit 1; }
# The venv's scripts dir goes first on PATH: horovodrun and a pip-installed cmake live there.
bindir=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_path("scripts"))') || die "cannot run $PYTHON"
export PATH="$bindir:$PATH"

# Importing horovod.torch loads the compiled extension; hvd.init() proves the gloo core starts.
if version=$("$PYTHON" -c 'import horovod, horovod.torch as hvd; hvd.init(); hvd.shutdown(); print(horovod.__version__)' 2>/dev/null); then
  echo "Horovod $version is already installed for $PYTHON (torch extension loads); nothing to do."
  exit 0
fi

# Horovod compiles against the installed torch, so torch has to come first.
torch_version=$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null) \
  || die "torch is not installed for $PYTHON; install torch first (e.g. pip install torch==2.13.0): Horovod builds against it"
py_tag=$("$PYTHON" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
# The wheel only works with the torch it was built against: the key holds all three versions.
cache="${HYDRADDP_WHEEL_CACHE:-$HOME/.cache/hydraddp/wheels}/horovod-$HOROVOD_VERSION-torch$torch_version-$py_tag"

tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
# Runtime deps, plus what setup.py needs with --no-build-isolation (it never fetches them itself).
# (Installed by scripts/dev.sh's first pip call, before it starts a build-only run beside its second one.)
[ "${HOROVOD_BUILD_ONLY:-0}" = 1 ] || "$PYTHON" -m pip install -q $HOROVOD_BUILD_DEPS

wheel=$(ls "$cache"/horovod-"$HOROVOD_VERSION"-*.whl 2>/dev/null | head -n1 || true)
if [ -z "$wheel" ]; then
  echo "Building Horovod $HOROVOD_VERSION against torch $torch_version (a few minutes)..."
  "$PYTHON" -m pip download -q --no-deps --no-binary :all: -d "$tmp" "horovod==$HOROVOD_VERSION"
  tar -xzf "$tmp/horovod-$HOROVOD_VERSION.tar.gz" -C "$tmp"
  src="$tmp/horovod-$HOROVOD_VERSION"
  # torch 2.13's headers need C++17; the sdist pins 14. Fail if the lines moved, so a changed sdist is noticed.
  for f in CMakeLists.txt horovod/torch/CMakeLists.txt; do
    grep -q 'set(CMAKE_CXX_STANDARD 14)' "$src/$f" || die "no 'set(CMAKE_CXX_STANDARD 14)' in $f: the sdist changed"
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$src/$f"
  done
  command -v cmake >/dev/null || "$PYTHON" -m pip install -q cmake
  # CMAKE_POLICY_VERSION_MINIMUM: pip's cmake 4.x rejects Horovod's old cmake_minimum_required.
  # MAKEFLAGS: setup.py otherwise runs make -j8 whatever the core count.
  CMAKE_POLICY_VERSION_MINIMUM=3.5 MAKEFLAGS="-j$(nproc)" \
  HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
  HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=gloo \
    "$PYTHON" -m pip wheel -q --no-build-isolation --no-deps -w "$tmp/dist" "$src" \
    || die "building Horovod failed (see the output above)"
  mkdir -p "$cache" && cp "$tmp"/dist/horovod-*.whl "$cache"/
  wheel=$(ls "$cache"/horovod-"$HOROVOD_VERSION"-*.whl | head -n1)
else
  echo "Using cached wheel $wheel"
fi
[ "${HOROVOD_BUILD_ONLY:-0}" = 1 ] && exit 0
"$PYTHON" -m pip install -q --force-reinstall --no-deps "$wheel" || die "installing $wheel failed"

# horovodrun must report both the PyTorch framework and the Gloo controller as built.
check=$(horovodrun --check-build) || die "horovodrun --check-build failed"
echo "$check"
grep -q '\[X\] PyTorch' <<<"$check" || die "Horovod was built without PyTorch"
grep -q '\[X\] Gloo' <<<"$check" || die "Horovod was built without Gloo"

# A real 2-process allreduce over gloo: ranks send 1 and 2, both must get 3. From a file, not
# stdin: horovod.run spawns helpers that re-import __main__ by its path.
cat >"$tmp/check.py" <<'EOF'
import horovod

def fn():
    import torch, horovod.torch as hvd
    hvd.init()
    return hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum).item()

if __name__ == "__main__":
    results = horovod.run(fn, np=2, use_gloo=True)
    assert results == [3.0, 3.0], f"expected [3.0, 3.0], got {results}"
    print(f"2-process gloo allreduce OK: {results}")
EOF
"$PYTHON" "$tmp/check.py" || die "the 2-process Horovod allreduce check failed"
echo "Horovod $HOROVOD_VERSION installed for $PYTHON (torch $torch_version)."
