#!/usr/bin/env bash
# Generated from configs/topologies/five-region.toml by `gorgo netem --topology <file> --tc-script`; do not edit.
# Usage: sudo $0 up | down | exec <region|region-client> <command...>
# Needs: iproute2 and the sch_netem + sch_htb kernel modules.
# Addresses (bridge gorgo-br, 10.77.0.0/24):
#   us-ashburn       node 10.77.0.10   clients 10.77.0.100
#   eu-frankfurt     node 10.77.0.11   clients 10.77.0.101
#   ap-seoul         node 10.77.0.12   clients 10.77.0.102
#   us-west          node 10.77.0.13   clients 10.77.0.103
#   me-israel        node 10.77.0.14   clients 10.77.0.104
set -euo pipefail
BR=gorgo-br
REGIONS=(us-ashburn eu-frankfurt ap-seoul us-west me-israel)

# netns_add NS IFINDEX IP: a namespace with eth0 on the bridge.
netns_add() {
  local ns=$1 idx=$2 ip=$3
  ip netns add "$ns"
  ip link add "gg$idx" type veth peer name eth0 netns "$ns"
  ip link set "gg$idx" master "$BR" up
  ip -n "$ns" addr add "$ip/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  tc -n "$ns" qdisc add dev eth0 root handle 1: htb default 1
  tc -n "$ns" class add dev eth0 parent 1: classid 1:1 htb rate 10gbit
}

# shape NS CLASS DST_IP NETEM_ARGS...: egress from NS to DST_IP through netem.
shape() {
  local ns=$1 class=$2 dst=$3; shift 3
  tc -n "$ns" class add dev eth0 parent 1: classid "1:$class" htb rate 10gbit
  tc -n "$ns" qdisc add dev eth0 parent "1:$class" handle "$class:" netem limit 100000 "$@"
  tc -n "$ns" filter add dev eth0 protocol ip parent 1: prio 1 u32 match ip dst "$dst/32" flowid "1:$class"
}

up() {
  ip link add "$BR" type bridge
  ip link set "$BR" up
  netns_add gorgo-us-ashburn 0 10.77.0.10
  netns_add gorgo-us-ashburn-client 1 10.77.0.100
  netns_add gorgo-eu-frankfurt 2 10.77.0.11
  netns_add gorgo-eu-frankfurt-client 3 10.77.0.101
  netns_add gorgo-ap-seoul 4 10.77.0.12
  netns_add gorgo-ap-seoul-client 5 10.77.0.102
  netns_add gorgo-us-west 6 10.77.0.13
  netns_add gorgo-us-west-client 7 10.77.0.103
  netns_add gorgo-me-israel 8 10.77.0.14
  netns_add gorgo-me-israel-client 9 10.77.0.104
  shape gorgo-us-ashburn 11 10.77.0.11 delay 45ms
  shape gorgo-us-ashburn 12 10.77.0.12 delay 90ms
  shape gorgo-us-ashburn 13 10.77.0.13 delay 36ms
  shape gorgo-us-ashburn 14 10.77.0.14 delay 67ms
  shape gorgo-us-ashburn 15 10.77.0.100 delay 3ms
  shape gorgo-us-ashburn-client 10 10.77.0.10 delay 3ms
  shape gorgo-eu-frankfurt 10 10.77.0.10 delay 45ms
  shape gorgo-eu-frankfurt 12 10.77.0.12 delay 125ms
  shape gorgo-eu-frankfurt 13 10.77.0.13 delay 83ms
  shape gorgo-eu-frankfurt 14 10.77.0.14 delay 27ms
  shape gorgo-eu-frankfurt 16 10.77.0.101 delay 4ms
  shape gorgo-eu-frankfurt-client 11 10.77.0.11 delay 4ms
  shape gorgo-ap-seoul 10 10.77.0.10 delay 90ms
  shape gorgo-ap-seoul 11 10.77.0.11 delay 125ms
  shape gorgo-ap-seoul 13 10.77.0.13 delay 66ms
  shape gorgo-ap-seoul 14 10.77.0.14 delay 135ms
  shape gorgo-ap-seoul 17 10.77.0.102 delay 5ms
  shape gorgo-ap-seoul-client 12 10.77.0.12 delay 5ms
  shape gorgo-us-west 10 10.77.0.10 delay 36ms
  shape gorgo-us-west 11 10.77.0.11 delay 83ms
  shape gorgo-us-west 12 10.77.0.12 delay 66ms
  shape gorgo-us-west 14 10.77.0.14 delay 140.5ms
  shape gorgo-us-west 18 10.77.0.103 delay 3ms
  shape gorgo-us-west-client 13 10.77.0.13 delay 3ms
  shape gorgo-me-israel 10 10.77.0.10 delay 67ms
  shape gorgo-me-israel 11 10.77.0.11 delay 27ms
  shape gorgo-me-israel 12 10.77.0.12 delay 135ms
  shape gorgo-me-israel 13 10.77.0.13 delay 140.5ms
  shape gorgo-me-israel 19 10.77.0.104 delay 6ms
  shape gorgo-me-israel-client 14 10.77.0.14 delay 6ms
}

down() {
  for r in "${REGIONS[@]}"; do
    ip netns del "gorgo-$r" 2>/dev/null || true
    ip netns del "gorgo-$r-client" 2>/dev/null || true
  done
  ip link del "$BR" 2>/dev/null || true
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  exec) ns=$2; shift 2; exec ip netns exec "gorgo-$ns" "$@" ;;
  *) echo "usage: $0 up | down | exec <region|region-client> <command...>" >&2; exit 2 ;;
esac
