#!/usr/bin/env bash
# A cluster of N "nodes" on one machine: N network namespaces on a private bridge (needs root and `ip`).
#
#   bash scripts/netns-cluster.sh up N [NAME] [SUBNET]    # nodes NAME-n0 .. NAME-n{N-1}
#   bash scripts/netns-cluster.sh down [NAME]             # remove every namespace of NAME
#   bash scripts/netns-cluster.sh addr K [NAME] [SUBNET]  # node K's address
#
# Node k is the namespace NAME-n<k> with interface eth0 at SUBNET.<k+1>/24 and its own loopback; the
# bridge lives in a namespace of its own (NAME-hub), so the host's interfaces, routes and firewall are
# never touched and nothing outside SUBNET.0/24 is reachable from a node. Defaults: NAME=dsab,
# SUBNET=10.213.0 (a private range). Run a command on node k with `ip netns exec NAME-n<k> CMD...`.
set -euo pipefail

cmd="${1:-}"
case "$cmd" in
  up)
    n="${2:?usage: netns-cluster.sh up N [NAME] [SUBNET]}"
    name="${3:-dsab}"
    subnet="${4:-10.213.0}"
    hub="$name-hub"
    if ip netns list | grep -qE "^$name-(hub|n[0-9]+)( |$)"; then
      echo "netns-cluster: namespaces named $name-* exist already (run: $0 down $name)" >&2
      exit 1
    fi
    trap 'echo "netns-cluster: setup failed, removing $name-*" >&2; "$0" down "$name"' ERR
    ip netns add "$hub"
    ip -n "$hub" link set lo up
    ip -n "$hub" link add br0 type bridge
    ip -n "$hub" link set br0 up
    for ((k = 0; k < n; k++)); do
      node="$name-n$k"
      ip netns add "$node"
      ip -n "$node" link set lo up
      ip link add eth0 netns "$node" type veth peer name "p$k" netns "$hub"
      ip -n "$hub" link set "p$k" master br0
      ip -n "$hub" link set "p$k" up
      ip -n "$node" addr add "$subnet.$((k + 1))/24" dev eth0
      ip -n "$node" link set eth0 up
    done
    trap - ERR
    for ((k = 0; k < n; k++)); do echo "$name-n$k $subnet.$((k + 1))"; done
    ;;
  down)
    name="${2:-dsab}"
    for ns in $(ip netns list | awk '{print $1}' | grep -E "^$name-(hub|n[0-9]+)$" || true); do
      # Processes left in a node (a killed test) would keep it alive: end them first.
      for pid in $(ip netns pids "$ns" 2>/dev/null || true); do kill -9 "$pid" 2>/dev/null || true; done
      ip netns delete "$ns"
    done
    ;;
  addr)
    k="${2:?usage: netns-cluster.sh addr K [NAME] [SUBNET]}"
    echo "${4:-10.213.0}.$((k + 1))"
    ;;
  *)
    echo "usage: $0 up N [NAME] [SUBNET] | down [NAME] | addr K [NAME] [SUBNET]" >&2
    exit 2
    ;;
esac
