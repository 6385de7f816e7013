#!/usr/bin/env bash
# Kernel-level link emulation: two network namespaces joined by a veth pair, each end shaped by `tc tbf`.
#   tools/netns_link.sh up [RATE]     RATE like 15gbit, 800mbit (default 1gbit)
#   tools/netns_link.sh down
# Then run one process in each: `ip netns exec sg_prefill …` and `ip netns exec sg_decode …`, reaching each
# other at 169.254.77.1 (sg_prefill) and 169.254.77.2 (sg_decode). Root only. No netem on these kernels:
# delay is not emulated, only rate. The data plane's own pacing (`--link-gbps`) needs none of this.
set -euo pipefail
A=sg_prefill B=sg_decode
if [ "$(id -u)" != 0 ]; then echo "netns_link: needs root (ip netns, tc); skipped" >&2; exit 77; fi
case "${1:-}" in
  up)
    rate=${2:-1gbit}
    ip netns add $A; ip netns add $B
    ip link add sg_veth_a type veth peer name sg_veth_b
    ip link set sg_veth_a netns $A; ip link set sg_veth_b netns $B
    ip -n $A addr add 169.254.77.1/30 dev sg_veth_a; ip -n $B addr add 169.254.77.2/30 dev sg_veth_b
    for ns_dev in "$A sg_veth_a" "$B sg_veth_b"; do
      set -- $ns_dev
      ip -n "$1" link set lo up; ip -n "$1" link set "$2" up
      ip netns exec "$1" tc qdisc add dev "$2" root tbf rate "$rate" burst 1mb latency 50ms
    done
    echo "netns_link: $A (169.254.77.1) <-> $B (169.254.77.2) at $rate"
    ;;
  down)
    ip netns del $A 2>/dev/null || true
    ip netns del $B 2>/dev/null || true
    ;;
  *) echo "usage: $0 up [RATE] | down" >&2; exit 2 ;;
esac
