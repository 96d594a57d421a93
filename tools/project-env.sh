# shellcheck shell=bash
# Sourced by the project's scripts from the checkout's root: the virtualenv's tools first on
# PATH, and the project's own Docker CLI configuration (.cache/docker, whose cli-plugins holds
# the compose v2 link of tools/compose-plugin.sh), so nothing of theirs reads or writes the
# user's ~/.docker. The Makefile and .config/molecule/config.yml set the same.
export PATH="$PWD/.venv/bin:$PATH"
export DOCKER_CONFIG="$PWD/.cache/docker"
