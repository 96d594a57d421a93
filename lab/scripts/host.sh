#!/usr/bin/env bash
# The demo's lab host: a systemd container from cardshare-lab/rhel10-sim (SIMULATION:
# RHEL 10 userland dress, simulated Arc card; see lab/SIMULATION.md).
#
#   host.sh up      create and boot it when absent (idempotent)
#   host.sh down    remove it and its Docker volume
set -euo pipefail
NAME=${CARDSHARE_LAB_HOST:-cardshare-lab-host}
VOLUME="cardshare-lab-$NAME-docker"

up() {
  local want have
  want=$(docker image inspect -f '{{.Id}}' cardshare-lab/rhel10-sim:current)
  have=$(docker inspect -f '{{.Image}}' "$NAME" 2>/dev/null || true)
  if [ -n "$have" ] && [ "$have" != "$want" ]; then
    echo "lab host: $NAME runs an older lab image; recreating it"
    down
  elif [ "$(docker inspect -f '{{.State.Running}}' "$NAME" 2>/dev/null)" = true ]; then
    echo "lab host: $NAME is running"; return 0
  fi
  docker rm -f "$NAME" >/dev/null 2>&1 || true
  echo "lab host: creating $NAME"
  docker run -d --name "$NAME" --hostname "$NAME" \
    --cap-add SYS_ADMIN --cap-add NET_ADMIN --security-opt seccomp=unconfined --security-opt apparmor=unconfined \
    -v /sys/fs/cgroup:/sys/fs/cgroup:rw -v "$VOLUME:/var/lib/docker" \
    -v "${CARDSHARE_LAB_CACHE:-/var/cache/cardshare-lab}/images:/var/lib/cardshare-lab/images:ro" \
    --tmpfs /run --tmpfs /run/lock --tmpfs /tmp \
    --restart unless-stopped cardshare-lab/rhel10-sim:current >/dev/null
  for _ in $(seq 1 60); do
    state=$(docker exec "$NAME" systemctl is-system-running 2>/dev/null || true)
    case "$state" in running|degraded) echo "lab host: booted ($state)"; return 0 ;; esac
    sleep 1
  done
  echo "lab host: $NAME did not finish booting in 60 s" >&2; exit 1
}

down() {
  docker rm -f "$NAME" >/dev/null 2>&1 || true
  docker volume rm "$VOLUME" >/dev/null 2>&1 || true
  echo "lab host: $NAME removed"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
