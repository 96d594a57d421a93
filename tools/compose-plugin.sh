#!/usr/bin/env bash
# Links the official docker compose v2 binary in .venv (tools/compose-binary.sh, or the path
# given as $1) as the `docker compose` plugin of the project's own Docker CLI configuration,
# .cache/docker. The project's scripts, make targets and molecule set DOCKER_CONFIG to it, so
# their `docker compose` is the pinned one, and the user's home (~/.docker) is left as found:
# a second checkout links its own, and a user's own plugins stay theirs.
set -euo pipefail
cd "$(dirname "$0")/.."
compose=${1:-$(tools/compose-binary.sh)}
plugins=.cache/docker/cli-plugins
mkdir -p "$plugins"
if [ "$(readlink "$plugins/docker-compose" 2>/dev/null)" != "$compose" ]; then
  ln -sfn "$compose" "$plugins/docker-compose"
fi
