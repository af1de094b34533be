#!/usr/bin/env bash
# shellcheck disable=SC2086  # word splitting of pid lists is intended
# pbs_cluster.sh - a real OpenPBS (the open-source PBS Professional) on the hosts of a running ssh_hosts.sh, for the
# PBS tests (after the reference recipe pbs_fixture.sh of the team's shared notes).
#
#   pbs_cluster.sh build                                  apt build deps, then build tests/infra/openpbs/'s source
#                                                         into $PBS_EXEC (default /opt/pbs; skipped when it is
#                                                         already there)
#   pbs_cluster.sh start --hosts-from SSH_FIXTURE_DIR -d DIR [--ds-port PORT]
#   pbs_cluster.sh stop -d DIR
#
# Layout: the first SSH host runs the server, scheduler, comm and a MOM; every other host a MOM. Each daemon runs in
# its host's network and UTS namespaces (entered from its sshd), so jobs see the host's name and address, and each
# host has its own PBS_HOME (DIR/NAME/home) and configuration file (DIR/NAME/pbs.conf): /etc/pbs.conf is never
# touched. Clients on this machine use DIR/client.conf (PBS_CONF_FILE), printed by `start` with PATH.
# The server is set up as ALCF sets up its machines: the host-level string resource `system` (every node has
# system=fixture) and the job-wide `filesystems`, both known to the scheduler. Queues are the caller's (qmgr).
#
# Facts learned the hard way (see the reference recipe's header):
# - PBS refuses a server whose name resolves to a loopback address: the SSH hosts must be started with
#   --etc-hosts (their names in /etc/hosts, with the bridge addresses).
# - A first start that did not complete leaves pbs_server exiting silently: `pbs_server -t create` repairs it.
# - Root may submit only after `set server acl_roots = root`; `flatuid = true` skips user mapping between hosts.
#
# - The server's PostgreSQL datastore has its socket in /tmp (.s.PGSQL.PORT, PORT 15007 by default) whichever
#   network namespace it runs in: servers running at once need a --ds-port each.
# - PBS checks that no directory above PBS_HOME is writable by others: DIR cannot be under /tmp (use /var/spool).
#
# Needs: root, the SSH fixture's hosts (network namespaces), and the build. Writes only under DIR and $PBS_EXEC.
set -euo pipefail
usage() { awk 'NR>2 && /^#/ {sub(/^# ?/, ""); print; next} NR>2 {exit}' "$0"; }
SOURCE=$(cd "$(dirname "$0")/openpbs" && pwd)  # the upstream source snapshot (its README says which)
PBS_EXEC=${PBS_EXEC:-/opt/pbs}
TIMEOUT=${HVD_PBS_TIMEOUT:-60}

cmd=${1:-}; [ $# -gt 0 ] && shift
DIR=; HOSTS_FROM=; DS_PORT=15007
while [ $# -gt 0 ]; do
  case "$1" in
    -d) DIR=$2; shift 2 ;;
    --hosts-from) HOSTS_FROM=$2; shift 2 ;;
    --ds-port) DS_PORT=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "pbs_cluster: unknown argument $1" >&2; exit 2 ;;
  esac
done
die() { echo "pbs_cluster: $*" >&2; exit 1; }

do_build() {
  [ -x "$PBS_EXEC/sbin/pbs_server" ] || compile_openpbs
  chmod 4755 "$PBS_EXEC/sbin/pbs_iff" "$PBS_EXEC/sbin/pbs_rcp"    # clients authenticate from a reserved port
  id pbsdata >/dev/null 2>&1 || useradd -r -m -s /bin/bash pbsdata   # owner of the server's PostgreSQL datastore
}

compile_openpbs() {
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || die "building OpenPBS needs root and apt-get"
  local tarball; tarball=$(ls "$SOURCE"/openpbs-*.tar.gz 2>/dev/null | head -n1)
  [ -n "$tarball" ] || die "no OpenPBS source tarball under $SOURCE"
  echo "pbs_cluster: building OpenPBS into $PBS_EXEC (apt build deps, then about 2 minutes)" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc make libtool libhwloc-dev libx11-dev libxt-dev \
    libedit-dev libical-dev ncurses-dev perl postgresql-server-dev-all postgresql-contrib postgresql python3-dev \
    tcl-dev tk-dev swig libexpat-dev libssl-dev libxext-dev libxft-dev autoconf automake g++ libcjson-dev >/dev/null
  local src; src=$(mktemp -d)
  tar -xzf "$tarball" -C "$src" --strip-components=1
  if ! (cd "$src" && ./autogen.sh && ./configure --prefix="$PBS_EXEC" && make -j"$(nproc)" && make install) \
      > "$src.log" 2>&1; then
    tail -n 20 "$src.log" >&2; die "build failed: $src.log"
  fi
  rm -rf "$src" "$src.log"
}

# host_run K CMD...: run CMD in host K's network and UTS namespaces, with its PBS configuration
host_run() {
  local k=$1; shift
  local spid; spid=$(cat "$HOSTS_FROM/${NAMES[$k]}/sshd.pid")
  nsenter --net="/proc/$spid/ns/net" --uts="/proc/$spid/ns/uts" \
    env PBS_CONF_FILE="$DIR/${NAMES[$k]}/pbs.conf" PATH="$PBS_EXEC/bin:$PBS_EXEC/sbin:$PATH" "$@"
}

read_hosts() {
  HOSTS_FROM=$(cd "$HOSTS_FROM" && pwd)
  [ -f "$HOSTS_FROM/hosts" ] || die "no running ssh fixture in $HOSTS_FROM"
  NAMES=(); ADDRS=()
  local name addr
  while read -r name addr _; do NAMES+=("$name"); ADDRS+=("$addr"); done < "$HOSTS_FROM/hosts"
  [ "${#NAMES[@]}" -ge 1 ] || die "the ssh fixture in $HOSTS_FROM has no hosts"
  getent hosts "${NAMES[0]}" | grep -q "${ADDRS[0]}" || die "${NAMES[0]} does not resolve to ${ADDRS[0]}: start the SSH hosts with --etc-hosts"
}

write_conf() {  # write_conf K SERVER_DAEMONS(0|1)
  local k=$1 server=$2 name=${NAMES[$1]}
  mkdir -p "$DIR/$name/home"
  cat > "$DIR/$name/pbs.conf" <<EOF
PBS_EXEC=$PBS_EXEC
PBS_HOME=$DIR/$name/home
PBS_SERVER=${NAMES[0]}
PBS_START_SERVER=$server
PBS_START_SCHED=$server
PBS_START_COMM=$server
PBS_START_MOM=1
PBS_CORE_LIMIT=unlimited
PBS_SCP=/usr/bin/scp
PBS_DATA_SERVICE_PORT=$DS_PORT
EOF
}

server_up() { host_run 0 qstat -B >/dev/null 2>&1; }

wait_for() {  # wait_for SECONDS COMMAND...
  local deadline=$(( $(date +%s) + $1 )); shift
  until "$@"; do [ "$(date +%s)" -lt "$deadline" ] || return 1; sleep 0.5; done
}

nodes_free() {
  local free; free=$(host_run 0 pbsnodes -a 2>/dev/null | grep -c '^ *state = free' || true)
  [ "$free" = "${#NAMES[@]}" ]
}

do_start() {
  [ "$(id -u)" = 0 ] || die "must run as root"
  [ -x "$PBS_EXEC/sbin/pbs_server" ] || die "no OpenPBS in $PBS_EXEC: run '$0 build' first"
  [ -n "$DIR" ] && [ -n "$HOSTS_FROM" ] || die "start needs --hosts-from SSH_FIXTURE_DIR and -d DIR"
  read_hosts
  do_stop
  mkdir -p "$DIR"; DIR=$(cd "$DIR" && pwd)
  case $DIR in /tmp/*|/var/tmp/*|/dev/shm/*) die "-d $DIR: PBS refuses a PBS_HOME below a world-writable directory";; esac
  trap 'rc=$?; if [ $rc != 0 ]; then echo "pbs_cluster: start failed, cleaning up; logs under $DIR" >&2; do_stop; fi' EXIT
  local k
  for k in "${!NAMES[@]}"; do
    write_conf "$k" "$([ "$k" = 0 ] && echo 1 || echo 0)"
    host_run "$k" "$PBS_EXEC/libexec/pbs_habitat" > "$DIR/${NAMES[$k]}/habitat.log" 2>&1 \
      || { cat "$DIR/${NAMES[$k]}/habitat.log" >&2; die "pbs_habitat failed on ${NAMES[$k]}"; }
  done
  printf 'PBS_EXEC=%s\nPBS_SERVER=%s\nPBS_HOME=%s\n' "$PBS_EXEC" "${NAMES[0]}" "$DIR/client" > "$DIR/client.conf"
  mkdir -p "$DIR/client"
  # the scheduler schedules on the custom host resource `system` (set before it starts)
  sed -i 's/^resources: "\(.*\)"$/resources: "\1, system"/' "$DIR/${NAMES[0]}/home/sched_priv/sched_config"
  host_run 0 "$PBS_EXEC/libexec/pbs_init.d" start > "$DIR/${NAMES[0]}/start.log" 2>&1 || true
  if ! wait_for 15 server_up; then  # a first start that left the server exiting silently
    host_run 0 sh -c "echo y | $PBS_EXEC/sbin/pbs_server -t create" >> "$DIR/${NAMES[0]}/start.log" 2>&1 || true
    wait_for 15 server_up || { cat "$DIR/${NAMES[0]}/start.log" >&2; die "pbs_server on ${NAMES[0]} did not start"; }
  fi
  local q=(host_run 0 qmgr -c)
  "${q[@]}" "set server acl_roots = root"
  "${q[@]}" "set server flatuid = true"
  "${q[@]}" "set server managers += root@*"   # the tests' qmgr runs on this machine, not on the server's host
  "${q[@]}" "set server scheduler_iteration = 2"
  "${q[@]}" "create resource system type=string, flag=h"
  "${q[@]}" "create resource filesystems type=string"
  for k in "${!NAMES[@]}"; do
    [ "$k" = 0 ] || host_run "$k" "$PBS_EXEC/libexec/pbs_init.d" start > "$DIR/${NAMES[$k]}/start.log" 2>&1 || true
    "${q[@]}" "create node ${NAMES[$k]}" 2>/dev/null || true   # the server's own node may exist already
    "${q[@]}" "set node ${NAMES[$k]} resources_available.system = fixture"
  done
  wait_for "$TIMEOUT" nodes_free || { host_run 0 pbsnodes -a >&2; die "not every MOM came up in ${TIMEOUT}s"; }
  trap - EXIT
  echo "export PBS_CONF_FILE=$DIR/client.conf"
  echo "export PATH=$PBS_EXEC/bin:\$PATH"
  echo "export HVD_PBS_NODES=$(IFS=,; echo "${NAMES[*]}")"
}

do_stop() {
  [ -n "$DIR" ] && [ -d "$DIR" ] || return 0
  local conf pid victims=""
  for conf in "$DIR"/*/pbs.conf "$DIR/client.conf"; do   # client.conf: the qsub daemon clients leave
    [ -f "$conf" ] || continue
    # every process whose configuration or PBS_HOME is ours: daemons, the datastore, jobs and their ranks
    for pid in $(grep -l -z -F "PBS_CONF_FILE=$conf" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3); do
      [ "$pid" = $$ ] || victims="$victims $pid"
    done
  done
  for pid in $(pgrep -f "$DIR/" || true); do [ "$pid" = $$ ] || victims="$victims $pid"; done
  [ -z "${victims// /}" ] || kill -TERM $victims 2>/dev/null || true
  local i; for i in $(seq 30); do
    alive=""; for pid in $victims; do kill -0 "$pid" 2>/dev/null && alive="$alive $pid"; done
    [ -z "$alive" ] && break; sleep 0.1
  done
  [ -z "${alive:-}" ] || kill -KILL $alive 2>/dev/null || true
  [ -n "${HVD_PBS_KEEP:-}" ] || rm -rf "$DIR"
}

case $cmd in
  build) do_build ;;
  start) do_start ;;
  stop) [ -n "$DIR" ] || die "stop needs -d DIR"; do_stop ;;
  *) usage; exit 2 ;;
esac
