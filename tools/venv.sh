#!/usr/bin/env bash
# Creates .venv with the pinned development dependencies and the cardshare package,
# again only when requirements-dev.txt or pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.cardshare-stamp
want=$(cat requirements-dev.txt pyproject.toml | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then tools/compose-plugin.sh; exit 0; fi
echo "venv: installing pinned dependencies into .venv"
python3 -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -r requirements-dev.txt
.venv/bin/pip install -q --disable-pip-version-check --no-deps -e .
old="$HOME/.docker/cli-plugins/docker-compose"
if [[ "$(readlink "$old" 2>/dev/null)" == */.venv/lib/python3*/site-packages/compose/docker-compose ]]; then
  echo "venv: $old is a link an earlier make venv placed; the project no longer uses it (rm it)"
fi
# `docker compose` for the project's scripts: linked under .cache/docker (DOCKER_CONFIG),
# never in the user's home
tools/compose-plugin.sh
echo "$want" > "$stamp"
