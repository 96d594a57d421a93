#!/usr/bin/env bash
# The lab's Docker engine.
#
#   engine.sh host    print the DOCKER_HOST to use: an engine that already answers, else the project's own
#   engine.sh start   start the project's own engine when none answers (idempotent)
#   engine.sh stop    stop the engine only if this project started it
#
# The project's engine keeps its data under the lab cache (CARDSHARE_LAB_CACHE), so lab images
# survive between runs on the same machine.
set -euo pipefail

CACHE=${CARDSHARE_LAB_CACHE:-/var/cache/cardshare-lab}
SOCK="$CACHE/engine/docker.sock"
PIDFILE="$CACHE/engine/dockerd.pid"
OWNED="$CACHE/engine/owned-by-cardshare"
OWN_HOST="unix://$SOCK"

answers() { DOCKER_HOST="$1" timeout 10 docker info >/dev/null 2>&1; }

existing_host() {
  # An engine the user already runs wins; ours is used only when nothing else answers.
  if [ -n "${CARDSHARE_OUTER_DOCKER_HOST:-}" ] && answers "$CARDSHARE_OUTER_DOCKER_HOST"; then
    echo "$CARDSHARE_OUTER_DOCKER_HOST"; return 0
  fi
  if answers "unix:///var/run/docker.sock"; then echo "unix:///var/run/docker.sock"; return 0; fi
  return 1
}

cmd_host() {
  existing_host || echo "$OWN_HOST"
}

cmd_start() {
  if existing_host >/dev/null; then
    echo "engine: using the engine at $(existing_host)"; return 0
  fi
  if answers "$OWN_HOST"; then echo "engine: the project's engine is running ($OWN_HOST)"; return 0; fi
  if ! command -v dockerd >/dev/null 2>&1; then
    echo "engine: dockerd is not installed; run 'make deps' (installs Debian's docker.io)" >&2; exit 1
  fi
  mkdir -p "$CACHE/engine" "$CACHE/docker"
  echo "engine: starting the project's Docker engine ($OWN_HOST, data in $CACHE/docker)"
  nohup dockerd --data-root "$CACHE/docker" --exec-root "$CACHE/engine/exec" \
    --pidfile "$PIDFILE" -H "$OWN_HOST" --storage-driver overlay2 \
    >"$CACHE/engine/dockerd.log" 2>&1 &
  for _ in $(seq 1 60); do
    if answers "$OWN_HOST"; then touch "$OWNED"; echo "engine: up"; return 0; fi
    sleep 1
  done
  echo "engine: dockerd did not answer within 60 s; its log follows" >&2
  tail -n 30 "$CACHE/engine/dockerd.log" >&2
  exit 1
}

cmd_stop() {
  if [ -f "$OWNED" ] && [ -f "$PIDFILE" ]; then
    pid=$(cat "$PIDFILE")
    echo "engine: stopping the project's engine (pid $pid)"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    rm -f "$OWNED"
  fi
}

case "${1:-}" in
  host) cmd_host ;;
  start) cmd_start ;;
  stop) cmd_stop ;;
  *) echo "usage: $0 host|start|stop" >&2; exit 2 ;;
esac
