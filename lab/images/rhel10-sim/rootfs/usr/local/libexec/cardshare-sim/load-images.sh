#!/bin/sh
# SIMULATION: load the lab's stand-in images once per archive (keyed by its hash file).
set -eu
dir=/var/lib/cardshare-lab/images
want=$(cat "$dir/runtime.hash")
have=$(cat /var/lib/docker/.cardshare-lab-images 2>/dev/null || true)
if [ "$want" = "$have" ]; then
  echo "SIMULATION: lab images $want already loaded"; exit 0
fi
for _ in $(seq 1 30); do docker info >/dev/null 2>&1 && break; sleep 1; done
docker load -q -i "$dir/runtime.tar"
echo "$want" > /var/lib/docker/.cardshare-lab-images
echo "SIMULATION: loaded lab images $want"
