#!/usr/bin/env bash
# Simulated nodes that are real hosts to MPI: N Linux network namespaces on this machine, each
# with its own host name and address, joined by veth links to one bridge. Open MPI starts its
# daemons in them (an rsh agent that enters the namespace) and talks TCP over the bridge, so
# ptrain's node map sees N nodes and inter-node bytes cross a link that `tc` can slow down,
# while ranks of one node share memory as on a real node. mpirun runs in one more namespace,
# ptrnhead. Needs root (ip netns, tc).
#
#   regression/nodes/netns.sh up N [RATE]   make nodes ptrn0 .. ptrn<N-1> on bridge ptrnbr
#                                          (10.77.0.0/24); RATE (e.g. 200mbit) shapes each
#                                          node's link with tc tbf, both ways
#   regression/nodes/netns.sh run SLOTS CMD...
#                                          mpirun over the nodes with SLOTS ranks per node:
#                                          CMD is e.g. "-np 4 build/ptrain deck.nml"
#   regression/nodes/netns.sh link NODE up|down
#                                          take a node's link down (or back up)
#   regression/nodes/netns.sh down         remove the nodes and the bridge
#
# Everything it makes is named ptrn*: `down` removes exactly that. Node names are letters and
# digits only (an underscore broke Open MPI's daemon callback).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
bridge=ptrnbr
net=10.77.0
state=${PTRN_STATE:-/tmp/ptrn-nodes}

die() { echo "netns.sh: $*" >&2; exit 2; }
nodes() { ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^ptrn[0-9]+$' | sort -V || true; }
namespaces() { ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^ptrn([0-9]+|head)$' || true; }

up() {
  local n=$1 rate=${2:-} i
  [ "$(id -u)" = 0 ] || die "needs root (ip netns, tc)"
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || die "up N: N must be a positive number, got '$n'"
  down_quiet
  ip link add "$bridge" type bridge
  ip link set "$bridge" up
  # The nodes, and a head namespace (ptrnhead, like a login node) where mpirun runs. In all of
  # them TCP gives up on an unanswered peer after seconds, not the default quarter of an hour,
  # so a node cut off ends the job promptly; the host's own settings are not touched.
  attach() {  # NAME VETH_INDEX ADDRESS
    ip netns add "$1"
    ip link add "ptrnv$2" type veth peer name "ptrnp$2"
    ip link set "ptrnp$2" netns "$1"
    ip link set "ptrnv$2" master "$bridge" up
    ip -n "$1" link set lo up
    ip -n "$1" addr add "$3/24" dev "ptrnp$2"
    ip -n "$1" link set "ptrnp$2" up
    ip netns exec "$1" sysctl -qw net.ipv4.tcp_retries2=4 net.ipv4.tcp_syn_retries=2
  }
  attach ptrnhead 99 "$net.254"
  for ((i = 0; i < n; i++)); do
    attach "ptrn$i" "$i" "$net.$((i + 1))"
    if [ -n "$rate" ]; then  # both directions: the node's egress and the bridge's egress to it
      ip netns exec "ptrn$i" tc qdisc add dev "ptrnp$i" root tbf rate "$rate" burst 64kb latency 100ms
      tc qdisc add dev "ptrnv$i" root tbf rate "$rate" burst 64kb latency 100ms
    fi
  done
  mkdir -p "$state"
  nodes | sed "s/\$/ slots=1/" >"$state/hostfile"
  # Open MPI's rsh agent: `agent HOST CMD...` runs CMD in namespace HOST under host name HOST.
  cat >"$state/agent.sh" <<AGENT
#!/bin/sh
host=\$1; shift
exec ip netns exec "\$host" unshare --uts sh -c "hostname \$host; \$*"
AGENT
  chmod +x "$state/agent.sh"
  echo "netns.sh: $n node(s) up on $bridge ($net.0/24)${rate:+, links shaped to $rate}: $(nodes | tr '\n' ' ')"
}

run() {
  local slots=$1
  shift
  [ -n "$(nodes)" ] || die "no nodes: run 'netns.sh up N' first"
  [[ "$slots" =~ ^[1-9][0-9]*$ ]] || die "run SLOTS CMD: SLOTS must be a positive number"
  nodes | sed "s/\$/ slots=$slots/" >"$state/hostfile"
  # shellcheck disable=SC2086
  exec ip netns exec ptrnhead mpirun --allow-run-as-root --hostfile "$state/hostfile" \
    --mca plm_rsh_agent "$state/agent.sh" --mca plm_rsh_no_tree_spawn 1 \
    --mca oob_tcp_if_include "$net.0/24" --mca btl_tcp_if_include "$net.0/24" \
    --mca btl self,vader,tcp --mca btl_vader_single_copy_mechanism none \
    --mca oob_tcp_keepalive_time 20 --mca oob_tcp_keepalive_intvl 2 \
    --mca oob_tcp_keepalive_probes 3 \
    -x OMPI_ALLOW_RUN_AS_ROOT=1 -x OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "$@"
}

link() {
  local node=$1 how=$2 i=${1#ptrn}
  [ "$how" = up ] || [ "$how" = down ] || die "link NODE up|down"
  ip link set "ptrnv$i" "$how"
}

down_quiet() {
  local ns
  for ns in $(namespaces); do  # what still runs in one (daemons of a job cut off) goes first
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  done
  ip link del "$bridge" 2>/dev/null || true
  local v
  for v in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' | grep -E '^ptrnv[0-9]+$' || true); do
    ip link del "$v" 2>/dev/null || true
  done
}

case ${1:-} in
  up) shift; up "$@" ;;
  run) shift; run "$@" ;;
  link) shift; link "$@" ;;
  down) down_quiet; rm -rf "$state"; echo "netns.sh: nodes removed" ;;
  *) sed -n '2,21p' "$0"; exit 2 ;;
esac
