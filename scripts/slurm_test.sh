#!/usr/bin/env bash
# deploy/slurm/compose.yml for real: a Slurm 22.05 cluster (ctl, c1, c2) with MLflow and PostgreSQL, brought up, waited
# for (sinfo: c1 and c2 idle; sacct answers), the checks run on it from the login node, then `down -v`.
#   sudo bash scripts/slurm_test.sh                    # root on a Debian bookworm machine
#   sudo bash scripts/slurm_test.sh prepare            # only the tools, dockerd and the images (beside the suite)
#   sudo bash scripts/slurm_test.sh submit             # only the checks named (scripts/slurm_checks/NAME.py)
#   HYDRADDP_SLURM_TEST=0 ...                           # skips it (where there is no root)
#
# The images are the compose test's (scripts/docker_lib.sh: the base images made locally, the project's image) plus the
# Slurm node image built on it (deploy/slurm/Dockerfile). What differs from a user's `up` is in an override file in a
# temporary directory: those local images, never pulled. Each check is a script in scripts/slurm_checks/, run with the
# image's Python on ctl, the login node, where it submits, waits, and asks sacct and MLflow (http://mlflow:5000).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

if [ "${HYDRADDP_SLURM_TEST:-1}" = 0 ]; then
  echo "slurm_test: skipped (HYDRADDP_SLURM_TEST=0)"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "slurm_test: needs root (it installs docker.io and starts dockerd); HYDRADDP_SLURM_TEST=0 skips it" >&2
  exit 2
fi

phase=all checks=()
for arg in "$@"; do
  case "$arg" in
    prepare) phase=prepare ;;
    -* | */* | *.*) echo "usage: bash scripts/slurm_test.sh [prepare | CHECK...]" >&2; exit 2 ;;
    *) [ -f "scripts/slurm_checks/$arg.py" ] || { echo "slurm_test: no check $arg" >&2; exit 2; }
       checks+=("$arg") ;;
  esac
done
# Every check, in this order (the cluster is shared: each one's jobs end before the next is submitted). timelimit waits
# out its minutes and reads its data slowly: it comes early, while the test suite beside it in CI is at its longest
# files, and the checks that train for real come after.
[ ${#checks[@]} -gt 0 ] || checks=(submit sweep srun timelimit claim refusal requeue lostnode search)
started=$(date +%s)
WORK=$(mktemp -d /tmp/hydraddp-slurm.XXXXXX)
say() { echo "slurm_test: [$(( $(date +%s) - started )) s] $*"; }
source scripts/docker_lib.sh
PROJECT=hydraddp-slurm-test

cluster_up=0 check_log=""
compose() {
  docker compose --project-name "$PROJECT" --env-file "$WORK/.env" \
    -f "$REPO/deploy/slurm/compose.yml" -f "$WORK/slurm-override.yml" "$@"
}
on_ctl() { compose exec -T ctl "$@"; }
cleanup() {
  status=$?
  if [ "$cluster_up" = 1 ]; then
    if [ "$status" != 0 ]; then
      echo "slurm_test: the Slurm daemons' last lines:" >&2  # MLflow's access log would bury them
      compose logs --no-color --tail 15 ctl c1 c2 >&2 2>&1 || true
      # Again after the daemons' lines, so that CI's tail of this output ends with what the check said.
      [ -z "$check_log" ] || { echo "slurm_test: the failed check's last lines:" >&2; tail -n 25 "$check_log" >&2; }
    fi
    compose down -v --remove-orphans > /dev/null 2>&1 || true
  fi
  docker_test_end "$status"
}
trap cleanup EXIT

write_env "$WORK/.env"
docker_prepare "$WORK/.env"  # the tools, dockerd, the base images and the project's image
# The local images for deploy/slurm/compose.yml's services; the node image is built on the project's.
cat > "$WORK/slurm-override.yml" <<EOF
services:
  postgres: {image: $PREFIX/postgres:15, pull_policy: never}
  mlflow: {image: $PREFIX/hydraddp, pull_policy: never}
  ctl: &node {image: $PREFIX/slurm, pull_policy: never, build: {args: {HYDRADDP_IMAGE: $PREFIX/hydraddp}}}
  c1: *node
  c2: *node
EOF
say "building the Slurm node image (Debian's Slurm, munge, MariaDB: about 30 s, seconds once built)"
compose build --quiet ctl 2> >(grep -v "configured to build using Bake" >&2)
[ "$phase" = all ] || exit 0

# -- up, and wait until Slurm schedules and accounts -------------------------------------------------------------------
say "docker compose up: ctl, c1, c2, mlflow, postgres"
cluster_up=1
compose up -d --wait --no-build > "$WORK/up.log" 2>&1 || { cat "$WORK/up.log" >&2; exit 1; }  # MLflow healthy
deadline=$(( $(date +%s) + ${HYDRADDP_SLURM_UP_TIMEOUT_S:-180} ))
until [ "$(on_ctl sinfo -h -N -o '%N %t' 2> /dev/null | sort | tr '\n' ' ')" = "c1 idle c2 idle " ] \
    && on_ctl sacct -n > /dev/null 2>&1; do
  [ "$(date +%s)" -lt "$deadline" ] || { echo "slurm_test: no idle c1, c2 and answering sacct in time:" >&2;
    on_ctl sinfo -N >&2 || true; exit 1; }
  sleep 1
done
say "the cluster is up: c1 and c2 idle, sacct answers"

# -- the checks, each on the login node --------------------------------------------------------------------------------
for check in "${checks[@]}"; do
  say "check $check"
  check_log="$WORK/$check.log"
  code=0
  on_ctl python "/cluster/hydraddp/scripts/slurm_checks/$check.py" 2>&1 | tee "$check_log" || code=${PIPESTATUS[0]}
  [ "$code" = 0 ] || { say "check $check FAILED (exit $code)"; exit "$code"; }
  check_log=""
  say "check $check passed"
done
