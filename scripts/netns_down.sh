#!/bin/bash
# Remove the namespaces gsA and gsB of netns_up.sh (deleting a namespace removes its veth end).
for n in gsA gsB; do ip netns del $n 2>/dev/null; rm -rf /etc/netns/$n; done
exit 0
