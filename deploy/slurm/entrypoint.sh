#!/usr/bin/env bash
# A Slurm node's start (deploy/slurm/compose.yml): munge with the cluster's one key, then its role's daemons, the last
# in the foreground.
#   slurm-node ctl    # the controller and login node: MariaDB, slurmdbd, slurmctld
#   slurm-node node   # a compute node: slurmd, named after the container's hostname (c1, c2)
set -euo pipefail
role=${1:?usage: slurm-node ctl|node}
KEY=/cluster/munge/munge.key  # on a volume every node mounts: the controller makes it, the others wait for it

if [ "$role" = ctl ] && [ ! -s "$KEY" ]; then
  # 1024 random bytes, as mungekey makes; written whole before anyone can read it.
  dd if=/dev/urandom of="$KEY.tmp" bs=1024 count=1 status=none && chmod 400 "$KEY.tmp" && mv "$KEY.tmp" "$KEY"
fi
for _ in $(seq 300); do [ -s "$KEY" ] && break; sleep 0.2; done
install -o munge -g munge -m 400 "$KEY" /etc/munge/munge.key
install -d -o munge -g munge /run/munge
runuser -u munge -- munged

wait_for_port() {  # PORT: until something listens on it here
  for _ in $(seq 300); do (exec 3<> "/dev/tcp/127.0.0.1/$1") 2> /dev/null && return; sleep 0.2; done
  echo "slurm-node: nothing listens on port $1" >&2
  exit 1
}

case "$role" in
  ctl)
    # slurmdbd's own MariaDB, on its Unix socket only (no network port).
    [ -d /var/lib/mysql/mysql ] || mariadb-install-db --user=mysql --skip-test-db > /dev/null
    install -d -o mysql -g mysql /run/mysqld
    mariadbd --user=mysql --skip-networking --socket=/run/mysqld/mysqld.sock --log-error=/var/log/mysql/error.log &
    for _ in $(seq 300); do mariadb-admin --silent ping > /dev/null 2>&1 && break; sleep 0.2; done
    chmod 600 /etc/slurm/slurmdbd.conf  # slurmdbd refuses a config others can read (it may hold a password)
    slurmdbd -D &
    wait_for_port 6819
    exec slurmctld -D
    ;;
  node)
    exec slurmd -D -N "$(hostname)"
    ;;
  *)
    echo "usage: slurm-node ctl|node" >&2
    exit 2
    ;;
esac
