#!/bin/bash
# Two fake hosts gsA and gsB for multi-host tests: network namespaces joined by one veth pair
# (vgsA 198.51.100.1, vgsB 198.51.100.2; a documentation range, NO default route, so nothing can
# leave them). Each sees the other by name through /etc/netns/NAME/hosts. Root only; < 1 s.
# Use scripts/nsrsh as the "ssh" into them; remove them with netns_down.sh.
set -euo pipefail
if ! command -v ip >/dev/null; then  # minimal images lack iproute2
  export DEBIAN_FRONTEND=noninteractive
  timeout 300 apt-get update -qq && timeout 300 apt-get install -y -qq --no-install-recommends iproute2 >/dev/null
fi
for n in gsA gsB; do
  ip netns add $n
  mkdir -p /etc/netns/$n   # 'ip netns exec' bind-mounts /etc/netns/NAME/hosts over /etc/hosts
  printf '127.0.0.1 localhost\n198.51.100.1 gsA\n198.51.100.2 gsB\n' > /etc/netns/$n/hosts
done
ip link add vgsA type veth peer name vgsB
ip link set vgsA netns gsA; ip link set vgsB netns gsB
ip netns exec gsA ip addr add 198.51.100.1/24 dev vgsA
ip netns exec gsB ip addr add 198.51.100.2/24 dev vgsB
for n in gsA gsB; do ip netns exec $n ip link set lo up; ip netns exec $n ip link set v$n up; done
