#!/usr/bin/env bash
# docker-compose.yml for real: build the images, `docker compose up`, wait for both trainers, check the run through
# MLflow's REST API on 127.0.0.1, then `docker compose down -v`.
#   sudo bash scripts/compose_test.sh          # root on a Debian bookworm machine; about 4 minutes from nothing
#   sudo bash scripts/compose_test.sh prepare  # only the tools, dockerd and the images (.ci/run: beside the suite)
#   HYDRADDP_COMPOSE_TEST=0 ...                 # skips it (where there is no root)
#
# It works where no container registry is reachable (scripts/docker_lib.sh: the tools, dockerd, the base images and the
# project's image, shared with scripts/slurm_test.sh). What differs from a user's `docker compose up` is written
# outside the repository, into a temporary directory, and never into docker-compose.yml or the Dockerfile.
# At run time the containers talk only inside the compose network; the test reaches MLflow on loopback.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

if [ "${HYDRADDP_COMPOSE_TEST:-1}" = 0 ]; then
  echo "compose_test: skipped (HYDRADDP_COMPOSE_TEST=0)"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "compose_test: needs root (it installs docker.io and starts dockerd); HYDRADDP_COMPOSE_TEST=0 skips it" >&2
  exit 2
fi

phase=${1:-all}
case "$phase" in prepare | all) ;; *) echo "usage: bash scripts/compose_test.sh [prepare]" >&2; exit 2 ;; esac
started=$(date +%s)
WORK=$(mktemp -d /tmp/hydraddp-compose.XXXXXX)
say() { echo "compose_test: [$(( $(date +%s) - started )) s] $*"; }
source scripts/docker_lib.sh
PROJECT=$PREFIX

compose_up=0
compose() {
  docker compose --project-name "$PROJECT" --project-directory "$REPO" --env-file "$WORK/.env" \
    -f "$REPO/docker-compose.yml" -f "$WORK/override.yml" "$@"
}
cleanup() {
  status=$?
  if [ "$compose_up" = 1 ]; then
    [ "$status" = 0 ] || compose logs --no-color --tail 60 > "$WORK/compose.log" 2>&1 || true
    [ "$status" = 0 ] || { echo "compose_test: the services' last lines:"; cat "$WORK/compose.log"; } >&2
    compose down -v --remove-orphans > /dev/null 2>&1 || true
  fi
  docker_test_end "$status"
}
trap cleanup EXIT

write_env "$WORK/.env"
mlflow_port=$(sed -n 's/^MLFLOW_PORT=//p' "$WORK/.env")
docker_prepare "$WORK/.env"  # the tools, dockerd, the base images and the project's image
[ "$phase" = all ] || exit 0

# -- up, wait for both trainers, check the run -------------------------------------------------------------------------
say "docker compose up: training on 2 nodes x 2 ranks"
compose_up=1
compose up -d --no-build > "$WORK/up.log" 2>&1 || { cat "$WORK/up.log" >&2; exit 1; }
deadline=$(( $(date +%s) + ${HYDRADDP_COMPOSE_TIMEOUT_S:-600} ))
for trainer in trainer0 trainer1; do
  container=$(compose ps -a -q "$trainer")
  while [ "$(docker inspect -f '{{.State.Status}}' "$container")" != exited ]; do
    [ "$(date +%s)" -lt "$deadline" ] || { echo "compose_test: $trainer still runs after the timeout" >&2; exit 1; }
    sleep 2
  done
  code=$(docker inspect -f '{{.State.ExitCode}}' "$container")
  [ "$code" = 0 ] || { echo "compose_test: $trainer exited $code" >&2; exit 1; }
done
say "both trainers exited 0; checking the run at http://127.0.0.1:$mlflow_port"
python3 - "http://127.0.0.1:$mlflow_port" <<'EOF'
import json
import sys
import urllib.parse
import urllib.request

base = sys.argv[1] + "/api/2.0/mlflow"


def call(path, body=None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


experiment = call("/experiments/get-by-name?" + urllib.parse.urlencode({"experiment_name": "compose"}))["experiment"]
runs = call("/runs/search", {"experiment_ids": [experiment["experiment_id"]], "max_results": 10}).get("runs", [])
problems = []
if len(runs) != 1:
    problems.append(f"{len(runs)} runs in the experiment, not one")
run = runs[0] if runs else {"info": {}, "data": {}}
if run["info"].get("status") != "FINISHED":
    problems.append(f"the run is {run['info'].get('status')}, not FINISHED")
metrics = {m["key"] for m in run["data"].get("metrics", [])}
wanted = {"train/loss", *(f"sharding/param_bytes/rank{r}" for r in range(4))}
problems += [f"no metric {key}" for key in sorted(wanted - metrics)]
for node in ("node0", "node1"):
    if not any(key.startswith(f"system/{node}/") for key in metrics):
        problems.append(f"no system/{node}/* metric")
if problems:
    sys.exit("compose_test: " + "; ".join(problems) + f". Metrics: {sorted(metrics)}")
system = sorted(k for k in metrics if k.startswith("system/"))
print(f"compose_test: run {run['info']['run_id']} FINISHED: train/loss, sharding/*/rank0-3, {len(system)} system "
      f"metrics of node0 and node1")
EOF

# -- a lease between two containers sharing a volume (hydraddp.lease: what claims checkpoint.dir, not flock) ----------
say "two containers sharing a volume: one holds the lease, the other is refused until it expires"
LEASE_VOLUME=$PREFIX-lease
docker volume rm -f "$LEASE_VOLUME" > /dev/null 2>&1 || true
contender() {  # NAME SECONDS [docker run options]: one container tries the lease and holds what it got for SECONDS
  local name=$1 seconds=$2
  shift 2
  docker run --rm --name "$PREFIX-$name" --hostname "$name" -v "$LEASE_VOLUME:/shared" "$@" "$PREFIX/hydraddp" \
    python -c 'import sys, time
from pathlib import Path
from hydraddp import lease
lease.DURATION_S, lease.RENEW_S = 8.0, 1.0
held = lease.acquire(Path("/shared/claim"), job_dir=sys.argv[1])
print("held" if held else "refused by " + lease.holder(Path("/shared/claim")).get("host", "?"), flush=True)
time.sleep(float(sys.argv[2]))' "$name" "$seconds"
}
contender first 60 -d > /dev/null
for _ in $(seq 120); do docker logs "$PREFIX-first" 2>&1 | grep -q held && break; sleep 0.5; done
outcome=$(contender second 0)
[ "$outcome" = "refused by first" ] || { echo "compose_test: a second container got a held lease: $outcome" >&2; exit 1; }
docker kill "$PREFIX-first" > /dev/null  # SIGKILL: its lease stays on the volume, no longer renewed
outcome=$(contender second 0)  # another host's holder: refused until its lease expires, though it is dead
[ "$outcome" = "refused by first" ] || { echo "compose_test: a dead container's lease was taken before it expired: $outcome" >&2; exit 1; }
sleep 9
outcome=$(contender second 0)
[ "$outcome" = held ] || { echo "compose_test: an expired lease was not taken over: $outcome" >&2; exit 1; }
docker volume rm -f "$LEASE_VOLUME" > /dev/null
say "the lease held between containers: refused while held and until it expired, taken over after"
